#!/usr/bin/env bash
# Refreshes docs/status-page-<state>.png (flowing, retrying, blocked, upstream-down) from the
# browser test: tests/system/test_status_page_browser.py brings a real daemon into each state
# with the dev server, checks what headless Chromium renders, takes a 700 px wide screenshot,
# and copies it to HL7_AGENT_SCREENSHOT_DIR when that is set. The test never reads these files.
#
# usage: scripts/status-page-screenshots.sh
#   env PYTHON: the interpreter with the test extras (default: .venv/bin/python, else python3)
#   env CHROMIUM: the browser (default: chromium on PATH; `apt-get install chromium`)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $repo/.venv/bin/python ]]; then PYTHON=$repo/.venv/bin/python; else PYTHON=python3; fi
fi
cd "$repo"
HL7_AGENT_SCREENSHOT_DIR="$repo/docs" "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/system/test_status_page_browser.py -k TestEachStateInChromium
ls -l docs/status-page-*.png
