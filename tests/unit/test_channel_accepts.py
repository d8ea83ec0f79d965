"""Channels that restrict what they take: HL7 table 0357 codes 200-203 (answered AR/CR)."""

from __future__ import annotations

import pytest

from agent.core.envelope import read_msh
from agent.core.intake_policy import unsupported_reason


def env(msh9: str = "ADT^A01", processing: str = "P", version: str = "2.5.1"):  # noqa: ANN201
    return read_msh(f"MSH|^~\\&|A|B|C|D|20260101||{msh9}|C1|{processing}|{version}\r".encode())


class TestUnsupportedReason:
    def test_no_restriction_accepts_everything(self) -> None:
        """Empty lists restrict nothing."""
        assert unsupported_reason(env()) is None

    @pytest.mark.parametrize(
        ("allowed", "msh9", "expected"),
        [
            (["ADT"], "ADT^A08", None),
            (["ADT^A01"], "ADT^A01", None),
            (["ADT^A01"], "ADT^A08", 201),
            (["ORU"], "ADT^A01", 200),
            (["ORU", "ADT^A01"], "ORU^R01", None),
        ],
    )
    def test_message_types(self, allowed: list[str], msh9: str, expected: int | None) -> None:
        """A code not listed is 200; a listed code with an unlisted event is 201."""
        reason = unsupported_reason(env(msh9), message_types=allowed)
        assert (reason[0] if reason else None) == expected

    def test_processing_id(self) -> None:
        """MSH-11.1 outside accept_processing_ids is 202 (a T message on a production channel)."""
        assert unsupported_reason(env(processing="T"), processing_ids=["P"])[0] == 202  # type: ignore[index]
        assert unsupported_reason(env(processing="P^T"), processing_ids=["P"]) is None

    @pytest.mark.parametrize(("version", "expected"), [("2.5.1", None), ("2.5", None), ("2.3", 203), ("2.51", 203)])
    def test_versions(self, version: str, expected: int | None) -> None:
        """accept_versions "2.5" admits 2.5 and 2.5.x, nothing else (203)."""
        reason = unsupported_reason(env(version=version), versions=["2.5"])
        assert (reason[0] if reason else None) == expected
