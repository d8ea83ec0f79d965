#!/usr/bin/env bash
# Screenshot the admin status page in headless Chromium -> docs/status-page.png
#
#   scripts/screenshot-status.sh              # starts scripts/status_page_demo.py (sample data)
#   scripts/screenshot-status.sh URL [OUT]    # a live daemon, e.g. http://127.0.0.1:9575/
#
# Env: PYTHON (default /work/venv/bin/python if present, else python3), CHROMIUM (binary).
# Installs chromium with apt-get when it is missing and we are root.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
url="${1:-}"
out="${2:-$repo/docs/status-page.png}"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x /work/venv/bin/python ]]; then PYTHON=/work/venv/bin/python; else PYTHON=python3; fi
fi

chromium="${CHROMIUM:-}"
if [[ -z "$chromium" ]]; then
    for candidate in chromium chromium-browser google-chrome; do
        if command -v "$candidate" >/dev/null 2>&1; then chromium="$candidate"; break; fi
    done
fi
if [[ -z "$chromium" ]]; then
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        apt-get update >/dev/null && apt-get install -y chromium >/dev/null
        chromium=chromium
    else
        echo "screenshot-status: chromium not found (set CHROMIUM=/path/to/chromium)" >&2
        exit 1
    fi
fi

demo_pid=""
profile="$(mktemp -d)"
cleanup() {
    if [[ -n "$demo_pid" ]]; then
        kill -TERM "$demo_pid" 2>/dev/null || true
        wait "$demo_pid" 2>/dev/null || true
    fi
    rm -rf "$profile"
}
trap cleanup EXIT

if [[ -z "$url" ]]; then
    # The demo prints its URL as its first stdout line once it is listening.
    fifo="$profile/demo.out"
    mkfifo "$fifo"
    (cd "$repo" && exec "$PYTHON" scripts/status_page_demo.py --listen 127.0.0.1:0) >"$fifo" &
    demo_pid=$!
    if ! read -r -t 20 url <"$fifo"; then
        echo "screenshot-status: the demo server did not start" >&2
        exit 1
    fi
fi

mkdir -p "$(dirname "$out")"
"$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --hide-scrollbars --user-data-dir="$profile/chrome" \
    --screenshot="$out" --window-size=1200,800 "$url" >/dev/null 2>&1
test -s "$out"
echo "$out"
