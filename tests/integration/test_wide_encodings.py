"""UTF-16/32 is forbidden by HL7 over MLLP: such frames are rejected with an ACK, never silently dropped (docs/acks.md#character-sets)."""

from __future__ import annotations

from pathlib import Path

import pytest
from agenttest import ack_code, db_rows, err3, exchange, hl7_message, msa2, run_with_agent

from agent.app.config import ChannelSettings
from agent.core.charsets import sniff_wide_encoding
from agent.core.envelope import read_wide_msh


class TestSniff:
    @pytest.mark.parametrize(
        ("codec", "expected"),
        [("utf-16-le", "utf-16-le"), ("utf-16-be", "utf-16-be"), ("utf-16", "utf-16"),
         ("utf-32-le", "utf-32-le"), ("utf-32", "utf-32")],
    )
    def test_wide_msh_is_recognised(self, codec: str, expected: str) -> None:
        """A frame starting with a BOM or a wide "MSH" names its codec; its MSH-10 can be read."""
        data = hl7_message("W1").decode().encode(codec)
        assert sniff_wide_encoding(data) == expected
        env = read_wide_msh(data, expected)
        assert env is not None and env.control_id == "W1"

    def test_ascii_is_not_wide(self) -> None:
        """An ordinary frame, and a frame of junk, are not taken for UTF-16."""
        assert sniff_wide_encoding(hl7_message("A1")) is None
        assert sniff_wide_encoding(b"hello") is None


class TestListener:
    @pytest.mark.parametrize("codec", ["utf-16-le", "utf-16"])
    def test_utf16_frame_gets_ae_102_with_its_control_id(self, tmp_path: Path, codec: str) -> None:
        """A whole message in UTF-16 gets AE with ERR-3 102 and MSA-2 = its MSH-10; it is kept only as an audit row."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0")

        async def scenario(port: int) -> None:
            ack = await exchange(port, hl7_message("WIDE-1").decode().encode(codec))
            assert (ack_code(ack), err3(ack), msa2(ack)) == ("AE", "102", "WIDE-1")
            assert ack_code(await exchange(port, hl7_message("NARROW-1"))) == "AA"

        run_with_agent(tmp_path, channel, scenario)
        rows = dict(db_rows(tmp_path / "data" / "queue.db", "SELECT control_id, state FROM messages"))
        assert rows == {"WIDE-1": "nacked", "NARROW-1": "queued"}
