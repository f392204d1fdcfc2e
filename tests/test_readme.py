"""The README stays true: its Python example runs as written, and CI's test command is in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_example_runs(tmp_path):
    code = README.split("## What a user does\n```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text, accept = out.stdout.rsplit(None, 1)
    assert "#### 930" in text  # 7 * 90 + 4 * 75
    assert 1.0 <= float(accept) <= 4.0


def test_ci_runs_the_readme_test_command():
    marker = "<!-- test-command -->"
    assert marker in README
    block = README.split(marker, 1)[1].split("```", 2)[1]
    assert "pytest" in block and "notebooks" in block
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()
