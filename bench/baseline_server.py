"""The baseline: python-hl7's own asyncio MLLP server, parse + ACK, nothing stored.

    python bench/baseline_server.py [--host 127.0.0.1] [--port 0]

What a Python integration engineer would write in ten lines with
``hl7.mllp.start_hl7_server``: every message is parsed with ``hl7.parse``
(inside ``readmessage``) and answered with ``create_ack()`` (AA). It does no
durable work at all, so hl7-agent, which commits every message with
``synchronous=FULL`` before it ACKs, is measured against the cost of the
Python MLLP server alone. Prints one JSON line ``{"listening": PORT}`` on
stdout once it accepts connections; runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import warnings
from typing import Any

import hl7.mllp


async def handle(reader: Any, writer: Any) -> None:
    """One sender connection: read a message, answer AA, until the sender goes."""
    try:
        while True:
            try:
                message = await reader.readmessage()
            except asyncio.IncompleteReadError:
                return
            writer.writemessage(message.create_ack())
            await writer.drain()
    except (ConnectionError, hl7.mllp.InvalidBlockError):
        return
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await hl7.mllp.start_hl7_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"listening": bound}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    args = parser.parse_args()
    # create_ack() calls datetime.utcnow(), deprecated from Python 3.12: not ours to fix.
    warnings.simplefilter("ignore", DeprecationWarning)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
