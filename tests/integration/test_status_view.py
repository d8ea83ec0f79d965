"""What the status page is told, from a real Agent in process: the dispatcher's and the store's facts.

A real ``Agent`` (real SQLite file, MLLP on 127.0.0.1 port 0) against a real
``DevServer`` whose ``decide`` hook scripts the server; the page's facts are
read through the same ``RuntimeView`` the admin endpoint uses.
"""

from __future__ import annotations

import time
from pathlib import Path

from agenttest import run_async as run
from agenttest import until

from tests.integration.test_dispatch import agent_running, dev_server, settings_for, url


class TestUpstreamSince:
    def test_changed_at_moves_when_the_session_comes_up_and_goes_down(self, tmp_path: Path) -> None:
        """upstream_changed_at() is the start until a session is up, then each change's time."""

        async def scenario() -> None:
            async with dev_server() as server:
                settings = settings_for(tmp_path, url(server), [{"name": "adt"}])
                before = time.time()
                async with agent_running(settings) as agent:
                    dispatcher = agent.dispatcher
                    assert dispatcher is not None
                    started = dispatcher.upstream_changed_at()
                    assert before <= started <= time.time()
                    await until(lambda: dispatcher.connected, 10, "upstream connected")
                    up_at = dispatcher.upstream_changed_at()
                    assert up_at > started
                    await server.close_connections(1001, "going away")
                    await until(lambda: not dispatcher.connected, 10, "upstream down")
                    down_at = dispatcher.upstream_changed_at()
                    assert down_at > up_at and not dispatcher.upstream_state()["connected"]

        run(scenario())
