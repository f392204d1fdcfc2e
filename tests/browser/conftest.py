"""Fixtures of the browser tests: a JupyterLab server on 127.0.0.1 over a temporary copy of the
notebooks, and Debian's chromium driven by Playwright (launched by its ``executable_path``;
Playwright's own browser download is never used). ``bash scripts/install_browser.sh`` installs
both. Where either is missing the tests skip and say so, unless ``MLA_SPEC_REQUIRE_BROWSER=1``
(CI's ``.ci/run`` sets it), where they fail.

The server's environment has no ``TRITON_INTERPRET`` and no ``MLA_SPEC_TRITON_ON_CPU`` (the root
conftest.py sets both for the other tests): each notebook runs on a fresh kernel as a user's
would, with no variable set. ``MLA_SPEC_BROWSER_NOTEBOOKS=DIR`` points the tests at another
notebooks folder (e.g. a copy with a figure broken on purpose, to see the tests fail).
"""

from __future__ import annotations

import os

import pytest
from lab_server import CHROMIUM_ARGS, LabServer, chromium_path, missing


@pytest.fixture(scope="session")
def browser():
    why = missing()
    if why:
        msg = f"{why}: run `bash scripts/install_browser.sh` for the browser tests"
        if os.environ.get("MLA_SPEC_REQUIRE_BROWSER", "0") not in ("", "0"):
            pytest.fail(msg + " (MLA_SPEC_REQUIRE_BROWSER is set: CI must run them)")
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS,
                                      headless=True)
        yield chromium
        chromium.close()
    finally:
        pw.stop()


@pytest.fixture(scope="session")
def lab(browser, tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("lab"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


TIMINGS: dict[str, dict[str, float]] = {}  # notebook -> seconds per phase of its test
SLOW_CELLS: dict[str, list] = {}  # notebook -> its slowest cells: (index, seconds, first line)


@pytest.fixture(scope="session")
def notebook_timings():
    return TIMINGS


@pytest.fixture(scope="session")
def slow_cells():
    return SLOW_CELLS


def pytest_terminal_summary(terminalreporter):
    if not TIMINGS:
        return
    terminalreporter.section("browser: seconds per notebook: open (page + kernel), Run All, "
                             "checks (drawing, interaction), close")
    for name, phases in TIMINGS.items():
        split = " ".join(f"{k} {v:.1f}" for k, v in phases.items())
        terminalreporter.write_line(f"{name:32s} {sum(phases.values()):6.1f}  ({split})")
        for i, seconds, src in SLOW_CELLS.get(name, []):
            terminalreporter.write_line(f"{'':36s} cell {i:2d} {seconds:5.1f} s  {src[:48]}")
    total = sum(sum(p.values()) for p in TIMINGS.values())
    terminalreporter.write_line(f"{'total':32s} {total:6.1f}")
