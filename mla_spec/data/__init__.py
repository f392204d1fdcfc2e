"""Data shipped with the package: the embedded tiny DeepSeek-V3-architecture FP4 model."""

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).resolve().parent / "tiny-dsv3-fp4"

__all__ = ["EMBEDDED_MODEL"]
