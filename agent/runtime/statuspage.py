"""The admin status page: plain server-rendered HTML, no JavaScript.

Pure: it turns the ``/status.json`` document (built by ``agent.runtime.admin``) into a
string. Operators open it on a hospital edge host, often through an SSH tunnel,
so it is one small self-contained page that refreshes itself with
``<meta http-equiv="refresh">`` (no script, no external assets).

Every value is HTML-escaped: control ids, channel names, error texts come from
senders and servers we do not control. No message body is ever shown — the
view data has none, and this module never looks for one.

View data keys (all optional; a missing or ``None`` section renders as
"unavailable", with the reason from ``errors`` when there is one)::

    agent_id, version, uptime_s, generated_at (RFC 3339), listeners_up,
    upstream {configured, connected, url, replay, last_error},
    lease_held, stats (the `queue stats --json` shape, SPEC 2),
    recent_failures [{id, channel, control_id, message_type, state,
                      error_code, error_text, attempts, updated_at}],
    errors {section: short reason}
"""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.timefmt import human_bytes, human_duration

#: A channel whose oldest queued row is older than this is shown as lagging,
#: and as stuck past the second threshold (seconds). Display only.
AGE_WARN_S = 300.0
AGE_BAD_S = 3600.0

#: Error texts are shown, but bounded: a server may send a long one.
_MAX_TEXT = 200

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
  background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 24px;display:flex;
  align-items:baseline;gap:18px;flex-wrap:wrap}
header h1{font-size:20px;margin:0}
header .meta{color:#b8c0d0}
main{padding:18px 24px;max-width:1200px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(250px,1fr));gap:12px;
  margin-bottom:18px}
.card{background:#fff;border-radius:6px;padding:12px 14px;border-left:5px solid #9aa3b2;
  box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card h2{font-size:12px;text-transform:uppercase;letter-spacing:.05em;color:#5b6475;margin:0 0 6px}
.card .big{font-size:18px;font-weight:600}
.card .sub{color:#5b6475;font-size:12px;overflow-wrap:anywhere}
.card.ok{border-left-color:#1f9d55}.card.warn{border-left-color:#d98e04}
.card.bad{border-left-color:#cc1f1a}
section{background:#fff;border-radius:6px;padding:12px 14px;margin-bottom:18px;
  box-shadow:0 1px 2px rgba(0,0,0,.08)}
section h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #e3e6eb;vertical-align:top}
th{font-size:12px;color:#5b6475;font-weight:600;background:#fafbfc}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
td.w{white-space:nowrap}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.b-ok{background:#e3f5ea;color:#16703c}.b-warn{background:#fdf1d8;color:#8a5a00}
.b-bad{background:#fbe3e2;color:#a11a16}.b-mute{background:#eceef2;color:#5b6475}
.t-warn{color:#8a5a00;font-weight:600}.t-bad{color:#a11a16;font-weight:600}
.empty{color:#5b6475;font-style:italic}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
"""


def _e(value: Any) -> str:
    """HTML-escape any value (quotes too: values also land in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)




def _when(value: Any) -> str:
    """A timestamp as text: RFC 3339 strings as given, epoch numbers as UTC."""
    if value is None or value == "":
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool):
        moment = _dt.datetime.fromtimestamp(float(value), tz=_dt.UTC)
        return moment.strftime("%Y-%m-%d %H:%M:%SZ")
    return str(value)


def _clip(text: Any) -> str:
    raw = "" if text is None else str(text)
    return raw if len(raw) <= _MAX_TEXT else raw[: _MAX_TEXT - 1] + "…"


def _card(title: str, level: str, big: str, *subs: str) -> str:
    """One summary card; ``big`` and ``subs`` are already-escaped HTML."""
    lines = "".join(f'<div class="sub">{s}</div>' for s in subs if s)
    return (
        f'<div class="card {level}"><h2>{_e(title)}</h2><div class="big">{big}</div>{lines}</div>'
    )


def _unavailable(errors: Mapping[str, Any], section: str) -> str:
    reason = errors.get(section)
    return "unavailable" + (f": {_e(_clip(reason))}" if reason else "")


def _upstream_card(upstream: Mapping[str, Any] | None, errors: Mapping[str, Any]) -> str:
    if upstream is None:
        return _card("Upstream", "warn", _unavailable(errors, "upstream"))
    url = upstream.get("url")
    if not upstream.get("configured", url is not None):
        return _card("Upstream", "", "not configured", "intake only: messages stay queued")
    replay = upstream.get("replay")
    replay_text = (
        "server replays answers"
        if replay is True
        else "server does not replay"
        if replay is False
        else ""
    )
    last_error = upstream.get("last_error")
    subs = [f"<code>{_e(url)}</code>" if url else "", _e(replay_text)]
    if upstream.get("connected"):
        return _card("Upstream", "ok", "connected", *subs)
    if last_error:
        subs.append(f'<span class="t-bad">last error: {_e(_clip(last_error))}</span>')
    return _card("Upstream", "bad", "disconnected", *subs)


def _lease_card(
    lease: Any, held_here: bool | None, stats_ok: bool, errors: Mapping[str, Any]
) -> str:
    here = (
        "held by this process"
        if held_here is True
        else "not held by this process"
        if held_here is False
        else ""
    )
    if not stats_ok:
        return _card("Dispatch lease", "warn", _unavailable(errors, "stats"), _e(here))
    if not isinstance(lease, Mapping):
        return _card(
            "Dispatch lease", "warn", "no holder", "nothing dispatches until a process takes it"
        )
    return _card(
        "Dispatch lease",
        "ok",
        f"{_e(lease.get('holder'))}",
        f"epoch {_e(lease.get('epoch'))} · expires {_e(_when(lease.get('expires_at')))}",
        _e(here),
    )


def _intake_card(listeners_up: Any, errors: Mapping[str, Any]) -> str:
    if listeners_up is None:
        return _card("Intake", "warn", _unavailable(errors, "listeners"))
    if listeners_up:
        return _card("Intake", "ok", "listening", "MLLP listeners are up")
    return _card("Intake", "bad", "not listening", "MLLP listeners are down")


def _queue_card(stats: Mapping[str, Any] | None, errors: Mapping[str, Any]) -> str:
    if stats is None:
        return _card("Queue", "bad", _unavailable(errors, "stats"))
    states: Mapping[str, Any] = stats.get("states") or {}
    backlog = sum(int(states.get(s) or 0) for s in ("queued", "claimed", "inflight"))
    failed = int(states.get("failed") or 0)
    db: Mapping[str, Any] = stats.get("db") or {}
    level = "bad" if failed else "ok"
    counts = " · ".join(f"{_e(k)} {_e(v)}" for k, v in states.items())
    size = f"db {_e(human_bytes(db.get('size_bytes')))}, wal {_e(human_bytes(db.get('wal_bytes')))}"
    failed_text = f'<span class="t-bad">{failed} failed: need review</span>' if failed else ""
    return _card("Queue", level, f"{backlog} pending", counts, size, failed_text)


def _age_cell(age: Any) -> str:
    if age is None:
        return '<td class="n">—</td>'
    seconds = float(age)
    cls = "t-bad" if seconds >= AGE_BAD_S else "t-warn" if seconds >= AGE_WARN_S else ""
    text = _e(human_duration(seconds))
    return (
        f'<td class="n"><span class="{cls}">{text}</span></td>'
        if cls
        else f'<td class="n">{text}</td>'
    )


def _channels_section(stats: Mapping[str, Any] | None, errors: Mapping[str, Any]) -> str:
    head = "<section><h2>Channels</h2>"
    if stats is None:
        return f'{head}<p class="empty">{_unavailable(errors, "stats")}</p></section>'
    channels: Mapping[str, Any] = stats.get("channels") or {}
    if not channels:
        return f'{head}<p class="empty">No channels.</p></section>'
    rows = []
    for name in sorted(channels):
        ch: Mapping[str, Any] = channels[name] or {}
        paused = bool(ch.get("paused"))
        badge = (
            '<span class="badge b-warn">paused</span>'
            if paused
            else '<span class="badge b-ok">dispatching</span>'
        )
        rows.append(
            f"<tr><td><code>{_e(name)}</code></td>"
            f'<td class="n">{_e(ch.get("queued", 0))}</td>'
            f'<td class="n">{_e(ch.get("claimed", 0))}</td>'
            f'<td class="n">{_e(ch.get("inflight", 0))}</td>'
            f"{_age_cell(ch.get('oldest_queued_age_s'))}<td>{badge}</td></tr>"
        )
    return (
        f'{head}<table><thead><tr><th>channel</th><th class="n">queued</th>'
        f'<th class="n">claimed</th><th class="n">inflight</th>'
        f'<th class="n">oldest queued</th><th>dispatch</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></section>"
    )


def _failures_section(
    failures: Sequence[Mapping[str, Any]] | None, errors: Mapping[str, Any]
) -> str:
    head = "<section><h2>Recent failures</h2>"
    if failures is None:
        return f'{head}<p class="empty">{_unavailable(errors, "recent_failures")}</p></section>'
    if not failures:
        return f'{head}<p class="empty">None.</p></section>'
    rows = []
    for f in failures:
        state = f.get("state")
        cls = "b-bad" if state == "failed" else "b-warn" if state == "rejected" else "b-mute"
        code = f.get("error_code")
        rows.append(
            f"<tr><td><code>{_e(f.get('id'))}</code></td>"
            f'<td class="w"><code>{_e(f.get("channel"))}</code></td>'
            f"<td><code>{_e(f.get('control_id'))}</code></td>"
            f'<td class="w">{_e(f.get("message_type"))}</td>'
            f'<td><span class="badge {cls}">{_e(state)}</span></td>'
            f"<td>{'<b>' + _e(code) + '</b>' if code is not None else ''}"
            f"{' ' if code is not None and f.get('error_text') else ''}"
            f"{_e(_clip(f.get('error_text')))}</td>"
            f'<td class="n">{_e(f.get("attempts"))}</td>'
            f'<td class="w">{_e(_when(f.get("updated_at")))}</td></tr>'
        )
    return (
        f"{head}<table><thead><tr><th>id</th><th>channel</th><th>control id</th>"
        '<th>type</th><th>state</th><th>error</th><th class="n">attempts</th><th>when</th></tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def render_status_page(view_data: dict[str, Any], *, refresh_seconds: int = 5) -> str:
    """The whole status page as one HTML string (UTF-8, self-contained)."""
    errors: Mapping[str, Any] = view_data.get("errors") or {}
    stats = view_data.get("stats")
    stats_map: Mapping[str, Any] | None = stats if isinstance(stats, Mapping) else None
    upstream = view_data.get("upstream")
    refresh = (
        f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">'
        if refresh_seconds > 0
        else ""
    )
    agent_id = view_data.get("agent_id")
    cards = "".join(
        (
            _upstream_card(upstream if isinstance(upstream, Mapping) else None, errors),
            _lease_card(
                stats_map.get("lease") if stats_map else None,
                view_data.get("lease_held"),
                stats_map is not None,
                errors,
            ),
            _intake_card(view_data.get("listeners_up"), errors),
            _queue_card(stats_map, errors),
        )
    )
    failures = view_data.get("recent_failures")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"{refresh}"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>hl7-agent {_e(agent_id)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>hl7-agent <code>{_e(agent_id)}</code></h1>"
        f'<span class="meta">version {_e(view_data.get("version"))}</span>'
        f'<span class="meta">up {_e(human_duration(view_data.get("uptime_s")))}</span>'
        f'<span class="meta">as of {_e(_when(view_data.get("generated_at")))}</span>'
        "</header><main>"
        f'<div class="cards">{cards}</div>'
        f"{_channels_section(stats_map, errors)}"
        f"{_failures_section(failures if isinstance(failures, list) else None, errors)}"
        "</main></body></html>\n"
    )
