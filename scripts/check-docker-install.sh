#!/usr/bin/env bash
# Performs the Dockerfile's install steps without Docker, then runs the entrypoint
# the way the image does, so CI proves the image recipe works where no Docker
# daemon is available.
#
#   1. copies the build context the Dockerfile uses (pyproject.toml, README.md,
#      LICENSE, queue/, docs/, config/, systemd/, agent/) into a temp dir, builds the wheel, installs it into a fresh
#      venv (the image's /opt/hl7-agent), imports agent.app.cli
#   2. as uid/gid 10001 (the image's user, via setpriv; when run as root) with a
#      clean environment, configuration from env only (no config file, docs/configuration.md):
#      `hl7-agent check-config`, then `hl7-agent run` with a temp data dir owned by
#      that uid (the image's VOLUME), started from that dir (its WORKDIR)
#   3. waits for `hl7-agent health` (the image's HEALTHCHECK), sends one message
#      with `hl7-agent send` and expects a commit ACK
#   4. SIGTERM (the image's STOPSIGNAL): expects exit 0 and queue.db mode 0600
#
# usage: scripts/check-docker-install.sh
#   env PYTHON: the interpreter (default: python3.11 in /usr/local/bin like the image,
#   else /usr/bin, else python3); as root it must be executable by uid 10001, so not
#   one under /root (pyenv).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    for candidate in /usr/local/bin/python3.11 /usr/bin/python3.11; do
        if [[ -x $candidate ]]; then PYTHON=$candidate; break; fi
    done
fi
IMAGE_UID=10001
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-60}

say() { printf 'check-docker-install: %s\n' "$*"; }
fail() { printf 'check-docker-install: FAIL: %s\n' "$*" >&2; exit 1; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail "$PYTHON is older than 3.11 (the image uses python:3.11-slim)"

work=$(mktemp -d "${TMPDIR:-/tmp}/hl7-agent-docker-check.XXXXXX")
agent_pid=""
cleanup() {
    if [[ -n $agent_pid ]] && kill -0 "$agent_pid" 2>/dev/null; then
        kill -KILL "$agent_pid" 2>/dev/null || true
        wait "$agent_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
chmod 0755 "$work"

# --- builder stage ----------------------------------------------------------
say "building the wheel from the Docker build context"
mkdir -p "$work/src" "$work/wheels"
for item in pyproject.toml README.md LICENSE queue docs config systemd agent; do
    [[ -e $repo/$item ]] || fail "$item is missing, but the Dockerfile COPYs it"
    cp -a "$repo/$item" "$work/src/"
done
find "$work/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
venv=$work/opt/hl7-agent
(
    cd "$work/src"
    export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$work/wheels" .
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install --quiet "$work"/wheels/*.whl
    "$venv/bin/python" -c "import agent.app.cli"
) || fail "the builder stage failed"
chmod -R a+rX "$work/opt"

# --- runtime stage ----------------------------------------------------------
data=$work/data
install -d -m 0700 "$data"
as_image_user=()
if [[ $(id -u) -eq 0 ]]; then
    chown "$IMAGE_UID:$IMAGE_UID" "$data"
    as_image_user=(setpriv "--reuid=$IMAGE_UID" "--regid=$IMAGE_UID" --clear-groups)
    "${as_image_user[@]}" "$venv/bin/python" -c pass 2>/dev/null ||
        fail "uid $IMAGE_UID cannot run $PYTHON (under a private directory?); set PYTHON"
    say "running as uid $IMAGE_UID like the image's USER"
else
    say "not root: running as $(id -un) instead of uid $IMAGE_UID"
fi

free_port() {
    "$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
admin_port=$(free_port)
mllp_port=$(free_port)
upstream_port=$(free_port)

# The image's ENV plus what an operator passes with -e; nothing from this shell.
run_env=(
    env -i
    "PATH=$venv/bin:/usr/local/bin:/usr/bin:/bin"
    HOME=/nonexistent
    LANG=C.UTF-8
    PYTHONUNBUFFERED=1
    PYTHONDONTWRITEBYTECODE=1
    "HL7_AGENT_AGENT__DATA_DIR=$data"
    HL7_AGENT_AGENT__ID=docker-check
    "HL7_AGENT_ADMIN__LISTEN=127.0.0.1:$admin_port"
    "HL7_AGENT_SERVER__URL=ws://127.0.0.1:$upstream_port/agent"
    HL7_AGENT_SERVER__TOKEN=check-only
    "HL7_AGENT_CHANNELS=[{\"name\": \"adt\", \"listen\": \"127.0.0.1:$mllp_port\"}]"
)
in_image() { (cd "$data" && "${as_image_user[@]}" "${run_env[@]}" "$@"); }

say "hl7-agent check-config"
in_image hl7-agent check-config >/dev/null || fail "hl7-agent check-config failed"

say "hl7-agent run (admin 127.0.0.1:$admin_port, MLLP 127.0.0.1:$mllp_port)"
log=$work/agent.log
cd "$data"
"${as_image_user[@]}" "${run_env[@]}" hl7-agent run >"$log" 2>&1 &
agent_pid=$!
cd "$repo"

deadline=$((SECONDS + STARTUP_TIMEOUT))
until in_image hl7-agent health >/dev/null 2>&1; do
    if ! kill -0 "$agent_pid" 2>/dev/null; then
        tail -n 20 "$log" >&2 || true
        fail "hl7-agent run exited before it was healthy"
    fi
    if ((SECONDS >= deadline)); then
        tail -n 20 "$log" >&2 || true
        fail "hl7-agent health did not pass within ${STARTUP_TIMEOUT}s"
    fi
    sleep 0.2
done
say "healthy"

msg=$work/message.hl7
printf '%s\r%s\r%s\r' \
    'MSH|^~\&|CHECK|DOCKER|AGENT|EDGE|20240101120000||ADT^A01^ADT_A01|DOCKERCHECK1|P|2.5.1' \
    'EVN|A01|20240101120000' \
    'PID|1||12345^^^CHECK^MR||TEST^PATIENT' >"$msg"
chmod 0644 "$msg"
in_image hl7-agent send --host 127.0.0.1 --port "$mllp_port" --timeout 10 "$msg" >/dev/null ||
    fail "hl7-agent send did not get an accept ACK"
say "message accepted"

say "SIGTERM"
kill -TERM "$agent_pid"
status=0
wait "$agent_pid" || status=$?
agent_pid=""
if [[ $status -ne 0 ]]; then
    tail -n 20 "$log" >&2 || true
    fail "hl7-agent run exited $status after SIGTERM (want 0)"
fi

[[ -f $data/queue.db ]] || fail "no queue.db in the data dir"
mode=$(stat -c %a "$data/queue.db")
[[ $mode == 600 ]] || fail "queue.db mode is $mode (want 600)"
dmode=$(stat -c %a "$data")
[[ $dmode == 700 ]] || fail "data dir mode is $dmode (want 700)"
if [[ $(id -u) -eq 0 ]]; then
    owner=$(stat -c %u "$data/queue.db")
    [[ $owner == "$IMAGE_UID" ]] || fail "queue.db is owned by uid $owner (want $IMAGE_UID)"
fi
say "ok"
