"""Live connections handed to a successor over SCM_RIGHTS, with the bytes read but not handled (SPEC 7)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from agent.adoption import ADOPT_SOCKET, AdoptionServer, hand_over


def run(coro):  # noqa: ANN001, ANN201 - a test runner
    async def bounded():  # noqa: ANN202
        async with asyncio.timeout(10):
            return await coro

    return asyncio.run(bounded())


class TestAdoption:
    def test_connection_and_buffered_bytes_reach_the_successor(self, tmp_path: Path) -> None:
        """The taker gets the live socket and the unhandled bytes; the sender's later bytes arrive there too."""
        taken: dict[str, object] = {}

        async def adopt(channel: str, sock: socket.socket, remote: str, buffered: bytes) -> bool:
            taken.update(channel=channel, sock=sock, remote=remote, buffered=buffered)
            return True

        async def scenario() -> None:
            server = AdoptionServer(tmp_path / ADOPT_SOCKET, adopt)
            await server.start()
            listener = socket.create_server(("127.0.0.1", 0))
            sender = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
            try:
                ok = await hand_over(tmp_path / ADOPT_SOCKET, None, "adt", "127.0.0.1:1", accepted.fileno(), b"\x0bMSH|partial")
                assert ok
                accepted.close()  # the giver's copy goes; the connection stays open
                sender.sendall(b"rest\x1c\r")
                adopted = taken["sock"]
                assert isinstance(adopted, socket.socket)
                adopted.settimeout(5)
                assert adopted.recv(100) == b"rest\x1c\r"
                adopted.sendall(b"ack")
                sender.settimeout(5)
                assert sender.recv(100) == b"ack"
                assert taken["buffered"] == b"\x0bMSH|partial"
                assert (taken["channel"], taken["remote"]) == ("adt", "127.0.0.1:1")
                assert server.adopted == 1
                adopted.close()
            finally:
                sender.close()
                listener.close()
                await server.close()

        run(scenario())

    def test_no_successor_means_no_handover(self, tmp_path: Path) -> None:
        """A missing path, or a path that is still our own, is not a successor: the caller closes instead."""

        async def refuse(channel: str, sock: socket.socket, remote: str, buffered: bytes) -> bool:
            raise AssertionError("must not be called")

        async def scenario() -> None:
            path = tmp_path / ADOPT_SOCKET
            assert not await hand_over(path, None, "adt", "", 0, b"")
            ours = AdoptionServer(path, refuse)
            await ours.start()
            try:
                assert not await hand_over(path, ours.identity, "adt", "", 0, b"")
            finally:
                await ours.close()
            assert not path.exists()

        run(scenario())

    def test_a_refusing_successor_leaves_the_connection_with_the_giver(self, tmp_path: Path) -> None:
        """When the taker declines (e.g. it is stopping too), hand_over is False and the giver's socket still works."""

        async def decline(channel: str, sock: socket.socket, remote: str, buffered: bytes) -> bool:
            return False

        async def scenario() -> None:
            server = AdoptionServer(tmp_path / ADOPT_SOCKET, decline)
            await server.start()
            listener = socket.create_server(("127.0.0.1", 0))
            sender = socket.create_connection(listener.getsockname())
            accepted, _ = listener.accept()
            try:
                assert not await hand_over(tmp_path / ADOPT_SOCKET, None, "adt", "", accepted.fileno(), b"")
                sender.sendall(b"still here")
                accepted.settimeout(5)
                assert accepted.recv(100) == b"still here"
            finally:
                for s in (sender, accepted, listener):
                    s.close()
                await server.close()

        run(scenario())
