"""The JupyterLab server and browser settings the browser tests use (fixtures in conftest.py)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = Path(os.environ.get("MLA_SPEC_BROWSER_NOTEBOOKS") or REPO / "notebooks")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-quic"]
# JupyterLab settings for the test server: no "get notified about Jupyter news?" toast over the
# page; each cell's execution times in its metadata (the tests report the slowest cells)
LAB_SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                {"fetchNews": "false", "checkForUpdates": False},
                "@jupyterlab/notebook-extension/tracker.jupyterlab-settings":
                {"recordTiming": True}}


def chromium_path() -> str | None:
    """The system browser: ``MLA_SPEC_CHROMIUM``, else chromium on PATH (Debian's package)."""
    return (os.environ.get("MLA_SPEC_CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser"))


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed in this Python"
    path = chromium_path()
    if path is None:
        return "no chromium on PATH (Debian's package `chromium`)"
    if not os.access(path, os.X_OK):
        return f"the browser {path} is not an executable file"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """A JupyterLab server started by the tests; ``url(path)`` adds the token."""

    def __init__(self, root: Path):
        self.root = root
        self.notebooks = root / "notebooks"
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.log = root / "jupyter-lab.log"
        self.proc: subprocess.Popen | None = None

    def url(self, path: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?token={self.token}{query}"

    def start(self, timeout_s: float = 120.0) -> None:
        shutil.copytree(NOTEBOOKS_DIR, self.notebooks,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        if (REPO / "benchmarks").is_dir():  # the notebooks' GPU cells import ../benchmarks
            (self.root / "benchmarks").symlink_to(REPO / "benchmarks")
        settings = self.root / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(values))
        env = {k: v for k, v in os.environ.items()
               if k not in ("TRITON_INTERPRET", "MLA_SPEC_TRITON_ON_CPU")}
        env.update({f"JUPYTER_{d.upper()}_DIR": str(self.root / f"jupyter-{d}")  # no user config
                    for d in ("config", "data", "runtime")})
        # one intra-op thread per kernel: the browser and the server share the 2 CI cores with it
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", f"--ServerApp.token={self.token}",
               "--ServerApp.password=", "--allow-root", f"--ServerApp.root_dir={self.notebooks}",
               "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands by name
               f"--LabApp.user_settings_dir={settings}",
               f"--LabApp.workspaces_dir={self.root / 'lab-workspaces'}"]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(cmd, env=env, cwd=self.notebooks, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url("api/status"), timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer in {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


