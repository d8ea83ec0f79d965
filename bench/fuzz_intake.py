"""A long fuzz run over the whole intake path: framer, MSH reader, charset, ACKs, commit, audit.

    pip install atheris          # coverage-guided; else --engine random
    python bench/fuzz_intake.py [--engine atheris|random] [--frames 200000] [--seconds 600] [--seed 1]

Not part of the test suite. Every input goes through the real frame handler
— the intake core (``agent.core.intake.IntakeConnection``) with the real
store on SQLite in a temporary folder, no event loop — via the harness the
property tests use (``tests/intakefuzz.py``, ``CoreHarness``), and is
checked against the same properties: nothing reaches the last-resort path,
nothing malformed is accepted, every readable MSH is answered, every frame
not committed leaves an audit row, every ACK is one clean frame. One input
in eight is a raw stream (frames, junk, restarts, oversize) framed by the
connection's own decoder.

With atheris the inputs are coverage-guided (libFuzzer mutates the bytes;
half of them are first mapped onto a damaged corpus message, so the run
spends its time past the MSH checks too). A broken property is a crash:
libFuzzer writes the input to ``crash-*`` and stops. The random engine
reports every distinct failure (by property and location) and goes on.
Prints the figures at the end: frames, streams, outcomes, distinct failures.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import structlog

# A quiet run: the handler logs every reject; only the figures matter here.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))

MAX_MESSAGE_BYTES = 4096


class Run:
    """One harness for the whole run, and the figures."""

    def __init__(self, data_dir: Path) -> None:
        from intakefuzz import CoreHarness

        self.handler = CoreHarness(data_dir, max_message_bytes=MAX_MESSAGE_BYTES).__enter__()
        self.frames = 0
        self.streams = 0
        self.stream_frames = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, tuple[int, bytes]] = {}
        self.started = time.monotonic()

    def one(self, data: bytes, *, keep_going: bool) -> None:
        from intakefuzz import CORPUS, check_handled, check_streamed, frames_in, mutate

        from agent.core.mllp import Frame, OversizeFrame

        if not data:
            return
        selector, body = data[0], data[1:]
        rng = random.Random(body[:8])
        if selector % 8 == 0:
            # A raw stream: pieces of damaged messages, framed or not, and junk.
            pieces = []
            for _ in range(rng.randint(1, 4)):
                message = mutate(rng, rng.choice(CORPUS), rng.randint(0, 6))
                pieces.append(b"\x0b" + message + b"\x1c\r" if rng.random() < 0.8 else message)
            stream = b"".join(pieces) + body[8:64]
            self._checked(stream, lambda: check_streamed(
                stream, self.handler.stream(stream), MAX_MESSAGE_BYTES), keep_going)
            self.streams += 1
            # Frames the connection's own decoder framed: the stream's, and the sentinel.
            self.stream_frames += 1 + sum(
                1 for e in frames_in(stream, MAX_MESSAGE_BYTES) if isinstance(e, (Frame, OversizeFrame)))
            return
        if selector % 2 == 0:
            payload = mutate(rng, CORPUS[selector % len(CORPUS)], rng.choice((0, 1, 1, 2, 3, 5, 8)))
            # The fuzzer's own bytes still steer: sometimes spliced in at a chosen place.
            if body[8:] and selector % 3 == 0:
                at = rng.randint(0, len(payload))
                payload = payload[:at] + body[8:40] + payload[at:]
        elif selector % 4 == 1:
            payload = b"MSH|^~\\&|" + body  # past the MSH check, into the fields
        else:
            payload = body

        def handle_and_check() -> None:
            handled = self.handler.handle(payload)
            self.outcomes[",".join(str(c) for c in handled.codes) or ("none, stored" if handled.stored else "none")] += 1
            check_handled(payload, handled)

        self._checked(payload, handle_and_check, keep_going)
        self.frames += 1

    def _checked(self, data: bytes, fn: Any, keep_going: bool) -> None:
        try:
            fn()
        except Exception as exc:
            if not keep_going:
                raise
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            key = f"{type(exc).__name__} at {Path(frame.filename).name}:{frame.lineno}: {str(exc)[:120]}"
            if key not in self.failures:
                self.failures[key] = (0, data)
                print(f"NEW FAILURE {key}\n  input: {data[:300]!r}", flush=True)
            seen, first = self.failures[key]
            self.failures[key] = (seen + 1, first)

    def report(self) -> None:
        elapsed = time.monotonic() - self.started
        total = self.frames + self.stream_frames
        print(f"\nframes handled: {total} ({self.frames} one by one, {self.stream_frames} in {self.streams} "
              f"raw streams) in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.0f} frames/s)")
        print("answers:", ", ".join(f"{k}: {v}" for k, v in self.outcomes.most_common()))
        print(f"distinct failures: {len(self.failures)}")
        for key, (seen, data) in self.failures.items():
            print(f"  {seen} x {key}\n    first input: {data[:200]!r}")

    def close(self) -> None:
        self.handler.__exit__()


def run_random(run: Run, frames: int, seconds: float, seed: int) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while run.frames + run.streams < frames and time.monotonic() < deadline:
        size = rng.choice((0, 8, 16, 64, 200, 600))
        run.one(bytes([rng.randrange(256)]) + rng.randbytes(size + 8), keep_going=True)


def instrument_for_atheris() -> None:
    """Coverage instrumentation of the agent's code: before anything imports it."""
    import atheris

    with atheris.instrument_imports(include=["agent"]):
        import agent.core.acks
        import agent.core.charsets
        import agent.core.envelope
        import agent.core.intake
        import agent.core.intake_policy
        import agent.core.mllp
        import agent.storage.store  # noqa: F401 - instrumented for coverage


def run_atheris(run: Run, frames: int, seconds: float, seed: int) -> None:
    """libFuzzer ends the process itself (os._exit): the figures are printed from the last input."""
    import os

    import atheris

    deadline = time.monotonic() + seconds
    calls = 0

    def one_input(data: bytes) -> None:
        nonlocal calls
        calls += 1
        try:
            run.one(data, keep_going=False)
        except BaseException:
            run.report()
            raise
        if calls % 20_000 == 0:
            run.report()
        if calls >= frames or time.monotonic() > deadline:
            run.report()
            run.close()
            os._exit(0)

    atheris.Setup([sys.argv[0], f"-seed={seed}", "-max_len=2048", "-print_final_stats=1"], one_input)
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("atheris", "random"), default=None)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    engine = args.engine
    if engine is None:
        try:
            import atheris  # noqa: F401
            engine = "atheris"
        except ImportError:
            engine = "random"
    print(f"engine: {engine}, up to {args.frames} inputs or {args.seconds:.0f} s, seed {args.seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hl7-fuzz-") as tmp:
        if engine == "atheris":
            instrument_for_atheris()
        run = Run(Path(tmp) / "data")
        try:
            if engine == "atheris":
                run_atheris(run, args.frames, args.seconds, args.seed)
            else:
                run_random(run, args.frames, args.seconds, args.seed)
                run.report()
        finally:
            run.close()


if __name__ == "__main__":
    main()
