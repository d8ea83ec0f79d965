"""Every command line of docs/operations.md (and docs/configuration.md) runs as shown.

The fenced ``sh`` blocks, and the ``$ `` lines of ``console`` blocks, are taken
from the docs and run with bash, in document order, against a real daemon
and its data directory: one channel with a failed row, one with a rejected
row, a delivered message with the control id the recipes look for. Each
line must exit 0. A marker line before a block says what it needs:

- none: the data directory (the daemon runs meanwhile, as the page says it may);
- ``<!-- ops-test: daemon -->``: the running daemon's admin endpoint;
- ``<!-- ops-test: stopped -->``: the daemon stopped (run after the others).

What the test changes in a line, and only that: the example row ids and
prefix become real ones, the admin address and ``/var/lib/hl7-agent`` become
the test's, ``sudo -u hl7-agent`` is dropped (the test user owns the files),
and ``/etc/hl7-agent/agent.toml`` is the test's configuration, which
``$HL7_AGENT_CONFIG`` also names for the lines without ``--config``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agenttest import (
    REPO_ROOT,
    Answer,
    Daemon,
    DevServerThread,
    MllpClient,
    ack_code,
    free_port,
    hl7_message,
    toml_config,
    wait_for,
)

from agent.app.devserver import default_answer

pytestmark = pytest.mark.slow

DOCS = (REPO_ROOT / "docs" / "operations.md", REPO_ROOT / "docs" / "configuration.md")
#: The ids the docs use as examples: replaced by the failed and the rejected row's ids,
#: and (for ``queue fail``, which takes only queued rows) two rows a paused channel holds.
DOC_FAILED_ID = "ccf67946-254e-4048-8a13-daff777ddcf6"
DOC_REJECTED_ID = "0b1d5a52-7c3e-4f0a-9d26-5e8b1c4a7f90"
DOC_QUEUED_IDS = ("5f0e2c1a-9b7d-4c3e-8f21-a6d4b0e9c713", "7a3c9e05-1d2b-4f6e-b8a0-3c5d7e9f1b24")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    kind: str  # "", "daemon", "stopped"
    commands: list[str]
    #: console blocks: the first word the documented output starts with
    output_starts: list[str | None]


def doc_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one page: ``sh`` blocks line by line, ``console`` blocks' ``$`` lines."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = re.match(r"^\s*```(sh|console)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        marker = re.match(r"^\s*<!-- ops-test: (\w+) -->$", lines[index - 1]) if index else None
        start = index + 1
        end = start
        while not lines[end].strip().startswith("```"):
            end += 1
        body = [line.strip() for line in lines[start:end]]
        commands: list[str] = []
        outputs: list[str | None] = []
        if fence.group(1) == "sh":
            commands = [line for line in body if line and not line.startswith("#")]
            outputs = [None] * len(commands)
        else:
            for offset, line in enumerate(body):
                if line.startswith("$ "):
                    commands.append(line[2:])
                    following = body[offset + 1] if offset + 1 < len(body) else ""
                    outputs.append(None if following.startswith("$") or not following
                                   else following.split()[0])
        blocks.append(Block(path.name, start, marker.group(1) if marker else "", commands, outputs))
        index = end + 1
    return blocks


def _failing_server(t: Any) -> Answer:
    """503 for FAIL* control ids (transient: max_attempts makes them failed), 422 for REJ*."""
    if t.control_id.startswith("FAIL"):
        return Answer(503)
    if t.control_id.startswith("REJ"):
        return Answer(422, default_answer(t).ack)
    return default_answer(t)


async def _decide(t: Any) -> Answer:
    return _failing_server(t)


def _queue_json(env: dict[str, str], *args: str) -> Any:
    proc = subprocess.run([sys.executable, "-m", "agent", "queue", *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _row_id(env: dict[str, str], state: str, channel: str) -> str | None:
    rows = _queue_json(env, "list", "--state", state, "--channel", channel)
    return rows[0]["id"] if rows else None


def test_every_documented_command_runs(tmp_path: Path) -> None:
    """Each command of the operations page exits 0 when run as shown against a real queue."""
    blocks = [b for path in DOCS for b in doc_blocks(path)]
    assert sum(len(b.commands) for b in blocks) >= 20, "the docs' blocks were not found"
    server = DevServerThread(decide=_decide).start()
    admin_port, adt_port, lab_port, held_port = free_port(), free_port(), free_port(), free_port()
    data = tmp_path / "data"
    config = toml_config(
        data,
        [{"name": "adt", "listen": f"127.0.0.1:{adt_port}", "max_attempts": 1},
         {"name": "lab", "listen": f"127.0.0.1:{lab_port}", "max_attempts": 1},
         {"name": "held", "listen": f"127.0.0.1:{held_port}"}],
        server_url=server.url, admin_port=admin_port,
    )
    daemon = Daemon(tmp_path, config)
    env = {**daemon.env, "HL7_AGENT_CONFIG": str(daemon.config),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        daemon.start().wait_started()
        # A paused channel keeps its rows queued: what `queue fail` sets aside.
        subprocess.run([sys.executable, "-m", "agent", "channel", "pause", "held"], env=env,
                       capture_output=True, timeout=60, check=True)
        with MllpClient(held_port) as held:
            for control_id in ("HELD1", "HELD2"):
                assert ack_code(held.exchange(hl7_message(control_id))) == "AA"
        with MllpClient(adt_port) as adt, MllpClient(lab_port) as lab:
            for client, control_id in ((adt, "FAIL1"), (adt, "MSG00812"), (lab, "REJ1"), (lab, "LAB1")):
                assert ack_code(client.exchange(hl7_message(control_id))) == "AA"
            lab.send_raw(b"\x0bNO MSH HERE\r\x1c\x0d")  # a frame without MSH: a nacked audit row
        wait_for(lambda: _row_id(env, "failed", "adt") and _row_id(env, "rejected", "lab")
                 and _queue_json(env, "stats")["states"]["processed"] == 2
                 and _queue_json(env, "stats")["states"]["nacked"] == 1,
                 30, interval=0.3, what="a failed, a rejected, two processed and a nacked row")
        failed_id, rejected_id = _row_id(env, "failed", "adt"), _row_id(env, "rejected", "lab")
        assert failed_id and rejected_id
        held_rows = sorted(_queue_json(env, "list", "--state", "queued", "--channel", "held"),
                           key=lambda r: r["seq"])
        assert len(held_rows) == 2
        substitutions = [
            *((doc, row["id"]) for doc, row in zip(DOC_QUEUED_IDS, held_rows, strict=True)),
            *((doc[:8], row["id"][:8]) for doc, row in zip(DOC_QUEUED_IDS, held_rows, strict=True)),
            (DOC_FAILED_ID, failed_id), (DOC_REJECTED_ID, rejected_id),
            (DOC_FAILED_ID[:8], failed_id[:8]),
            ("127.0.0.1:9575", f"127.0.0.1:{admin_port}"),
            ("/var/lib/hl7-agent", str(data)),
            ("/etc/hl7-agent/agent.toml", str(daemon.config)),
            ("sudo -u hl7-agent ", ""),
        ]

        def run(block: Block) -> None:
            for command, first_word in zip(block.commands, block.output_starts, strict=True):
                line = command
                for old, new in substitutions:
                    line = line.replace(old, new)
                proc = subprocess.run(["bash", "-o", "pipefail", "-c", line], env=env, cwd=tmp_path,
                                      capture_output=True, text=True, timeout=60, check=False)
                where = f"{block.doc} line {block.line}: {command}"
                assert proc.returncode == 0, f"{where}\nexit {proc.returncode}\n{proc.stderr}{proc.stdout}"
                if first_word is not None:
                    for old, new in substitutions:
                        first_word = first_word.replace(old, new)
                    assert proc.stdout.split()[:1] == [first_word], f"{where}\n{proc.stdout}"

        ran = 0
        for block in blocks:
            if block.kind in ("", "daemon"):
                run(block)
                ran += len(block.commands)
        assert daemon.stop() == 0, daemon.log_tail()
        for block in blocks:
            if block.kind == "stopped":
                run(block)
                ran += len(block.commands)
        assert {b.kind for b in blocks} <= {"", "daemon", "stopped"}
        assert ran == sum(len(b.commands) for b in blocks)
    finally:
        daemon.kill()
        server.stop()


class TestBlockReader:
    def test_reads_markers_and_console_lines(self, tmp_path: Path) -> None:
        """The reader finds sh lines, console commands with their output's first word, and markers."""
        page = tmp_path / "page.md"
        page.write_text("text\n\n<!-- ops-test: daemon -->\n```sh\n# a comment\nhl7-agent health\n```\n\n"
                        "```console\n$ hl7-agent queue stats\ndatabase  /x\n```\n\n```text\nnot run\n```\n")
        first, second = doc_blocks(page)
        assert (first.kind, first.commands) == ("daemon", ["hl7-agent health"])
        assert (second.kind, second.commands, second.output_starts) == ("", ["hl7-agent queue stats"],
                                                                         ["database"])
