"""The admin status page: plain server-rendered HTML and SVG, no JavaScript.

Pure: it turns the ``/status.json`` document (agent.runtime.statusview) into a
string. Operators open it on a hospital edge host, often through an SSH tunnel
and a narrow window, so it is one small self-contained page, readable at 700
px, that refreshes itself with ``<meta http-equiv="refresh">`` (no script, no
external asset: the Content-Security-Policy allows inline styles only).
Chromium handles a refresh to the same address as a reload and keeps the
scroll position (tests/system/test_status_page_browser.py checks it).

What it says comes from the document's ``assessment`` (agent.core.status: each
channel's state in words and its colour); a document without one (an older
caller) is assessed here from its facts. The state of a channel is a word and
a class: ``st-flowing``, ``st-idle``, ``st-retrying``, ``st-paused``,
``st-blocked``, ``st-upstream-down``; the colour comes from ``lvl-ok``,
``lvl-warn``, ``lvl-bad``, ``lvl-mute``.

Every value is HTML-escaped: control ids, channel names, error texts come from
senders and servers we do not control. No message body is ever shown — the
view data has none, and this module never looks for one.
"""

from __future__ import annotations

import datetime as _dt
import html
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.states import State
from agent.core.status import assess
from agent.core.timefmt import human_bytes, human_duration
from agent.runtime.plots import Line, line_plot

#: A channel whose oldest queued row is older than this is shown as lagging,
#: and as stuck past the second threshold (seconds). Display only.
AGE_WARN_S = 300.0
AGE_BAD_S = 3600.0

#: Error texts are shown, but bounded: a server may send a long one.
_MAX_TEXT = 300

_IN_COLOUR, _OUT_COLOUR, _DEPTH_COLOUR = "#2b6cb0", "#1f9d55", "#d98e04"

_CSS = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
  background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:12px 18px;display:flex;
  align-items:baseline;gap:6px 16px;flex-wrap:wrap}
header h1{font-size:19px;margin:0}
header .meta{color:#b8c0d0;font-size:13px}
main{padding:14px 18px;max-width:1100px}
.banner{border-radius:6px;padding:10px 14px;margin-bottom:14px;font-weight:600;
  border-left:6px solid #9aa3b2;background:#fff;box-shadow:0 1px 2px rgba(0,0,0,.08)}
.banner.lvl-ok{border-left-color:#1f9d55;color:#16703c}
.banner.lvl-warn{border-left-color:#d98e04;color:#8a5a00;background:#fffaf0}
.banner.lvl-bad{border-left-color:#cc1f1a;color:#a11a16;background:#fff5f5}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(240px,1fr));gap:10px;
  margin-bottom:14px}
.card{background:#fff;border-radius:6px;padding:10px 12px;border-left:5px solid #9aa3b2;
  box-shadow:0 1px 2px rgba(0,0,0,.08);min-width:0}
.card h2{font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:#5b6475;margin:0 0 4px}
.card .big{font-size:17px;font-weight:600}
.card .sub{color:#5b6475;font-size:12px;overflow-wrap:anywhere}
.card.lvl-ok{border-left-color:#1f9d55}.card.lvl-warn{border-left-color:#d98e04}
.card.lvl-bad{border-left-color:#cc1f1a}.card.lvl-bad .big{color:#a11a16}
.card.lvl-warn .big{color:#8a5a00}
section{background:#fff;border-radius:6px;padding:10px 12px;margin-bottom:14px;
  box-shadow:0 1px 2px rgba(0,0,0,.08)}
section h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 6px;border-bottom:1px solid #e3e6eb;vertical-align:top}
th{font-size:11px;color:#5b6475;font-weight:600;background:#fafbfc}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.w,div.w{white-space:nowrap}
th.wide{width:45%}
tr.ch td{border-bottom:none;padding-top:8px}
tr.ch td:first-child{border-left:5px solid #9aa3b2}
tr.ch.lvl-ok td:first-child{border-left-color:#1f9d55}
tr.ch.lvl-warn td:first-child{border-left-color:#d98e04}
tr.ch.lvl-bad td:first-child{border-left-color:#cc1f1a}
tr.detail td{padding-top:0;font-size:13px;color:#3b4252}
tr.detail td:first-child{border-left:5px solid #9aa3b2}
tr.detail.lvl-ok td:first-child{border-left-color:#1f9d55}
tr.detail.lvl-warn td:first-child{border-left-color:#d98e04}
tr.detail.lvl-bad td:first-child{border-left-color:#cc1f1a}
.what{font-weight:600}.lvl-bad .what{color:#a11a16}.lvl-warn .what{color:#8a5a00}
.state{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:700;
  white-space:nowrap}
.st-flowing{background:#e3f5ea;color:#16703c}.st-idle{background:#eef3ef;color:#3d6b4c}
.st-retrying,.st-paused{background:#fdf1d8;color:#8a5a00}
.st-blocked,.st-upstream-down{background:#fbe3e2;color:#a11a16}
.badge{display:inline-block;padding:1px 7px;border-radius:10px;font-size:11px;font-weight:600}
.b-bad{background:#fbe3e2;color:#a11a16}.b-warn{background:#fdf1d8;color:#8a5a00}
.b-mute{background:#eceef2;color:#5b6475}
.t-warn{color:#8a5a00;font-weight:600}.t-bad{color:#a11a16;font-weight:600}
.empty{color:#5b6475;font-style:italic}
.muted{color:#5b6475;font-size:12px}
.reason{font-weight:600;overflow-wrap:anywhere}
ul.facts{margin:2px 0 0;padding-left:18px}ul.facts code{white-space:nowrap}
figure{margin:0 0 10px}figcaption{font-size:12px;color:#5b6475}
svg.plot{width:100%;height:auto;display:block}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;
  overflow-wrap:anywhere}
"""


def _e(value: Any) -> str:  # noqa: ANN401 - anything printable
    """HTML-escape any value (quotes too: values also land in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def _when(value: Any) -> str:  # noqa: ANN401 - a JSON value
    """A timestamp as text: RFC 3339 strings as given, epoch numbers as UTC."""
    if value is None or value == "":
        return "—"
    if isinstance(value, int | float) and not isinstance(value, bool):
        moment = _dt.datetime.fromtimestamp(float(value), tz=_dt.UTC)
        return moment.strftime("%Y-%m-%d %H:%M:%SZ")
    return str(value)


def _epoch(value: Any) -> float | None:  # noqa: ANN401 - a JSON value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    try:
        return _dt.datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def _ago(age: Any) -> str:  # noqa: ANN401 - a JSON number or None
    return "—" if age is None else f"{human_duration(float(age))} ago"


def _clip(text: Any) -> str:  # noqa: ANN401 - any printable value
    raw = "" if text is None else str(text)
    return raw if len(raw) <= _MAX_TEXT else raw[: _MAX_TEXT - 1] + "…"


_BACKTICKS = re.compile(r"`([^`]+)`")


def _text(value: Any) -> str:  # noqa: ANN401 - any printable value
    """Escaped, clipped text whose `backticked` parts (commands to run) are set as code."""
    return _BACKTICKS.sub(r"<code>\1</code>", _e(_clip(value)))


def _state_class(state: Any) -> str:  # noqa: ANN401 - a state word
    return "st-" + str(state).replace(" ", "-")


def _card(title: str, level: str, big: str, *subs: str, card_id: str = "") -> str:
    """One summary card; ``big`` and ``subs`` are already-escaped HTML."""
    lines = "".join(f'<div class="sub">{s}</div>' for s in subs if s)
    ident = f' id="{_e(card_id)}"' if card_id else ""
    return (
        f'<div class="card lvl-{_e(level)}"{ident}><h2>{_e(title)}</h2>'
        f'<div class="big">{big}</div>{lines}</div>'
    )


def _unavailable(errors: Mapping[str, Any], section: str) -> str:
    reason = errors.get(section)
    return "unavailable" + (f": {_e(_clip(reason))}" if reason else "")


def _upstream_card(
    upstream: Mapping[str, Any] | None, cond: Mapping[str, Any], errors: Mapping[str, Any]
) -> str:
    if upstream is None:
        return _card("Upstream", "warn", _unavailable(errors, "upstream"), card_id="upstream")
    state, level = str(cond.get("state")), str(cond.get("level"))
    url = upstream.get("url")
    replay = upstream.get("replay")
    replay_text = (
        "server replays answers" if replay is True
        else "server does not replay" if replay is False else ""
    )
    since = cond.get("since")
    subs = [_e(cond.get("text")), f"since {_e(since)}" if since and state in ("connected", "down") else ""]
    subs += [f"<code>{_e(url)}</code>" if url else "", _e(replay_text)]
    last_error = upstream.get("last_error")
    if last_error and not upstream.get("connected"):
        subs.append(f'<span class="t-bad">last error: {_e(_clip(last_error))}</span>')
    return _card("Upstream", level, _e(state), *subs, card_id="upstream")


def _lease_card(
    lease: Mapping[str, Any] | None, cond: Mapping[str, Any], stats_ok: bool, errors: Mapping[str, Any]
) -> str:
    if not stats_ok:
        return _card("Dispatch lease", "warn", _unavailable(errors, "stats"), card_id="lease")
    level = str(cond.get("level"))
    if not isinstance(lease, Mapping):
        return _card("Dispatch lease", level, "no holder", "nothing dispatches until a process takes it",
                     card_id="lease")
    return _card(
        "Dispatch lease", level, _e(lease.get("holder")), _e(cond.get("text")),
        f"expires {_e(_when(lease.get('expires_at')))}", card_id="lease",
    )


def _intake_card(listeners_up: Any, errors: Mapping[str, Any]) -> str:  # noqa: ANN401
    if listeners_up is None:
        return _card("Intake", "warn", _unavailable(errors, "listeners"), card_id="intake")
    if listeners_up:
        return _card("Intake", "ok", "listening", "MLLP listeners are up", card_id="intake")
    return _card("Intake", "bad", "not listening", "MLLP listeners are down", card_id="intake")


def _queue_card(stats: Mapping[str, Any] | None, errors: Mapping[str, Any]) -> str:
    if stats is None:
        return _card("Queue", "bad", _unavailable(errors, "stats"), card_id="queue")
    states: Mapping[str, Any] = stats.get("states") or {}
    backlog = sum(int(states.get(s) or 0) for s in (State.QUEUED, State.CLAIMED, State.INFLIGHT))
    failed = int(states.get(State.FAILED) or 0)
    db: Mapping[str, Any] = stats.get("db") or {}
    counts = " · ".join(f"{_e(k)} {_e(v)}" for k, v in states.items())
    size = f"db {_e(human_bytes(db.get('size_bytes')))}, wal {_e(human_bytes(db.get('wal_bytes')))}"
    failed_text = f'<span class="t-bad">{failed} failed: need review</span>' if failed else ""
    return _card("Queue", "bad" if failed else "ok", f"{backlog} pending", counts, size, failed_text,
                 card_id="queue")


def _age_cell(age: Any) -> str:  # noqa: ANN401 - a JSON number or None
    if age is None:
        return '<td class="n">—</td>'
    seconds = float(age)
    cls = "t-bad" if seconds >= AGE_BAD_S else "t-warn" if seconds >= AGE_WARN_S else ""
    text = _e(human_duration(seconds))
    return f'<td class="n"><span class="{cls}">{text}</span></td>' if cls else f'<td class="n">{text}</td>'


def _channel_rows(c: Mapping[str, Any]) -> str:
    name, state, level = c.get("name"), c.get("state"), c.get("level")
    out_state = c.get("last_settled_state")
    last_out = _ago(c.get("last_settled_age_s"))
    if out_state and out_state != State.PROCESSED and c.get("last_settled_age_s") is not None:
        last_out += f" ({out_state})"
    detail = "".join(f"<li>{_text(d)}</li>" for d in c.get("detail") or ())
    attrs = f'data-channel="{_e(name)}" data-state="{_e(state)}" data-level="{_e(level)}"'
    return (
        f'<tr class="ch lvl-{_e(level)}" id="ch-{_e(name)}" {attrs}>'
        f"<td><code>{_e(name)}</code></td>"
        f'<td><span class="state {_e(_state_class(state))}">{_e(state)}</span></td>'
        f'<td class="n" data-field="depth">{_e(c.get("depth", 0))}</td>'
        f"{_age_cell(c.get('oldest_queued_age_s'))}"
        f'<td class="n">{_e(_ago(c.get("last_received_age_s")))}</td>'
        f'<td class="n">{_e(last_out)}</td></tr>'
        f'<tr class="detail lvl-{_e(level)}" id="ch-{_e(name)}-detail"><td colspan="6"><span class="what">{_text(c.get("text"))}</span>'
        f'{f"<ul class=facts>{detail}</ul>" if detail else ""}</td></tr>'
    )


def _channels_section(
    channels: Sequence[Mapping[str, Any]], stats_ok: bool, errors: Mapping[str, Any]
) -> str:
    head = '<section id="channels"><h2>Channels</h2>'
    if not stats_ok:
        return f'{head}<p class="empty">{_unavailable(errors, "stats")}</p></section>'
    if not channels:
        return f'{head}<p class="empty">No channels.</p></section>'
    rows = "".join(_channel_rows(c) for c in channels)
    return (
        f'{head}<table><thead><tr><th>channel</th><th>state</th><th class="n">waiting</th>'
        '<th class="n">oldest</th><th class="n">last in</th><th class="n">last out</th></tr></thead>'
        f"<tbody>{rows}</tbody></table></section>"
    )


def _history_section(history: Mapping[str, Any] | None) -> str:
    head = '<section id="history"><h2>Last hour, per minute</h2>'
    if not isinstance(history, Mapping):
        return f'{head}<p class="empty">No history in this process.</p></section>'
    ins = [int(v or 0) for v in history.get("in") or ()]
    outs = [int(v or 0) for v in history.get("out") or ()]
    depth = [None if v is None else int(v) for v in history.get("depth") or ()]
    n = max(len(ins), len(depth), 1)
    marks = [(i, f"{n - i}m ago") for i in (0, n // 4, n // 2, 3 * n // 4)] + [(n - 1, "now")]
    flow = line_plot(
        [Line("in", _IN_COLOUR, ins), Line("out", _OUT_COLOUR, outs)],
        title="messages in and out per minute, last hour", x_labels=marks, plot_id="plot-flow",
    )
    depth_plot = line_plot(
        [Line("depth", _DEPTH_COLOUR, depth, fill=True)],
        title="queue depth, last hour", x_labels=marks, plot_id="plot-depth",
    )
    known = [d for d in depth if d is not None]
    now_depth = next((d for d in reversed(depth) if d is not None), None)
    since = history.get("counted_since")
    return (
        f"{head}<figure>{flow}<figcaption>"
        f'<span id="hist-in">{sum(ins)}</span> in, <span id="hist-out">{sum(outs)}</span> out in the '
        f"last hour — counted by this process (since {_e(_when(since))})</figcaption></figure>"
        f"<figure>{depth_plot}<figcaption>depth now "
        f'<span id="hist-depth">{_e("—" if now_depth is None else now_depth)}</span>, peak '
        f'{_e(max(known) if known else "—")} (every channel, sampled four times a minute)'
        f"</figcaption></figure></section>"
    )


def _failures_section(
    failures: Sequence[Mapping[str, Any]] | None, errors: Mapping[str, Any], now: float | None
) -> str:
    head = '<section id="failures"><h2>Recent failures</h2>'
    if failures is None:
        return f'{head}<p class="empty">{_unavailable(errors, "recent_failures")}</p></section>'
    if not failures:
        return f'{head}<p class="empty">None.</p></section>'
    rows = []
    for f in failures:
        state = f.get("state")
        cls = "b-bad" if state == State.FAILED else "b-warn" if state == State.REJECTED else "b-mute"
        code, text, reason = f.get("error_code"), f.get("error_text"), f.get("server_reason")
        ours = " ".join(p for p in (f"<b>{_e(code)}</b>" if code is not None else "", _e(_clip(text))) if p)
        main = f'<div class="reason">{_e(_clip(reason))}</div><div class="muted">{ours}</div>' if reason else ours
        at = _epoch(f.get("updated_at"))
        ago = _ago(now - at) if now is not None and at is not None else "—"
        message_id = str(f.get("id") or "")
        rows.append(
            f'<tr class="failure" data-id="{_e(message_id)}">'
            f'<td class="w">{_e(ago)}<div class="muted">{_e(_when(f.get("updated_at")))}</div></td>'
            f"<td><code>{_e(f.get('channel'))}</code>"
            f'<div class="muted">{_e(f.get("message_type"))}</div></td>'
            f"<td><code>{_e(f.get('control_id'))}</code>"
            f'<div class="muted w" title="{_e(message_id)}">id <code>{_e(message_id[:8])}</code></div></td>'
            f'<td><span class="badge {cls}">{_e(state)}</span>'
            f'<div class="muted">{_e(f.get("attempts"))} attempt(s)</div></td>'
            f"<td>{main}</td></tr>"
        )
    return (
        f"{head}<table><thead><tr><th>when</th><th>channel</th><th>message</th><th>state</th>"
        f'<th class="wide">reason</th></tr></thead><tbody>{"".join(rows)}</tbody></table></section>'
    )


def render_status_page(view_data: dict[str, Any], *, refresh_seconds: int = 5) -> str:
    """The whole status page as one HTML string (UTF-8, self-contained)."""
    errors: Mapping[str, Any] = view_data.get("errors") or {}
    stats = view_data.get("stats")
    stats_map: Mapping[str, Any] | None = stats if isinstance(stats, Mapping) else None
    upstream = view_data.get("upstream")
    upstream_map: Mapping[str, Any] | None = upstream if isinstance(upstream, Mapping) else None
    now = _epoch(view_data.get("generated_at"))
    assessment = view_data.get("assessment")
    if not isinstance(assessment, Mapping):
        activity = view_data.get("activity")
        assessment = assess(
            stats=stats_map,
            activity=activity if isinstance(activity, list) else None,
            upstream=upstream_map,
            lease_held=view_data.get("lease_held"),
            listeners_up=view_data.get("listeners_up"),
            now=now or 0.0,
        )
    refresh = (
        f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">' if refresh_seconds > 0 else ""
    )
    refresh_note = f"refreshes every {int(refresh_seconds)} s" if refresh_seconds > 0 else ""
    agent_id = view_data.get("agent_id")
    cards = "".join(
        (
            _upstream_card(upstream_map, assessment.get("upstream") or {}, errors),
            _lease_card(stats_map.get("lease") if stats_map else None, assessment.get("lease") or {},
                        stats_map is not None, errors),
            _intake_card(view_data.get("listeners_up"), errors),
            _queue_card(stats_map, errors),
        )
    )
    failures = view_data.get("recent_failures")
    level = assessment.get("level") or "mute"
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
        f'<span class="meta">{_e(refresh_note)}</span>'
        "</header><main>"
        f'<div class="banner lvl-{_e(level)}" id="summary">{_e(assessment.get("summary"))}</div>'
        f'<div class="cards">{cards}</div>'
        f"{_channels_section(assessment.get('channels') or [], stats_map is not None, errors)}"
        f"{_history_section(view_data.get('history'))}"
        f"{_failures_section(failures if isinstance(failures, list) else None, errors, now)}"
        "</main></body></html>\n"
    )
