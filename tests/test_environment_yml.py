"""environment.yml: every conda spec parses strictly (py-rattler, offline) and agrees with
pyproject."""

import re
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
rattler = pytest.importorskip("rattler")


def _env():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_conda_specs_are_strictly_valid():
    specs = [d for d in _env()["dependencies"] if isinstance(d, str)]
    assert specs, "environment.yml lists no conda dependencies"
    for spec in specs:
        rattler.MatchSpec(spec, strict=True)  # raises on a malformed spec


def test_pip_section_installs_the_package_with_extras():
    pips = [d for d in _env()["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1
    assert "-e .[notebooks,dev]" in pips[0]["pip"]
    extras = _pyproject()["project"]["optional-dependencies"]
    assert {"notebooks", "dev", "gpu"} <= set(extras)


def test_consistent_with_pyproject():
    env = {rattler.MatchSpec(d, strict=True).name.normalized: d
           for d in _env()["dependencies"] if isinstance(d, str)}
    proj = _pyproject()["project"]
    floor = re.search(r">=\s*3\.(\d+)", proj["requires-python"]).group(1)
    assert f">=3.{floor}" in env["python"], "python floor differs from requires-python"
    runtime = {re.split(r"[<>=!~ \[]", d)[0].lower(): d for d in proj["dependencies"]}
    conda_to_pip = {"pytorch": "torch"}
    for name, spec in env.items():
        pip_name = conda_to_pip.get(name, name)
        if pip_name in ("python", "pip"):
            continue
        assert pip_name in runtime, f"{name} is in environment.yml but not a pyproject dependency"
        floor_env = re.search(r">=([\d.]+)", spec)
        floor_pip = re.search(r">=([\d.]+)", runtime[pip_name])
        if floor_env and floor_pip:
            assert floor_env.group(1) == floor_pip.group(1), (
                f"{name}: {spec} vs {runtime[pip_name]}")
