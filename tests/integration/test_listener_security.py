"""Channel security keys work for real, never silently ignored (SPEC 3): MLLP over TLS, client certificates, allowed_sources."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import pytest
from agenttest import ack_code, db_rows, err3, exchange, hl7_message, make_test_pki, run_with_agent
from structlog.testing import capture_logs

from agent.app.config import ChannelSettings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    return make_test_pki(tmp_path_factory.mktemp("pki"))


def client_tls(pki: Path, *, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if with_cert:
        context.load_cert_chain(pki / "client.pem", pki / "client.key")
    return context


class TestTlsChannel:
    def test_mllp_over_tls(self, tmp_path: Path, pki: Path) -> None:
        """tls_cert/tls_key: the sender verifies our certificate and gets AA over TLS; plain TCP gets nothing."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", tls_cert=pki / "server.pem",
                                  tls_key=pki / "server.key")

        async def scenario(port: int) -> None:
            ack = await exchange(port, hl7_message("TLS1"), tls=client_tls(pki, with_cert=False))
            assert ack_code(ack) == "AA"
            with pytest.raises((ConnectionError, OSError, TimeoutError)):
                await exchange(port, hl7_message("PLAIN"))

        run_with_agent(tmp_path, channel, scenario)

    def test_client_certificate_required(self, tmp_path: Path, pki: Path) -> None:
        """tls_client_ca: a sender without a client certificate is refused; with one it gets AA."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", tls_cert=pki / "server.pem",
                                  tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem")

        async def scenario(port: int) -> None:
            with pytest.raises((ConnectionError, OSError, ssl.SSLError)):
                await exchange(port, hl7_message("NOCERT"), tls=client_tls(pki, with_cert=False))
            ack = await exchange(port, hl7_message("CERT"), tls=client_tls(pki, with_cert=True))
            assert ack_code(ack) == "AA"

        run_with_agent(tmp_path, channel, scenario)


class TestAllowedSources:
    def test_sender_outside_allowed_sources_is_closed_unanswered(self, tmp_path: Path) -> None:
        """A peer outside allowed_sources is closed without an ACK; nothing is stored."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", allowed_sources=["10.0.0.0/8"])

        async def scenario(port: int) -> None:
            with pytest.raises(ConnectionError):
                await exchange(port, hl7_message("DENIED"))

        run_with_agent(tmp_path, channel, scenario)

    def test_sender_inside_allowed_sources_is_served(self, tmp_path: Path) -> None:
        """127.0.0.0/8 in allowed_sources lets a loopback sender through."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", allowed_sources=["127.0.0.0/8"])

        async def scenario(port: int) -> None:
            assert ack_code(await exchange(port, hl7_message("ALLOWED"))) == "AA"

        run_with_agent(tmp_path, channel, scenario)


    def test_refusals_of_one_source_are_logged_once_a_minute_with_a_count(self, tmp_path: Path) -> None:
        """A scan or a misconfigured sender retrying must not fill the log: one line, then counted."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", allowed_sources=["10.0.0.0/8"])

        async def scenario(port: int) -> None:
            for _ in range(5):
                with pytest.raises(ConnectionError):
                    await exchange(port, hl7_message("DENIED"))

        with capture_logs() as logs:
            run_with_agent(tmp_path, channel, scenario)
        refused = [e for e in logs if e["event"] == "connection_refused_source"]
        assert len(refused) == 1 and refused[0]["not_logged"] == 0

    def test_an_entry_with_host_bits_works_and_is_warned_about(self, tmp_path: Path) -> None:
        """"127.0.0.1/8" means 127.0.0.0/8 (served), and the start says what it was taken as."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", allowed_sources=["127.0.0.1/8"])

        async def scenario(port: int) -> None:
            assert ack_code(await exchange(port, hl7_message("ALLOWED"))) == "AA"

        with capture_logs() as logs:
            run_with_agent(tmp_path, channel, scenario)
        (warned,) = [e for e in logs if e["event"] == "allowed_source_host_bits"]
        assert warned["written"] == "127.0.0.1/8" and warned["taken_as"] == "127.0.0.0/8"


class TestChannelRestrictions:
    def test_unsupported_event_gets_ar_with_err_201_and_an_audit_row(self, tmp_path: Path) -> None:
        """A restricted channel answers AR (original mode) with ERR-3 201 and keeps the frame as a nacked row only."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", accept_message_types=["ADT^A01"])

        async def scenario(port: int) -> None:
            ack = await exchange(port, hl7_message("OK1"))
            assert ack_code(ack) == "AA"
            refused = await exchange(port, hl7_message("NO1").replace(b"ADT^A01^ADT_A01", b"ADT^A08^ADT_A01"))
            assert ack_code(refused) == "AR"
            assert err3(refused) == "201"

        run_with_agent(tmp_path, channel, scenario)
        states = dict(db_rows(tmp_path / "data" / "queue.db", "SELECT control_id, state FROM messages"))
        assert states == {"OK1": "queued", "NO1": "nacked"}

    def test_enhanced_mode_gets_cr(self, tmp_path: Path) -> None:
        """An enhanced-mode sender gets CR for a processing id the channel does not take (ERR-3 202)."""
        channel = ChannelSettings(name="adt", listen="127.0.0.1:0", accept_processing_ids=["P"])

        async def scenario(port: int) -> None:
            message = hl7_message("T1", msh15="AL").replace(b"|T1|P|", b"|T1|T|")
            refused = await exchange(port, message)
            assert (ack_code(refused), err3(refused)) == ("CR", "202")

        run_with_agent(tmp_path, channel, scenario)
