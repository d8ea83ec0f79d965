"""Listening sockets that outlive a process: systemd activation, handover, reuseport."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import HandoverError
from agent.runtime.handover import HandoverServer, receive_handover, receive_republished
from agent.runtime.sockets import (
    bind_listener,
    inherited_sockets,
    is_listening,
    tcp_migrate_req_enabled,
)

PY = sys.executable


def _port(sock: socket.socket) -> int:
    port: int = sock.getsockname()[1]
    return port


@contextlib.contextmanager
def _listeners(*names: str) -> Iterator[dict[str, socket.socket]]:
    socks = {name: bind_listener("127.0.0.1", 0) for name in names}
    try:
        yield socks
    finally:
        for s in socks.values():
            s.close()


def _stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """Stop a child we started, by its PID, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _connect_with_deadline(port: int, deadline_s: float = 10.0) -> socket.socket:
    """Connect, retrying refusals until the deadline (the listener may not exist yet)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5.0)
        except ConnectionRefusedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)  # polling with a deadline, not synchronisation


def _recv_all(conn: socket.socket) -> bytes:
    chunks = []
    while True:
        data = conn.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


class TestBindListener:
    def test_ipv4_listener(self) -> None:
        """An IPv4 host gives a non-blocking listening AF_INET socket with SO_REUSEADDR."""
        s = bind_listener("127.0.0.1", 0)
        with s:
            assert s.family == socket.AF_INET
            assert not s.getblocking()
            assert is_listening(s)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
            assert not os.get_inheritable(s.fileno())

    def test_ipv6_bracketed_host(self) -> None:
        """A bracketed IPv6 host gives an AF_INET6 listener."""
        try:
            s = bind_listener("[::1]", 0)
        except OSError as exc:
            pytest.skip(f"no IPv6 loopback here: {exc}")
        with s:
            assert s.family == socket.AF_INET6
            assert s.getsockname()[0] == "::1"

    def test_reuse_port_allows_two_listeners(self) -> None:
        """With reuse_port two listeners share one port (the SPEC 7 fallback)."""
        a = bind_listener("127.0.0.1", 0, reuse_port=True)
        with a, bind_listener("127.0.0.1", _port(a), reuse_port=True) as b:
            assert _port(a) == _port(b)

    def test_without_reuse_port_second_bind_fails(self) -> None:
        """Without reuse_port a second listener on the same port is refused."""
        with bind_listener("127.0.0.1", 0) as a, pytest.raises(OSError):
            bind_listener("127.0.0.1", _port(a))

    def test_tcp_migrate_req_reader(self, tmp_path: Path) -> None:
        """The sysctl reads as True for 1, False for 0 and None when absent."""
        f = tmp_path / "tcp_migrate_req"
        f.write_text("1\n")
        assert tcp_migrate_req_enabled(f) is True
        f.write_text("0\n")
        assert tcp_migrate_req_enabled(f) is False
        assert tcp_migrate_req_enabled(tmp_path / "absent") is None
        assert tcp_migrate_req_enabled() in (True, False, None)


class TestHandover:
    def test_two_listeners_handed_over_in_process(self, tmp_path: Path) -> None:
        """A successor receives both listeners and accepts on them after the giver closed its own."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            with _listeners("adt", "lab") as socks:
                server = HandoverServer(path, lambda: dict(socks))
                await server.start()
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
                got = await receive_handover(path)
                assert got is not None
                async with asyncio.timeout(5.0):
                    await server.handed_over.wait()
                await server.close()
                assert not path.exists()
                ports = {name: _port(s) for name, s in socks.items()}
            # The giver's own copies are closed now; the shared sockets live on.
            try:
                assert set(got) == {"adt", "lab"}
                for name, s in got.items():
                    assert _port(s) == ports[name]
                    assert not s.getblocking()
                    assert is_listening(s)
                    assert not os.get_inheritable(s.fileno())
                    client = socket.create_connection(("127.0.0.1", ports[name]), timeout=5)
                    with client:
                        async with asyncio.timeout(5.0):
                            conn, _ = await loop.sock_accept(s)
                        conn.close()
            finally:
                for s in got.values():
                    s.close()

        asyncio.run(scenario())

    def test_no_connection_refused_during_switch(self, tmp_path: Path) -> None:
        """While giver and successor share the socket, and after the giver stops, every client is served."""
        path = tmp_path / "handover.sock"

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = await reader.readexactly(4)
            writer.write(data)
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        async def client(port: int) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"ping")
            await writer.drain()
            data = await reader.readexactly(4)
            writer.close()
            await writer.wait_closed()
            return data

        async def scenario() -> None:
            original = bind_listener("127.0.0.1", 0)
            port = _port(original)
            hs = HandoverServer(path, lambda: {"adt": original})
            await hs.start()
            # backlog= matters: create_server re-listen()s the shared socket.
            old = await asyncio.start_server(echo, sock=original, backlog=1024)
            got = await receive_handover(path)
            assert got is not None
            new = await asyncio.start_server(echo, sock=got["adt"], backlog=1024)
            results: list[bytes] = []
            async with asyncio.timeout(30):
                for batch in range(10):
                    if batch == 5:
                        # The old process stops accepting: closes its copy only.
                        await hs.close()
                        old.close()
                        await old.wait_closed()
                    results += await asyncio.gather(*(client(port) for _ in range(20)))
            new.close()
            await new.wait_closed()
            assert results == [b"ping"] * 200

        asyncio.run(scenario())

    def test_subprocess_receiver(self, tmp_path: Path) -> None:
        """The fds cross processes: a child takes the listener and serves a client after the giver closed it."""
        path = tmp_path / "handover.sock"
        child = textwrap.dedent(
            """
            import asyncio, json, os, sys
            from pathlib import Path
            import structlog
            from agent.runtime.handover import receive_handover

            structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

            async def main():
                socks = await receive_handover(Path(sys.argv[1]))
                print(json.dumps({n: s.getsockname()[1] for n, s in socks.items()}), flush=True)
                s = socks["adt"]
                s.setblocking(True)
                s.settimeout(20)
                conn, _ = s.accept()
                conn.sendall(b"child:%d" % os.getpid())
                conn.close()

            asyncio.run(main())
            """
        )

        async def scenario() -> None:
            with _listeners("adt") as socks:
                port = _port(socks["adt"])
                server = HandoverServer(path, lambda: dict(socks))
                await server.start()
                proc = await asyncio.create_subprocess_exec(
                    PY, "-c", child, str(path), stdout=asyncio.subprocess.PIPE
                )
                try:
                    assert proc.stdout is not None
                    async with asyncio.timeout(20):
                        line = await proc.stdout.readline()
                    assert json.loads(line) == {"adt": port}
                    async with asyncio.timeout(5):
                        await server.handed_over.wait()
                    await server.close()
                    socks["adt"].close()  # the giver lets go entirely
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    async with asyncio.timeout(10):
                        data = await reader.read()
                    writer.close()
                    await writer.wait_closed()
                    assert data == b"child:%d" % proc.pid
                    async with asyncio.timeout(10):
                        assert await proc.wait() == 0
                finally:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()

        asyncio.run(scenario())

    def test_missing_path_gives_none(self, tmp_path: Path) -> None:
        """Nobody to take over from (no socket file) gives None."""
        assert asyncio.run(receive_handover(tmp_path / "handover.sock")) is None

    def test_stale_socket_file_gives_none(self, tmp_path: Path) -> None:
        """A socket file left by a dead predecessor (ECONNREFUSED) gives None."""
        path = tmp_path / "handover.sock"
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(path))
        dead.close()
        assert path.exists()
        assert asyncio.run(receive_handover(path)) is None

    def test_successor_supersedes_predecessor_path(self, tmp_path: Path) -> None:
        """A new server replaces the path atomically; the old one's close() leaves it alone."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            with _listeners("adt", "lab") as socks:
                first = HandoverServer(path, lambda: {"adt": socks["adt"]})
                await first.start()
                second = HandoverServer(path, lambda: {"lab": socks["lab"]})
                await second.start()
                await first.close()
                assert path.exists()
                got = await receive_handover(path)
                assert got is not None
                assert list(got) == ["lab"]
                for s in got.values():
                    s.close()
                assert not first.handed_over.is_set()
                await second.close()
                assert not path.exists()
                assert not list(tmp_path.iterdir())

        asyncio.run(scenario())

    def test_predecessor_republishes_after_failed_successor(self, tmp_path: Path) -> None:
        """When a successor that superseded the path exits (rolled back), the predecessor serves again."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            with _listeners("adt") as socks:
                old = HandoverServer(path, lambda: dict(socks), recheck_interval=0.02)
                await old.start()
                got = await receive_handover(path)
                assert got is not None
                new = HandoverServer(path, lambda: dict(got), recheck_interval=0.02)
                await new.start()
                for s in got.values():
                    s.close()
                await new.close()  # the failed successor removes its path
                try:
                    async with asyncio.timeout(5):
                        while not path.exists():
                            await asyncio.sleep(0.01)  # polling with a deadline
                    again = await receive_handover(path)
                    assert again is not None
                    assert _port(again["adt"]) == _port(socks["adt"])
                    for s in again.values():
                        s.close()
                finally:
                    await old.close()
                assert not path.exists()

        asyncio.run(scenario())

    def test_predecessor_republishes_over_a_killed_successors_socket(self, tmp_path: Path) -> None:
        """A successor killed with -9 leaves its socket file, answering no one: the predecessor serves again.

        Otherwise the next process would find that dead file, bind, and fail on
        the port the predecessor still holds. While the successor lives, its
        path is left alone.
        """
        path = tmp_path / "handover.sock"
        child = textwrap.dedent(
            """
            import asyncio, sys
            from pathlib import Path
            import structlog
            from agent.runtime.handover import HandoverServer, receive_handover, receive_republished

            structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

            async def main():
                socks = await receive_handover(Path(sys.argv[1]))
                server = HandoverServer(Path(sys.argv[1]), lambda: dict(socks))
                await server.start()
                print("serving", flush=True)
                await asyncio.sleep(60)

            asyncio.run(main())
            """
        )

        async def scenario() -> None:
            with _listeners("adt") as socks:
                old = HandoverServer(path, lambda: dict(socks), recheck_interval=0.02)
                await old.start()
                mine = os.stat(path).st_ino
                proc = await asyncio.create_subprocess_exec(PY, "-c", child, str(path), stdout=asyncio.subprocess.PIPE)
                try:
                    assert proc.stdout is not None
                    async with asyncio.timeout(20):
                        assert await proc.stdout.readline() == b"serving\n"
                        await old.handed_over.wait()
                    theirs = os.stat(path).st_ino
                    assert theirs != mine
                    await asyncio.sleep(0.2)  # ten of the predecessor's rechecks: a live successor keeps its path
                    assert os.stat(path).st_ino == theirs
                    proc.kill()
                    await proc.wait()
                    assert os.stat(path).st_ino == theirs  # the dead successor's file is still there
                    async with asyncio.timeout(5):
                        while os.stat(path).st_ino == theirs:
                            await asyncio.sleep(0.01)  # polling with a deadline
                    again = await receive_handover(path)
                    assert again is not None and _port(again["adt"]) == _port(socks["adt"])
                    for sock in again.values():
                        sock.close()
                finally:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
                    await old.close()

        asyncio.run(scenario())

    def test_a_start_that_found_a_dead_file_waits_for_the_republished_server(self, tmp_path: Path) -> None:
        """receive_republished: a dead socket file now, a server there a moment later: its listeners."""
        path = tmp_path / "handover.sock"
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(path))
        dead.close()

        async def scenario() -> None:
            with _listeners("adt") as socks:
                server = HandoverServer(path, lambda: dict(socks))

                async def later() -> None:
                    await asyncio.sleep(0.3)  # the predecessor's recheck, some time after the failed start
                    await server.start()

                publish = asyncio.create_task(later())
                try:
                    got = await receive_republished(path, within=5.0)
                    assert got is not None and _port(got["adt"]) == _port(socks["adt"])
                    for sock in got.values():
                        sock.close()
                    assert await receive_republished(tmp_path / "nobody.sock", within=0.2) is None
                finally:
                    await publish
                    await server.close()

        asyncio.run(scenario())

    def test_empty_listener_set(self, tmp_path: Path) -> None:
        """A predecessor with no listeners hands over an empty mapping."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            server = HandoverServer(path, dict)
            await server.start()
            try:
                assert await receive_handover(path) == {}
            finally:
                await server.close()

        asyncio.run(scenario())

    def test_closed_listener_is_skipped(self, tmp_path: Path) -> None:
        """A listener the giver already closed is left out instead of breaking the handover."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            with _listeners("adt", "lab") as socks:
                socks["lab"].close()
                server = HandoverServer(path, lambda: dict(socks))
                await server.start()
                try:
                    got = await receive_handover(path)
                    assert got is not None
                    assert list(got) == ["adt"]
                    for s in got.values():
                        s.close()
                finally:
                    await server.close()

        asyncio.run(scenario())

    def test_garbage_header_raises(self, tmp_path: Path) -> None:
        """A peer that answers with something other than the header raises HandoverError."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            async def bad(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                w.write(b"not json\n")
                await w.drain()
                w.close()

            srv = await asyncio.start_unix_server(bad, path=str(path))
            try:
                with pytest.raises(HandoverError, match="bad handover header"):
                    await receive_handover(path)
            finally:
                srv.close()
                await srv.wait_closed()

        asyncio.run(scenario())

    def test_silent_peer_times_out(self, tmp_path: Path) -> None:
        """A peer that never answers raises HandoverError after the timeout."""
        path = tmp_path / "handover.sock"

        async def scenario() -> None:
            done = asyncio.Event()

            async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                await done.wait()
                w.close()

            srv = await asyncio.start_unix_server(silent, path=str(path))
            try:
                with pytest.raises(HandoverError, match="timed out"):
                    await receive_handover(path, timeout=0.3)
            finally:
                done.set()
                srv.close()
                await srv.wait_closed()

        asyncio.run(scenario())


_INHERIT_CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    import structlog
    from agent.runtime.sockets import inherited_sockets

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    socks = inherited_sockets()
    info = {
        name: [
            {
                "port": s.getsockname()[1],
                "family": int(s.family),
                "blocking": s.getblocking(),
                "inheritable": os.get_inheritable(s.fileno()),
                "fd": s.fileno(),
            }
            for s in lst
        ]
        for name, lst in socks.items()
    }
    info["_env_left"] = sorted(k for k in os.environ if k.startswith("LISTEN_"))
    text = json.dumps(info).encode()
    if sys.argv[1] == "stdout":
        print(text.decode(), flush=True)
    s = socks["adt"][0]
    s.setblocking(True)
    s.settimeout(20)
    conn, _ = s.accept()
    conn.sendall(text)
    conn.close()
    """
)


class TestInheritedSockets:
    def test_no_environment_gives_nothing(self) -> None:
        """Without LISTEN_* variables nothing is inherited."""
        assert inherited_sockets({}) == {}

    def test_other_pid_is_ignored_and_variables_unset(self) -> None:
        """Fds meant for another PID are not taken, and LISTEN_* are removed anyway."""
        env = {
            "LISTEN_PID": str(os.getpid() + 1),
            "LISTEN_FDS": "1",
            "LISTEN_FDNAMES": "adt",
            "OTHER": "kept",
        }
        assert inherited_sockets(env) == {}
        assert env == {"OTHER": "kept"}

    def test_fd_that_is_not_a_socket_raises(self) -> None:
        """A LISTEN_FDS fd that is not a socket is a HandoverError, not a crash later."""
        env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "1"}
        r, w = os.pipe()
        try:
            saved = os.dup(3)
            try:
                os.dup2(r, 3)
                with pytest.raises(HandoverError, match="fd 3"):
                    inherited_sockets(env)
            finally:
                os.dup2(saved, 3, inheritable=False)
                os.close(saved)
        finally:
            os.close(r)
            os.close(w)
        assert env == {}

    def test_pass_fds_child(self) -> None:
        """A child given fds 3 and 4 with LISTEN_PID=its pid maps names, unnamed → 'unknown'."""
        with _listeners("a", "b") as socks:
            a, b = socks["a"], socks["b"]
            # Move the fds out of the 3..4 range so the shell can place them there.
            hi_a = fcntl.fcntl(a.fileno(), fcntl.F_DUPFD_CLOEXEC, 20)
            hi_b = fcntl.fcntl(b.fileno(), fcntl.F_DUPFD_CLOEXEC, 20)
            # What systemd does before exec: fds at 3.., LISTEN_PID = the exec'd PID.
            wrapper = (
                "import os, sys\n"
                f"os.dup2({hi_a}, 3); os.dup2({hi_b}, 4); os.close({hi_a}); os.close({hi_b})\n"
                "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='2',"
                " LISTEN_FDNAMES='adt:')\n"
                "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1], 'stdout'])\n"
            )
            proc = subprocess.Popen(
                [PY, "-c", wrapper, _INHERIT_CHILD],
                pass_fds=(hi_a, hi_b),
                stdout=subprocess.PIPE,
            )
            os.close(hi_a)
            os.close(hi_b)
            try:
                assert proc.stdout is not None
                info = json.loads(proc.stdout.readline())
                port_a, port_b = _port(a), _port(b)
                a.close()
                b.close()
                with _connect_with_deadline(port_a) as conn:
                    assert json.loads(_recv_all(conn)) == info
                assert proc.wait(timeout=10) == 0
            finally:
                _stop(proc)
                assert proc.stdout is not None
                proc.stdout.close()
        assert info["_env_left"] == []
        assert [e["port"] for e in info["adt"]] == [port_a]
        assert [e["port"] for e in info["unknown"]] == [port_b]
        assert [e["fd"] for e in info["adt"] + info["unknown"]] == [3, 4]
        for entry in info["adt"] + info["unknown"]:
            assert entry["family"] == socket.AF_INET
            assert entry["blocking"] is False
            assert entry["inheritable"] is False

    @pytest.mark.skipif(
        shutil.which("systemd-socket-activate") is None,
        reason="systemd-socket-activate is not installed",
    )
    def test_under_systemd_socket_activate(self) -> None:
        """Under real systemd-socket-activate the named fd arrives as channel 'adt'."""
        probe = bind_listener("127.0.0.1", 0)
        port = _port(probe)
        probe.close()
        proc = subprocess.Popen(
            [
                "systemd-socket-activate",
                "-l",
                f"127.0.0.1:{port}",
                "--fdname=adt",
                PY,
                "-c",
                _INHERIT_CHILD,
                "conn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            with _connect_with_deadline(port) as conn:
                conn.settimeout(20)
                info = json.loads(_recv_all(conn))
            assert proc.wait(timeout=10) == 0
        finally:
            _stop(proc)
            assert proc.stderr is not None
            proc.stderr.close()
        assert info["_env_left"] == []
        assert list(info) == ["adt", "_env_left"]
        (entry,) = info["adt"]
        assert entry == {
            "port": port,
            "family": int(socket.AF_INET),
            "blocking": False,
            "inheritable": False,
            "fd": 3,
        }


class TestReusePortTrap:
    def test_closing_a_reuseport_listener_resets_its_queued_connections(self) -> None:
        """Documents the SO_REUSEPORT trap (SPEC 7): with tcp_migrate_req=0, connections
        waiting in a closing reuseport listener's accept queue are reset — the reason
        handover (one shared socket, one accept queue) is preferred over rebinding."""
        if tcp_migrate_req_enabled():
            pytest.skip("net.ipv4.tcp_migrate_req=1: the kernel migrates queued connections")
        closing = bind_listener("127.0.0.1", 0, reuse_port=True)
        port = _port(closing)
        staying = bind_listener("127.0.0.1", port, reuse_port=True)
        staying.settimeout(0.05)
        stop = threading.Event()

        def serve_staying() -> None:
            while not stop.is_set():
                try:
                    conn, _ = staying.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.sendall(b"ok")

        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(32)]
        for c in clients:
            c.sendall(b"x")
        closing.close()  # the "old process" exits without accepting its queue
        server = threading.Thread(target=serve_staying)
        server.start()
        outcomes: list[str] = []
        try:
            for c in clients:
                try:
                    data = c.recv(2)
                    outcomes.append("served" if data == b"ok" else f"other:{data!r}")
                except ConnectionResetError:
                    outcomes.append("reset")
        finally:
            stop.set()
            server.join(timeout=10)
            staying.close()
            for c in clients:
                c.close()
        assert set(outcomes) <= {"served", "reset"}, outcomes
        if "reset" not in outcomes:
            pytest.skip("no queued connection was reset: this kernel behaves otherwise")
        assert outcomes.count("reset") + outcomes.count("served") == 32
