"""Transmit ids are UUIDv7 (RFC 9562 5.7): version and variant bits, time order, uniqueness."""

from __future__ import annotations

import uuid

import pytest

from agent.core.ids import Uuid7Source, format_uuid, uuid7_int

MS = 1_764_614_400_000  # 2025-12-01T18:40:00Z in Unix milliseconds


class Clock:
    """A settable time_ns."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms * 1_000_000 + 123_456


def fixed_random(n: int) -> bytes:
    return b"\xff" * n


@pytest.mark.parametrize(("unix_ms", "rand_a", "rand_b", "expected"), [
    # RFC 9562 appendix A.6's example fields: 017F22E2-79B0-7CC3-98C4-DC0C0C07398F
    (0x017F22E279B0, 0xCC3, 0x18C4DC0C0C07398F, "017f22e2-79b0-7cc3-98c4-dc0c0c07398f"),
    (0, 0, 0, "00000000-0000-7000-8000-000000000000"),
    # every field at its maximum: the version and variant bits are still 7 and 0b10
    ((1 << 48) - 1, 0xFFF, (1 << 64) - 1, "ffffffff-ffff-7fff-bfff-ffffffffffff"),
])
def test_fields_land_where_rfc_9562_puts_them(unix_ms: int, rand_a: int, rand_b: int, expected: str) -> None:
    value = uuid7_int(unix_ms, rand_a, rand_b)
    assert format_uuid(value) == expected
    parsed = uuid.UUID(expected)
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122
    assert parsed.int >> 80 == unix_ms


def test_format_is_the_standard_text_form() -> None:
    for value in (0, 1, (1 << 128) - 1, 0x0123456789ABCDEF0123456789ABCDEF):
        assert format_uuid(value) == str(uuid.UUID(int=value))


def test_ids_carry_the_clock_and_are_version_7() -> None:
    clock = Clock(MS)
    make = Uuid7Source(clock_ns=clock)
    ids = [uuid.UUID(make()) for _ in range(3)]
    assert {(u.version, u.variant) for u in ids} == {(7, uuid.RFC_4122)}
    assert {u.int >> 80 for u in ids} == {MS}


def test_order_within_a_millisecond_across_ms_and_when_the_clock_steps_back() -> None:
    clock = Clock(MS)
    make = Uuid7Source(clock_ns=clock)
    ids = [make() for _ in range(5)]
    clock.ms += 1
    ids += [make() for _ in range(5)]
    clock.ms -= 1000  # NTP stepped the clock back a second: ids must not go back
    ids += [make() for _ in range(5)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_a_full_counter_borrows_the_next_millisecond() -> None:
    """All-ones randomness seeds the counter at 0x7FF: 2,049 ids fill it, then the time moves on."""
    clock = Clock(MS)
    make = Uuid7Source(clock_ns=clock, random=fixed_random)
    ids = [make() for _ in range(2049 + 3)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    stamps = [uuid.UUID(i).int >> 80 for i in ids]
    assert stamps[2048] == MS and stamps[2049] == MS + 1
    assert (uuid.UUID(ids[2048]).int >> 64) & 0xFFF == 0xFFF


def test_unique_and_ordered_over_100k_real_ids() -> None:
    make = Uuid7Source()
    ids = [make() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(uuid.UUID(i).version == 7 for i in ids[::997])
