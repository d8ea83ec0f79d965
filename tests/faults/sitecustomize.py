"""Fault injection for daemon subprocesses, loaded by ``site`` when this directory is on PYTHONPATH.

Only tests set PYTHONPATH to this directory; the daemon's own code is not
changed. Each fault is switched on by an environment variable:

- ``HL7TEST_FREEZE_BEFORE_TRANSMIT=<control id>``: the first time the
  dispatcher hands the transmit of that message to its session — after the
  ``inflight`` commit, before the WebSocket write — the process stops itself
  with a real SIGSTOP (all threads, as a VM pause would); it goes on where it
  stopped when the test sends SIGCONT. A test cannot time an outside SIGSTOP
  into that window reliably; the signal and everything after it are real.
- ``HL7TEST_NO_WRITE_GUARD=1``: the dispatcher's lease check before each
  write always passes, so a test can show what the server's epoch fence does
  on its own.
"""

from __future__ import annotations

import os
import signal
from typing import Any

_FREEZE_AT = os.environ.get("HL7TEST_FREEZE_BEFORE_TRANSMIT")
_NO_WRITE_GUARD = os.environ.get("HL7TEST_NO_WRITE_GUARD") == "1"

if _FREEZE_AT:
    from agent.runtime import upstream
    _original_transmit = upstream.Session.transmit
    _frozen: list[bool] = []

    async def _transmit(self: upstream.Session, t: Any) -> Any:
        if t.control_id == _FREEZE_AT and not _frozen:
            _frozen.append(True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return await _original_transmit(self, t)

    upstream.Session.transmit = _transmit  # type: ignore[method-assign]

if _NO_WRITE_GUARD:
    from agent.runtime import dispatcher
    def _always(self: Any, tenure: Any) -> Any:
        return lambda: True

    dispatcher.Dispatcher._write_guard = _always  # type: ignore[method-assign]
