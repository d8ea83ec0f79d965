"""A real headless Chromium for the status page tests: the DOM it rendered, screenshots, and a DevTools session.

The Debian package ``chromium`` (``.ci/run`` installs it). Its command-line
modes are enough for most checks — ``--dump-dom`` prints the DOM after the
load event, ``--screenshot`` writes a PNG — and the DevTools protocol (over
the ``websockets`` library the agent already uses) for what needs a page kept
open, such as reading the scroll position across a reload. Every browser gets
its own profile directory and runs only against 127.0.0.1; each process is
stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

#: The flags the machine notes ask for: no sandbox (root in a container), no GPU, no network of its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
TIMEOUT = 60.0


def binary() -> str:
    """The Chromium executable; a missing one fails the test with the fix (CI installs it)."""
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return name
    pytest.fail("headless Chromium is missing: apt-get install chromium (.ci/run installs it), "
                "or set CHROMIUM=/path/to/chromium")


def _run(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile.mkdir(parents=True, exist_ok=True)
    return subprocess.run([binary(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)


def dump_dom(url: str, profile: Path, *, width: int = 700, height: int = 1400) -> str:
    """The DOM Chromium built for ``url`` (after its load event), serialised."""
    result = _run(profile, f"--window-size={width},{height}", "--dump-dom", url)
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return result.stdout


def screenshot(url: str, out: Path, profile: Path, *, width: int = 700, height: int = 1400) -> Path:
    """A PNG of ``url`` at ``width`` x ``height`` CSS pixels."""
    out.unlink(missing_ok=True)
    result = _run(profile, f"--window-size={width},{height}", f"--screenshot={out}", url)
    assert result.returncode == 0 and out.stat().st_size > 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return out


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class Dom(HTMLParser):
    """Chromium's serialised DOM, parsed: every element's attributes and the text under each id."""

    VOID = frozenset({"meta", "br", "rect", "line", "polyline", "polygon", "circle", "img", "input", "link"})

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[dict[str, str]] = []
        self._open: list[str] = []
        self.text_by_id: dict[str, str] = {}
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {k: v or "" for k, v in attrs}
        element["<tag>"] = tag
        self.elements.append(element)
        if tag not in self.VOID:
            self._open.append(element.get("id", ""))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {k: v or "" for k, v in attrs}
        element["<tag>"] = tag
        self.elements.append(element)

    def handle_endtag(self, tag: str) -> None:
        if self._open and tag not in self.VOID:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for ident in self._open:
            if ident:
                self.text_by_id[ident] = " ".join((self.text_by_id.get(ident, "") + " " + data).split())

    def find(self, **attrs: str) -> list[dict[str, str]]:
        """Elements whose attributes equal ``attrs`` (``data_state`` means ``data-state``)."""
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [e for e in self.elements if all(e.get(k) == v for k, v in wanted.items())]

    def one(self, **attrs: str) -> dict[str, str]:
        found = self.find(**attrs)
        assert len(found) == 1, (attrs, found)
        return found[0]

    def text(self, ident: str) -> str:
        return self.text_by_id.get(ident, "")


class DevTools:
    """One Chromium kept open, driven over the DevTools protocol (a page target, JSON over a WebSocket)."""

    def __init__(self, profile: Path, *, width: int = 700, height: int = 500) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._next_id = 0
        self._stack = contextlib.ExitStack()
        self.ws: ClientConnection | None = None
        try:
            port = self._devtools_port(profile / "DevToolsActivePort")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                targets = json.load(resp)
            page = next(t for t in targets if t.get("type") == "page")
            self.ws = self._stack.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, path: Path) -> int:
        """The port Chromium chose, from the file it writes into its profile once listening."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited with {self.proc.returncode}")
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                return int(path.read_text().split()[0])
            time.sleep(0.05)
        raise AssertionError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events arriving meanwhile are dropped)."""
        assert self.ws is not None
        self._next_id += 1
        ident = self._next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=TIMEOUT))
            if message.get("id") == ident:
                assert "error" not in message, message
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:  # noqa: ANN401 - whatever the page returns
        """``expression`` in the page (DevTools evaluation is not page script: the CSP does not apply)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stack.close()  # the DevTools connection
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the browser and its children
                self.proc.wait(10)

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def devtools(profile: Path, **size: int) -> Iterator[DevTools]:
    browser = DevTools(profile, **size)
    try:
        yield browser
    finally:
        browser.close()
