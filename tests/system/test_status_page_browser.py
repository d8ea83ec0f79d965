"""The status page in a real headless Chromium, one real daemon per state: what an operator sees is true.

For each state a real daemon (``python -m agent run``) is brought into it with
the real dev server — flowing, retrying (the server answers 503), blocked and
paused (a rejection pauses one channel, an operator the other), upstream down
(the server is gone) — and the page is loaded in Chromium: the assertions are
on the DOM Chromium rendered (state words, the class that gives the colour,
the numbers), and a 700 px wide screenshot is taken of each.

Screenshots go to the test's tmp dir. With ``HL7_AGENT_SCREENSHOT_DIR`` set
they are copied there as ``status-page-<state>.png``:
``scripts/status-page-screenshots.sh`` uses that to refresh the ones in docs/.
No test reads the committed PNGs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import chromium
import pytest
from agenttest import (
    REPO_ROOT,
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    db_rows,
    free_port,
    hl7_message,
    http_get,
    toml_config,
    wait_for,
)

from agent.app.devserver import Answer, default_answer
from agent.core.acks import AckCode, build_ack
from agent.core.envelope import read_msh
from agent.core.protocol import Transmit

pytestmark = pytest.mark.slow

REASON = "unknown patient identifier in PID-3"
WIDTH = 700


class Scene:
    """A running daemon, its admin page and its channels' ports."""

    def __init__(self, tmp: Path, daemon: Daemon, admin: int, ports: dict[str, int]) -> None:
        self.tmp = tmp
        self.daemon = daemon
        self.url = f"http://127.0.0.1:{admin}/"
        self.ports = ports
        self.db = tmp / "data" / "queue.db"

    def send(self, channel: str, control_ids: list[str]) -> None:
        with MllpClient(self.ports[channel]) as client:
            for control_id in control_ids:
                assert ack_code(client.exchange(hl7_message(control_id))) == "AA"

    def status(self) -> dict[str, Any]:
        status, body = http_get(self.url + "status.json")
        assert status == 200
        data: dict[str, Any] = json.loads(body)
        return data

    def channel_state(self, name: str) -> str | None:
        for c in self.status()["assessment"]["channels"]:
            if c["name"] == name:
                return str(c["state"])
        return None

    def dom(self) -> chromium.Dom:
        """The page as Chromium rendered it, at 700 px wide."""
        return chromium.Dom(chromium.dump_dom(self.url, self.tmp / "chromium", width=WIDTH))

    def screenshot(self, state: str) -> Path:
        """``status-page-<state>.png`` of the page at 700 x 1400, copied where HL7_AGENT_SCREENSHOT_DIR says."""
        out = chromium.screenshot(self.url, self.tmp / f"status-page-{state}.png", self.tmp / "chromium",
                                  width=WIDTH, height=1400)
        assert chromium.png_size(out) == (WIDTH, 1400)
        target = os.environ.get("HL7_AGENT_SCREENSHOT_DIR")
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, Path(target) / out.name)
        return out


@contextmanager
def running(tmp: Path, channels: list[dict[str, Any]], server_url: str | None) -> Iterator[Scene]:
    """A daemon with these channels and its admin page on 127.0.0.1; stopped (exit 0) at the end."""
    admin = free_port()
    ports = {c["name"]: free_port() for c in channels}
    listed = [{**c, "listen": f"127.0.0.1:{ports[c['name']]}"} for c in channels]
    # A held transmit must not time out while the page is looked at (toml_config's is 5 s).
    config = toml_config(tmp / "data", listed, agent_id="edge-01", server_url=server_url,
                         admin_port=admin).replace("response_timeout = 5", "response_timeout = 120")
    daemon = Daemon(tmp, config)
    try:
        daemon.start().wait_started()
        wait_for(lambda: http_get(f"http://127.0.0.1:{admin}/healthz")[0] == 200, 20, what="admin up")
        yield Scene(tmp, daemon, admin, ports)
    finally:
        assert daemon.stop() == 0, daemon.log_tail()


@contextmanager
def dev_server(decide: Callable[[Transmit], Awaitable[Answer]] | None = None) -> Iterator[DevServerThread]:
    """The real dev server on its own thread, answering as ``decide`` says (default: 200 with an AA)."""
    server = DevServerThread(decide=decide).start()
    try:
        yield server
    finally:
        server.stop()


def _row(dom: chromium.Dom, name: str) -> dict[str, str]:
    return dom.one(id=f"ch-{name}")


class TestEachStateInChromium:
    def test_flowing_and_idle(self, tmp_path: Path) -> None:
        """Rows going out one at a time: green `flowing` with its depth; the empty channel `idle`."""
        release = threading.Event()
        answered: list[str] = []

        async def decide(t: Transmit) -> Answer:
            if len(answered) >= 3:  # the fourth waits: the page sees a backlog with one in flight
                await asyncio.to_thread(release.wait, 100)
            answered.append(t.id)
            return default_answer(t)

        with dev_server(decide) as dev, running(tmp_path, [{"name": "adt"}, {"name": "lab"}], dev.url) as scene:
            try:
                scene.send("adt", [f"F{i}" for i in range(10)])
                wait_for(lambda: len(dev.server.received) >= 4, 20, what="three answered, the fourth in flight")
                wait_for(lambda: scene.status()["stats"]["channels"]["adt"]["inflight"] == 1, 10,
                         what="the fourth inflight")
                dom = scene.dom()
                adt, lab = _row(dom, "adt"), _row(dom, "lab")
                assert (adt["data-state"], adt["class"], adt["data-level"]) == ("flowing", "ch lvl-ok", "ok")
                assert dom.text("ch-adt").split()[:3] == ["adt", "flowing", "7"]
                assert dom.text("ch-adt-detail") == "flowing — 7 waiting"
                assert (lab["data-state"], lab["class"]) == ("idle", "ch lvl-ok")
                assert dom.find(**{"class": "state st-flowing"}) and dom.find(**{"class": "state st-idle"})
                assert dom.one(id="upstream")["class"] == "card lvl-ok" and "connected" in dom.text("upstream")
                assert "held by this process" in dom.text("lease")
                assert dom.one(id="summary")["class"] == "banner lvl-ok"
                assert dom.text("hist-in") == "10" and dom.text("hist-out") == "3"
                assert dom.one(id="plot-flow")["<tag>"] == "svg"
                scene.screenshot("flowing")
            finally:
                release.set()  # before the daemon stops: it waits for the answer in flight

    def test_retrying_a_503(self, tmp_path: Path) -> None:
        """The server answers 503 forever: amber `retrying` with attempt, last error and who waits — not green."""

        async def decide(t: Transmit) -> Answer:
            return Answer(503)

        with dev_server(decide) as dev, running(tmp_path, [{"name": "adt"}], dev.url) as scene:
            scene.send("adt", [f"R{i}" for i in range(4)])
            wait_for(lambda: len(dev.server.received) >= 3, 20, what="three attempts of the head")
            dom = scene.dom()
            row = _row(dom, "adt")
            assert (row["data-state"], row["class"]) == ("retrying", "ch lvl-warn")
            assert dom.find(**{"class": "state st-retrying"})
            detail = dom.text("ch-adt-detail")
            assert "retrying — attempt" in detail and "last error: transient status 503" in detail
            assert "3 waiting behind it (delivery is in order)" in detail
            assert "hl7-agent queue fail" in detail
            assert dom.text("ch-adt").split()[:3] == ["adt", "retrying", "4"]
            assert dom.one(id="upstream")["class"] == "card lvl-ok"  # the link is fine; the head is not
            assert dom.one(id="summary")["class"] == "banner lvl-warn"
            assert dom.text("summary") == "adt retrying"
            scene.screenshot("retrying")

    def test_blocked_by_a_rejection_and_paused_by_an_operator(self, tmp_path: Path) -> None:
        """on_reject = pause: red `blocked` with the rows behind it; an operator's pause: amber `paused`.

        The rejection's reason — the server's MSA-3 and ERR text — is in recent failures.
        """

        async def decide(t: Transmit) -> Answer:
            if t.control_id == "B0":
                ack = build_ack(read_msh(t.body.encode()), AckCode.AE, text=REASON, error_code=204)
                return Answer(422, ack.decode())
            return default_answer(t)

        channels = [{"name": "adt", "on_reject": "pause"}, {"name": "lab"}]
        with dev_server(decide) as dev, running(tmp_path, channels, dev.url) as scene:
            paused = subprocess.run(
                [sys.executable, "-m", "agent", "channel", "pause", "lab", "--config", str(scene.daemon.config)],
                capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")},
            )
            assert paused.returncode == 0, paused.stderr
            scene.send("adt", ["B0", "B1", "B2"])
            wait_for(lambda: scene.channel_state("adt") == "blocked", 20, what="adt blocked by the pause")
            dom = scene.dom()
            adt, lab = _row(dom, "adt"), _row(dom, "lab")
            assert (adt["data-state"], adt["class"]) == ("blocked", "ch lvl-bad")
            assert dom.find(**{"class": "state st-blocked"}) and dom.find(**{"class": "state st-paused"})
            assert "blocked: channel paused — 2 waiting" in dom.text("ch-adt-detail")
            assert "paused by rejected row" in dom.text("ch-adt-detail")
            assert dom.text("ch-adt").split()[:3] == ["adt", "blocked", "2"]
            assert "(rejected)" in dom.text("ch-adt")  # the last one out was the rejection
            assert (lab["data-state"], lab["class"]) == ("paused", "ch lvl-warn")
            assert "paused by operator (" in dom.text("ch-lab-detail")
            assert "hl7-agent channel resume lab" in dom.text("ch-lab-detail")
            (failure,) = dom.find(**{"class": "failure"})
            (row_id,) = [r for (r,) in db_rows(scene.db, "SELECT id FROM messages WHERE control_id = 'B0'")]
            assert failure["data-id"] == row_id
            failures = dom.text("failures")
            assert REASON in failures and "Unknown key identifier" not in failures
            assert "422 rejected by server (status 422)" in failures
            assert dom.one(id="summary")["class"] == "banner lvl-bad"
            assert dom.text("summary") == "adt blocked; lab paused"
            scene.screenshot("blocked")

    def test_upstream_down(self, tmp_path: Path) -> None:
        """The server gone: red `upstream down` on every channel and the upstream card, since when, why."""
        dev = DevServerThread().start()
        stopped = False
        try:
            with running(tmp_path, [{"name": "adt"}, {"name": "lab"}], dev.url) as scene:
                wait_for(lambda: scene.status()["upstream"]["connected"], 20, what="connected first")
                dev.stop()
                stopped = True
                wait_for(lambda: not scene.status()["upstream"]["connected"], 20, what="upstream down")
                scene.send("adt", ["D0", "D1", "D2"])
                wait_for(lambda: scene.status()["upstream"]["last_error"], 20, what="the link's last error")
                dom = scene.dom()
                for name in ("adt", "lab"):  # red whatever the queue says: 3 waiting, or none
                    row = _row(dom, name)
                    assert (row["data-state"], row["class"]) == ("upstream down", "ch lvl-bad"), name
                assert dom.find(**{"class": "state st-upstream-down"})
                assert dom.text("ch-adt-detail") == (
                    "upstream down — 3 waiting kept in the queue: they go out in order once the server answers again")
                assert dom.text("ch-lab-detail") == "upstream down — nothing waiting"
                card = dom.text("upstream")
                assert dom.one(id="upstream")["class"] == "card lvl-bad"
                assert "down for" in card and "since 20" in card and "last error:" in card
                assert dom.one(id="summary")["class"] == "banner lvl-bad"
                summary = dom.text("summary")
                assert summary.startswith("upstream down for") and "3 waiting" in summary
                scene.screenshot("upstream-down")
        finally:
            if not stopped:
                dev.stop()


class TestRefreshInChromium:
    def test_meta_refresh_reloads_and_keeps_the_scroll_position(self, tmp_path: Path) -> None:
        """Chromium treats the page's meta refresh as a reload: a new document, the same scroll position.

        Also: at 700 px nothing scrolls sideways.
        """
        with (running(tmp_path, [{"name": f"ch{i:02d}"} for i in range(12)], None) as scene,
              chromium.devtools(tmp_path / "devtools", width=WIDTH, height=500) as browser):
            browser.call("Page.enable")
            browser.call("Page.navigate", url=scene.url)
            wait_for(lambda: browser.evaluate("document.readyState") == "complete", 20, what="loaded")
            assert browser.evaluate("document.documentElement.scrollWidth") <= WIDTH
            height = browser.evaluate("document.documentElement.scrollHeight")
            assert height > 1200, height
            first = browser.evaluate("performance.timeOrigin")
            assert browser.evaluate("window.scrollTo(0, 600); window.scrollY") == 600
            wait_for(lambda: browser.evaluate("performance.timeOrigin") != first, 20, 0.2,
                     what="the meta refresh")
            wait_for(lambda: browser.evaluate("document.readyState") == "complete", 20, what="reloaded")
            assert browser.evaluate("performance.getEntriesByType('navigation')[0].type") == "reload"
            assert browser.evaluate("window.scrollY") == 600
