"""What idle sender connections cost: the daemon's RSS with 1,000 connections open.

    .venv/bin/python bench/idle.py [--connections 1000]

Starts the daemon (intake only, one channel with ``max_connections`` and
``max_connections_per_source`` above the count, RLIMIT_NOFILE raised for it
and for this process), sends a few messages so lazily built state exists, then reads its RSS: before, with
every connection open and idle (accepted: the daemon holds that many more
sockets), after each connection has sent one message and got its ACK (the
state of a sender between messages), and after they all closed.
"""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import time

import harness as h

TARGET_MIB = 64


def settle_rss(pid: int, seconds: float = 1.0) -> int:
    """The highest RSS over ``seconds``: allocation after accept may land a little late."""
    deadline = time.monotonic() + seconds
    top = 0
    while time.monotonic() < deadline:
        top = max(top, h.rss_bytes(pid))
        time.sleep(0.1)
    return top


def wait_sockets(pid: int, at_least: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = h.socket_fds(pid)
        if n >= at_least:
            return n
        if time.monotonic() > deadline:
            raise h.BenchError(f"the agent holds {n} sockets, expected at least {at_least}")
        time.sleep(0.05)


def wait_sockets_at_most(pid: int, most: int, timeout: float = 30.0) -> None:
    """Until the daemon has closed the connections of the step before."""
    deadline = time.monotonic() + timeout
    while h.socket_fds(pid) > most:
        if time.monotonic() > deadline:
            raise h.BenchError(f"the agent still holds {h.socket_fds(pid)} sockets, expected {most}")
        time.sleep(0.05)


def frame(cid: str) -> bytes:
    """One MLLP frame (VT message FS CR) with this MSH-10."""
    return b"\x0b" + h.ADT_TEMPLATE.format(cid=cid).encode() + b"\x1c\x0d"


def read_ack(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\x1c\x0d"):
        chunk = sock.recv(4096)
        if not chunk:
            raise h.BenchError("the agent closed a connection instead of answering")
        data += chunk
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="50 connections: proves the bench works")
    args = parser.parse_args()
    h.stop_on_sigterm()
    if args.smoke:
        args.connections = 50
    want = args.connections + 256
    if h.raise_nofile(want) < want:
        raise h.BenchError(f"RLIMIT_NOFILE cannot be raised to {want} (hard limit too low)")

    def child_limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))

    with h.workdir(args.workdir, args.keep) as wd:
        info = h.machine(wd)
        h.print_machine(info)
        channel = {"name": "adt", "listen": f"127.0.0.1:{h.free_port()}", "ack": "commit",
                   # every connection comes from 127.0.0.1: the per-source bound too
                   "max_connections": args.connections + 16,
                   "max_connections_per_source": args.connections + 16}
        port = h.channel_ports([channel])[0]
        agent = h.Agent(wd, h.agent_config(wd / "data", [channel], admin_port=h.free_port()), preexec_fn=child_limits)
        socks: list[socket.socket] = []
        try:
            agent.wait_ready()
            base_socks = h.socket_fds(agent.pid)
            warm = h.run_loadgen([port], 4, count=200, prefix="w")
            h.check_all_accepted(warm, "warm-up")
            wait_sockets_at_most(agent.pid, base_socks)
            before = settle_rss(agent.pid)
            for _ in range(args.connections):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks.append(s)
            wait_sockets(agent.pid, base_socks + args.connections)
            idle = settle_rss(agent.pid)
            for i, s in enumerate(socks):
                s.sendall(frame(f"I{i}"))
                if b"MSA|AA|" not in read_ack(s):
                    raise h.BenchError(f"connection {i}: no AA")
            talked = settle_rss(agent.pid)
            for s in socks:
                s.close()
            socks.clear()
            wait_sockets_at_most(agent.pid, base_socks)
            closed = settle_rss(agent.pid)
        finally:
            for s in socks:
                s.close()
            agent.stop()
        n = args.connections
        cost_idle, cost_talked = h.mib(idle - before), h.mib(talked - before)
        print(f"\n{n} idle connections (RSS of the daemon, pid {agent.pid}):")
        print(f"  before                 {h.mib(before):7.1f} MiB")
        print(f"  {n} open, idle       {h.mib(idle):7.1f} MiB   +{cost_idle:.1f} MiB "
              f"({(idle - before) / n / 1024:.1f} KiB per connection)")
        print(f"  each sent one message  {h.mib(talked):7.1f} MiB   +{cost_talked:.1f} MiB "
              f"({(talked - before) / n / 1024:.1f} KiB per connection)")
        print(f"  all closed again       {h.mib(closed):7.1f} MiB")
        scaled = max(cost_idle, cost_talked) * 1000 / n
        print(f"  target: 1,000 idle connections < {TARGET_MIB} MiB: {h.verdict(scaled < TARGET_MIB)}"
              + (f" (scaled from {n})" if n != 1000 else ""))
        h.write_json(args.json, {"machine": info, "args": vars(args), "rss_before": before, "rss_idle": idle,
                                 "rss_after_one_message": talked, "rss_closed": closed, "connections": n})
    return 0


if __name__ == "__main__":
    sys.exit(main())
