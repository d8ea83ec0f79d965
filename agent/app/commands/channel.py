"""``hl7-agent channel pause|resume NAME``: the durable flag the dispatcher honours.

A paused channel keeps taking messages (intake goes on) and sends none until
it is resumed, across restarts (docs/operations.md, docs/queue.md#operator-actions).
A pause or resume that changes the flag is recorded for the daemon's log in
the same transaction (``operator_action``).
"""

from __future__ import annotations

import argparse

from agent.app.cli import EXIT_FAILURE, EXIT_OK
from agent.app.commands.common import ActionRecord, command, err, open_store
from agent.app.config import Settings
from agent.core.states import State


@command
def cmd_channel(settings: Settings, args: argparse.Namespace) -> int:
    """``channel pause|resume NAME``."""
    name = args.name
    configured = [c.name for c in settings.channels]
    if name not in configured:
        err(
            f"no channel named {name!r} in the configuration (configured: {', '.join(configured) or 'none'})"
        )
        return EXIT_FAILURE
    pause = args.channel_command == "pause"
    audit = ActionRecord("pause" if pause else "resume", channel=name)
    keys = 0
    with open_store(settings, write=True) as store:
        with store.transaction():
            was_paused = name in store.paused_channels()
            if pause:
                if not was_paused:
                    store.pause_channel(name, f"operator ({audit.user})")
                    audit.record(store, rows=0, detail={})
            else:
                # Every key's pause too: on_reject = "pause" on a partitioned
                # channel pauses a key, not the channel.
                keys = store.resume_channel(name)
                if was_paused or keys:
                    audit.record(store, rows=0, detail={"partitions": keys} if keys else {})
        live = store.stats([name])["channels"][name]
    backlog = f"{live[State.QUEUED]} queued, {live[State.CLAIMED] + live[State.INFLIGHT]} in flight"
    if pause:
        already = "already " if was_paused else ""
        print(
            f"channel {name}: {already}paused; dispatch holds (intake goes on) until "
            f"`hl7-agent channel resume {name}` [{backlog}]"
        )
    else:
        already = "" if was_paused or keys else "already "
        freed = f"; {keys} paused key{'s' if keys != 1 else ''} resumed" if keys else ""
        print(f"channel {name}: {already}resumed{freed}; dispatch goes on [{backlog}]")
    return EXIT_OK
