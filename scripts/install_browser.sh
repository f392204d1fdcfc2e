#!/usr/bin/env bash
# Installs what tests/browser needs beside .venv (made by scripts/install.sh): Debian's chromium,
# which Playwright drives through its executable_path (Playwright's own browser download is never
# used), a font for the figures' text, and the `browser` extra (playwright) into .venv.
# Idempotent and quiet: it skips what is already there. Needs root or sudo for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "install_browser.sh: no .venv; run scripts/install.sh" >&2; exit 1; }
if ! dpkg -s chromium fonts-liberation >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    log=$(mktemp)
    if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends \
            chromium fonts-liberation; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "install_browser.sh: apt-get could not install chromium" >&2
        exit 1
    fi
    rm -f "$log"
fi
if ! .venv/bin/python -c "import playwright.sync_api" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "playwright>=1.40"  # pyproject.toml's `browser` extra
fi
echo "browser: $(chromium --version 2>/dev/null | head -1) | playwright $(.venv/bin/python -c 'from importlib.metadata import version; print(version("playwright"))')"
