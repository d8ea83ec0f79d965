"""A minimal protocol-v1 upstream server for benches: answers every transmit at once.

    python bench/upstream_server.py [--port 0] [--delay-ms 0] [--records FILE]

Not the dev server (``agent/devserver.py`` logs every transmit and keeps
every answer): this one does the least a correct server can do, so that the
agent's dispatch is what the bench measures. It shares no code with the
agent: hello -> welcome (``replay: true``), every transmit ->
``transmit_response`` status 200 with a small AA built by string
formatting, after ``--delay-ms`` (each transmit waits on its own, so
several in flight overlap as they would on a real server).

Stdout, one JSON object per line: ``{"listening": PORT}`` first, then every
0.25 s ``{"t": <CLOCK_MONOTONIC>, "received": N}``, and on SIGTERM a
summary ``{"summary": {...}}``. With ``--records FILE`` it writes one
tab-separated line per transmit at exit: arrival time (CLOCK_MONOTONIC, the
same clock as the load generator's), channel, seq, attempt, control_id, id,
PID-3.1 — what the bench needs to check delivery once and in order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed


class Upstream:
    def __init__(self, delay: float, keep_records: bool) -> None:
        self.delay = delay
        self.keep_records = keep_records
        self.received = 0
        self.resends = 0
        self.out_of_order = 0  # a seq not above the channel's last one (first attempts)
        self.last_seq: dict[str, int] = {}
        self.records: list[tuple[float, str, int, int, str, str, str]] = []
        self.sessions = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, ws: ServerConnection) -> None:
        self.sessions += 1
        try:
            hello = json.loads(await ws.recv())
            if hello.get("type") != "hello" or hello.get("protocol") != 1:
                await ws.close(1002, "expected hello")
                return
            await ws.send('{"type":"welcome","replay":true}')
            async for frame in ws:
                message = json.loads(frame)
                if message.get("type") != "transmit":
                    continue
                answer = self.on_transmit(message)
                if self.delay > 0:
                    task = asyncio.create_task(self.answer_later(ws, answer))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                else:
                    await ws.send(answer)
        except ConnectionClosed:
            return

    def on_transmit(self, m: dict[str, Any]) -> str:
        now = time.monotonic()
        self.received += 1
        channel, seq, attempt = m["channel"], int(m["seq"]), int(m["attempt"])
        if attempt > 1:
            self.resends += 1
        elif seq <= self.last_seq.get(channel, 0):
            self.out_of_order += 1
        self.last_seq[channel] = max(seq, self.last_seq.get(channel, 0))
        control_id = m.get("control_id", "")
        if self.keep_records:
            self.records.append((now, channel, seq, attempt, control_id, m["id"], _pid3(m.get("body", ""))))
        ack = (f"MSH|^~\\&|EHR|CENTRAL|LAB|NORTH|{time.strftime('%Y%m%d%H%M%S')}||ACK^A01^ACK|"
               f"A{self.received}|P|2.5.1\rMSA|AA|{control_id}\r")
        return json.dumps({"type": "transmit_response", "id": m["id"], "attempt": attempt,
                           "status": 200, "ack": ack}, separators=(",", ":"))

    async def answer_later(self, ws: ServerConnection, answer: str) -> None:
        await asyncio.sleep(self.delay)
        try:
            await ws.send(answer)
        except ConnectionClosed:
            pass


def _pid3(body: str) -> str:
    """PID-3.1, the patient identifier (the partition key the benches use)."""
    start = body.find("\rPID|")
    if start < 0:
        return ""
    fields = body[start + 1 : body.find("\r", start + 1)].split("|")
    return fields[3].split("^")[0] if len(fields) > 3 else ""


async def main_async(args: argparse.Namespace) -> Upstream:
    upstream = Upstream(args.delay_ms / 1000.0, bool(args.records))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(upstream.handle, args.host, args.port, compression=None, max_size=64 * 1024 * 1024) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(json.dumps({"listening": port}), flush=True)
        while not stop.is_set():
            print(json.dumps({"t": time.monotonic(), "received": upstream.received,
                              "sessions": upstream.sessions}), flush=True)
            try:
                async with asyncio.timeout(0.25):
                    await stop.wait()
            except TimeoutError:
                pass
    return upstream


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="answer each transmit after this delay")
    parser.add_argument("--records", help="write one line per transmit to this file at exit")
    args = parser.parse_args()
    upstream = asyncio.run(main_async(args))
    if args.records:
        with open(args.records, "w", encoding="utf-8") as f:
            for r in upstream.records:
                f.write("\t".join(str(x) for x in r) + "\n")
    print(json.dumps({"summary": {"received": upstream.received, "resends": upstream.resends,
                                  "out_of_order": upstream.out_of_order, "sessions": upstream.sessions}}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
