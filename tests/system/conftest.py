"""Fixtures of the system tests: every daemon and dev server a test starts is stopped at its end.

A test appends what it starts (``daemons.append(Daemon(...))``); whatever
happened, each daemon is killed by PID and each server stopped afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agenttest import Daemon, DevServerThread


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Every daemon a test starts is registered here and stopped by PID at the end."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.kill()


@pytest.fixture
def servers() -> Iterator[list[DevServerThread]]:
    """Every dev server a test starts is registered here and stopped at the end."""
    started: list[DevServerThread] = []
    yield started
    for server in started:
        server.stop()
