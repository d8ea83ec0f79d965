#!/usr/bin/env bash
# Zero-downtime upgrade of the hl7-agent blue/green pair (docs/deploy.md).
#
# usage: upgrade.sh [--install PACKAGE] [--to blue|green] [--timeout SECONDS]
#
#   1. finds the running colour (hl7-agent@blue or hl7-agent@green); the other one is idle
#   2. with --install, recreates the idle colour's venv /opt/hl7-agent-<idle> and
#      pip-installs PACKAGE (a wheel file, or a requirement such as hl7-agent==1.2.0) there
#   3. starts the idle colour; with Type=notify it is "active" only after READY=1
#      (listeners shared via hl7-agent.socket or the handover socket, database open)
#   4. waits until `hl7-agent health` passes against the idle colour's admin address
#      (HL7_AGENT_ADMIN__LISTEN from /etc/hl7-agent/<colour>.env)
#   5. stops the old colour: it stops accepting, finishes what it reads, waits for its
#      in-flight transmits and releases the lease, which the new colour then takes
#   6. enables the new colour and disables the old, so a reboot starts the new one
#
# If the new colour is not ready and healthy within --timeout seconds, it is stopped,
# the old colour keeps running untouched, and the script exits 1 saying why.
# With no colour running it simply starts one (blue unless --to says otherwise).
#
# Environment overrides (for tests and unusual layouts): SYSTEMCTL, HL7_AGENT_ETC,
# HL7_AGENT_PREFIX, HL7_AGENT_UNIT, PYTHON, HL7_AGENT_UPGRADE_POLL.
set -euo pipefail

SYSTEMCTL=${SYSTEMCTL:-systemctl}
ETC_DIR=${HL7_AGENT_ETC:-/etc/hl7-agent}
PREFIX=${HL7_AGENT_PREFIX:-/opt/hl7-agent-}
UNIT=${HL7_AGENT_UNIT:-hl7-agent}
PYTHON=${PYTHON:-python3}
POLL=${HL7_AGENT_UPGRADE_POLL:-1}
TIMEOUT=90
INSTALL=""
TARGET=""

say() { printf 'upgrade: %s\n' "$*"; }
die() { printf 'upgrade: error: %s\n' "$*" >&2; exit 1; }
usage() {
    sed -n '3,4s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --install) [[ $# -ge 2 ]] || usage; INSTALL=$2; shift 2 ;;
        --to) [[ $# -ge 2 ]] || usage; TARGET=$2; shift 2 ;;
        --timeout) [[ $# -ge 2 ]] || usage; TIMEOUT=$2; shift 2 ;;
        -h | --help) usage ;;
        *) printf 'upgrade: unknown argument: %s\n' "$1" >&2; usage ;;
    esac
done
[[ $TIMEOUT =~ ^[0-9]+$ && $TIMEOUT -gt 0 ]] || die "--timeout must be a positive number of seconds"
[[ -z $TARGET || $TARGET == blue || $TARGET == green ]] || die "--to must be blue or green"

unit_of() { printf '%s@%s.service' "$UNIT" "$1"; }
is_active() { "$SYSTEMCTL" is-active --quiet "$(unit_of "$1")"; }
other() { if [[ $1 == blue ]]; then echo green; else echo blue; fi; }

# Export KEY=VALUE lines of a systemd EnvironmentFile without executing it
# (comments, blank lines, optional quotes; no shell expansion).
load_env() {
    local file=$1 line key value
    [[ -r $file ]] || return 0
    while IFS= read -r line || [[ -n $line ]]; do
        line=${line#"${line%%[![:space:]]*}"}
        [[ -z $line || $line == \#* || $line == \;* ]] && continue
        line=${line#export }
        [[ $line == *=* ]] || continue
        key=${line%%=*}
        key=${key%"${key##*[![:space:]]}"}
        value=${line#*=}
        value=${value#"${value%%[![:space:]]*}"}
        [[ $key =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
        if [[ ${#value} -ge 2 && ( ($value == \"*\") || ($value == \'*\') ) ]]; then
            value=${value:1:${#value}-2}
        fi
        export "$key=$value"
    done <"$file"
}

# `hl7-agent health` as the new colour sees its configuration (exit 0 = live).
health_of() {
    local colour=$1
    (
        load_env "$ETC_DIR/agent.env"
        load_env "$ETC_DIR/$colour.env"
        args=(health)
        if [[ -r $ETC_DIR/agent.toml ]]; then args+=(--config "$ETC_DIR/agent.toml"); fi
        exec "$PREFIX$colour/bin/hl7-agent" "${args[@]}"
    ) >/dev/null 2>&1
}

# --- which colour is which ------------------------------------------------
old=""
old_unit=""
if is_active blue && is_active green; then
    die "both hl7-agent@blue and hl7-agent@green are running (an earlier upgrade did not finish); stop the one you do not want, then rerun"
elif is_active blue; then
    old=blue
elif is_active green; then
    old=green
fi
if [[ -n $TARGET ]]; then
    [[ $TARGET != "$old" ]] || die "$(unit_of "$TARGET") is the running colour; choose the idle one"
    new=$TARGET
elif [[ -n $old ]]; then
    new=$(other "$old")
else
    new=blue
fi
new_unit=$(unit_of "$new")

[[ -r $ETC_DIR/$new.env ]] ||
    die "$ETC_DIR/$new.env is missing: each colour needs its own HL7_AGENT_ADMIN__LISTEN"

# --- install into the idle colour's tree -----------------------------------
if [[ -n $INSTALL ]]; then
    say "installing $INSTALL into $PREFIX$new"
    "$PYTHON" -m venv --clear "$PREFIX$new"
    "$PREFIX$new/bin/pip" install --quiet --no-cache-dir --disable-pip-version-check "$INSTALL"
fi
[[ -x $PREFIX$new/bin/hl7-agent ]] ||
    die "$PREFIX$new/bin/hl7-agent does not exist; install the new version there (--install PACKAGE)"

rollback() {
    printf 'upgrade: error: %s did not come up: %s\n' "$new_unit" "$1" >&2
    "$SYSTEMCTL" stop "$new_unit" || true
    if [[ -n $old ]]; then
        printf 'upgrade: rolled back: %s was stopped, %s keeps running\n' \
            "$new_unit" "$(unit_of "$old")" >&2
    fi
    exit 1
}

# --- start the new colour and wait for READY=1 ------------------------------
deadline=$((SECONDS + TIMEOUT))
say "starting $new_unit${old:+ next to $(unit_of "$old")}"
"$SYSTEMCTL" reset-failed "$new_unit" >/dev/null 2>&1 || true
# Blocking start returns once systemd saw READY=1 (Type=notify), or failed.
if ! timeout --foreground "$TIMEOUT" "$SYSTEMCTL" start "$new_unit"; then
    rollback "no READY=1 within ${TIMEOUT}s, or the start failed (journalctl -u $new_unit)"
fi

# --- wait for its health endpoint -------------------------------------------
until health_of "$new"; do
    is_active "$new" || rollback "it exited after READY=1 (journalctl -u $new_unit)"
    ((SECONDS < deadline)) || rollback "hl7-agent health did not pass within ${TIMEOUT}s"
    sleep "$POLL"
done
say "$new_unit is ready and healthy"

# --- retire the old colour --------------------------------------------------
"$SYSTEMCTL" enable --quiet "$new_unit"
if [[ -n $old ]]; then
    old_unit=$(unit_of "$old")
    say "stopping $old_unit (it drains and hands the lease over)"
    if ! "$SYSTEMCTL" stop "$old_unit"; then
        die "$old_unit did not stop cleanly; $new_unit is running — check both units"
    fi
    "$SYSTEMCTL" disable --quiet "$old_unit"
fi
is_active "$new" || die "$new_unit is no longer active (journalctl -u $new_unit)"
say "done: $new_unit is serving${old:+ (was $(unit_of "$old"))}"
