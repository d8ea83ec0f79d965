"""The event loop's CPU per accepted message at intake, without sockets or a database.

    .venv/bin/python bench/intake_core.py [--messages 20000] [--connections 16] [--repeat 5] [--tree=DIR]

Drives the real connection shell (``agent.runtime.mllp_connection.Connection``
over ``agent.core.intake.IntakeConnection``, real ``AgentMetrics``, structlog
configured at info as the daemon does) with the load generator's 230-byte
ADT^A01, one frame per ``data_received`` as a serial sender delivers it. The
transport is a stand-in whose ``write`` keeps nothing, the writer a stand-in
whose ``intake`` answers at once with a synthetic "accepted" result (as the
real writer's ``_deliver`` calls ``done`` on the loop after the COMMIT): so
what is measured is exactly the loop's Python per message — framing, the MSH
read, decode, the ACK built, the IntakeItem, metrics, the commit result's
answer, the ACK framed — and not the kernel's ``send``/``recv``, the selector
or the writer thread. ``--connections N`` interleaves N connections (each
step: one frame from each, then every commit answered, like a group commit).

Prints CPU microseconds per message (``time.process_time``), best and median
of ``--repeat`` runs; best is the figure to compare, the machine being shared.
``--tree=/tmp/old`` imports the agent of another checkout instead (a
``git worktree add --detach /tmp/old <commit>``): old and new side by side.
For instruction counts: ``valgrind --tool=callgrind .venv/bin/python
bench/intake_core.py --messages 2000 --repeat 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# ``--tree DIR``: measure another checkout's agent (an A/B without a second copy of this file).
_TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tree=")), None)
sys.path.insert(0, _TREE or str(Path(__file__).resolve().parent.parent))

from agent.app.config import ChannelSettings  # noqa: E402
from agent.runtime.logs import configure_logging  # noqa: E402
from agent.runtime.metrics import AgentMetrics  # noqa: E402
from agent.runtime.mllp_connection import Connection  # noqa: E402
from agent.runtime.mllp_server import IntakeContext, channel_policy  # noqa: E402
from agent.storage.store import IntakeItem, IntakeResult  # noqa: E402

#: bench/loadgen.c's BUILTIN_ADT, MSH-10 filled in per message.
ADT = (
    "MSH|^~\\&|LOADGEN|NORTH|EHR|CENTRAL|20260101120000||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
    "EVN|A01|20260101120000\r"
    "PID|1||123456^^^MRN^MR||DOE^JANE^Q||19800101|F|||1 MAIN ST^^SPRINGFIELD^IL^62701\r"
    "PV1|1|I|WARD^101^1||||1234^SMITH^JOHN\r"
)


class _Transport(asyncio.Transport):
    """A socket that accepts every write and keeps nothing (counts frames and bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0
        self.acked = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.frames += 1
        if b"|AA|" in data:
            self.acked += 1

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:  # noqa: ANN401 - asyncio's signature
        return ("127.0.0.1", 40000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Writer:
    """The writer thread's intake interface, answering from a list the bench drains."""

    def __init__(self, messages: int) -> None:
        self.pending: list[tuple[Sequence[IntakeItem], Callable[..., None]]] = []
        self.outcomes = 0
        self.seq = 0
        # Built before the clock starts: the real writer builds them on its own thread.
        self.results = [IntakeResult("accepted", f"m{seq:012d}", seq=seq) for seq in range(messages)]

    def intake(self, items: Sequence[IntakeItem], done: Callable[..., None], loop: object = None) -> None:
        self.pending.append((items, done))

    def defer_ack_outcome(self, message_id: str, outcome: str) -> None:
        self.outcomes += 1

    def answer_all(self) -> None:
        pending, self.pending = self.pending, []
        for items, done in pending:
            seq = self.seq
            self.seq += len(items)
            done(self.results[seq:self.seq], None)


class _Owner:
    """The listener's part a connection uses: admission and the open/finished count."""

    def __init__(self, ctx: IntakeContext) -> None:
        self.channel = ChannelSettings(name="adt", listen="127.0.0.1:0")
        self.ctx = ctx
        self.policy = channel_policy(self.channel, 30.0)
        self.can_hand_over = False

    def admit(self, conn: Connection, peer: Any) -> bool:  # noqa: ANN401
        return True

    def opened(self, conn: Connection) -> None:
        pass

    def finished(self, conn: Connection) -> None:
        pass


def _frames(n: int, connection: int) -> list[bytes]:
    return [b"\x0b" + ADT.format(cid=f"B.{connection}.{i}").encode() + b"\x1c\r" for i in range(n)]


async def _run(messages: int, connections: int) -> float:
    """CPU seconds for ``messages`` frames over ``connections`` connections, all ACKed AA."""
    metrics = AgentMetrics()
    writer = _Writer(messages)
    woken: list[str] = []
    ctx = IntakeContext(writer=writer, relay=None, metrics=metrics, on_committed=woken.append)  # type: ignore[arg-type]
    owner = _Owner(ctx)
    per = messages // connections
    conns, transports, frames = [], [], []
    for c in range(connections):
        conn = Connection(owner)  # type: ignore[arg-type]
        transport = _Transport()
        conn.connection_made(transport)
        conns.append(conn)
        transports.append(transport)
        frames.append(_frames(per, c))
    start = time.process_time()
    for i in range(per):
        for c in range(connections):
            conns[c].data_received(frames[c][i])
        writer.answer_all()
        woken.clear()
    cpu = time.process_time() - start
    acked = sum(t.acked for t in transports)
    if acked != per * connections or writer.outcomes != acked:
        raise SystemExit(f"expected {per * connections} AA written and recorded, got {acked} / {writer.outcomes}")
    return cpu / (per * connections)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", metavar="DIR", help="another checkout's agent (write --tree=DIR)")
    parser.add_argument("--smoke", action="store_true", help="a few hundred messages: proves the bench works")
    args = parser.parse_args(argv)
    if args.smoke:
        args.messages, args.repeat = 320, 1
    configure_logging("info", "json", stream=io.StringIO())
    runs = [asyncio.run(_run(args.messages, args.connections)) * 1e6 for _ in range(args.repeat)]
    import agent  # which tree was measured

    print(f"{Path(agent.__file__).parent.parent}: {args.connections} connection(s), "
          f"{args.messages} messages x {args.repeat}: "
          f"CPU per message best {min(runs):.1f} us, median {statistics.median(runs):.1f} us "
          f"(runs: {', '.join(f'{r:.1f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
