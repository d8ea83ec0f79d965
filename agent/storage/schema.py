"""The schema rules every backend follows: versions, additive migrations, the owner.

docs/queue.md#schema-versions-and-upgrades: a database records ``schema_version`` and
``min_compatible_version`` in its ``meta`` table; migrations are additive
(new tables, new nullable columns, explicit column lists everywhere), so the
previous agent version keeps working on a migrated database; a process
refuses a database whose ``min_compatible_version`` is above its own schema,
and one created by another ``agent.id``. The database also gets a
``queue_id`` once, for the server's lease-epoch fence, and a
``key_hash_secret`` once, which keys the hashes that stand for partition
keys wherever their values must not show (agent.core.partition.key_hash).

The caller runs :func:`migrate_meta` inside its dialect's write transaction
(SQLite's ``BEGIN IMMEDIATE``; PostgreSQL's ``BEGIN`` plus the agent's
advisory lock), so several processes starting at once migrate once.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from typing import Any

from agent.errors import IncompatibleDatabase

__all__ = ["migrate_meta", "read_meta"]


#: The meta key of the secret that keys partition-key hashes (never shown: it is in the database only).
KEY_HASH_SECRET = "key_hash_secret"  # noqa: S105 - the name of the meta row, not a secret


def read_meta(conn: Any, queries: dict[str, str]) -> dict[str, str]:  # noqa: ANN401 - a connection
    """The ``meta`` table as a dict; empty when there is none (not a queue database)."""
    if not conn.execute(queries["meta_table_exists"]).fetchone():
        return {}
    return {str(k): str(v) for k, v in conn.execute(queries["meta_all"])}


def migrate_meta(
    conn: Any,  # noqa: ANN401 - the dialect's connection, inside its write transaction
    queries: dict[str, str],
    migrations: list[tuple[int, str]],
    run_script: Callable[[str], None],
    *,
    agent_id: str,
    now: float,
    schema_version: int,
    min_compatible_version: int,
) -> int:
    """Check the database may be ours, run the migrations it lacks, record versions and owner.

    Returns the database's schema version afterwards.
    """
    meta = read_meta(conn, queries)
    version = int(meta.get("schema_version", "0"))
    min_compatible = int(meta.get("min_compatible_version", "0"))
    if min_compatible > schema_version:
        raise IncompatibleDatabase(
            f"the queue database needs agent schema >= {min_compatible}, this agent has "
            f"{schema_version}: upgrade hl7-agent or use another data_dir"
        )
    owner = meta.get("agent_id")
    if owner is not None and owner != agent_id:
        raise IncompatibleDatabase(
            f"the queue database belongs to agent.id {owner!r}, not {agent_id!r}: two agents "
            "must never share a queue; fix agent.id or data_dir"
        )
    for number, sql in migrations:
        if number > version:
            run_script(sql)
            version = number
    if version > int(meta.get("schema_version", "0")):
        conn.execute(queries["meta_upsert"], {"key": "schema_version", "value": str(version)})
        conn.execute(queries["meta_upsert"], {"key": "min_compatible_version",
                                              "value": str(max(min_compatible, min_compatible_version))})
    if owner is None:
        conn.execute(queries["meta_insert"], {"key": "agent_id", "value": agent_id})
        conn.execute(queries["meta_insert"], {"key": "created_at", "value": repr(now)})
    if "queue_id" not in meta:
        # The queue's identity for the server's lease-epoch fence: made once,
        # never changed. A new meta key only, so an older agent keeps working
        # on the database; one made by an older agent gets its id on first open by us.
        conn.execute(queries["meta_insert_if_absent"], {"key": "queue_id", "value": str(uuid.uuid4())})
    if KEY_HASH_SECRET not in meta:
        # The same way: every process and host on this database names a key alike.
        conn.execute(queries["meta_insert_if_absent"], {"key": KEY_HASH_SECRET, "value": secrets.token_hex(16)})
    return version
