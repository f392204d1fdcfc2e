"""nbval starts each notebook's kernel as the browser tests start theirs: without the Triton
switches the root conftest.py sets for the unit tests (``TRITON_INTERPRET``,
``MLA_SPEC_TRITON_ON_CPU``), so ``import mla_spec`` makes the choices a reader gets (a notebook
that shows a Triton kernel itself on CPU asks for it in its first cell), and with one intra-op
thread (``OMP_NUM_THREADS=1`` unless set: the model's ops are tiny, CI has 2 cores, and torch's
threads spinning on a busy host made notebook 00 6x slower)."""

import os

import pytest

_TEST_SWITCHES = ("TRITON_INTERPRET", "MLA_SPEC_TRITON_ON_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    saved = {k: os.environ.pop(k) for k in _TEST_SWITCHES if k in os.environ}
    threads = "OMP_NUM_THREADS" not in os.environ
    if threads:
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield  # the first cell's setup starts the notebook's kernel
    finally:
        os.environ.update(saved)
        if threads:
            del os.environ["OMP_NUM_THREADS"]
