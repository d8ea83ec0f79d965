"""MLLP over TLS end to end: ``hl7-agent send --tls`` against a real TLS channel, and the
daemon's log of failed handshakes (once per source per minute, with a count, no bodies).

Certificates are made per module by ``make_test_pki`` (the openssl CLI): a CA, a server
certificate for IP 127.0.0.1 and a client certificate.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agenttest import exchange, free_port, hl7_message, log_events, make_test_pki, run_with_agent
from structlog.testing import capture_logs

from agent.app.config import ChannelSettings
from agent.runtime.tls import HandshakeFailures

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "adt_a01_v23_cr.hl7"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    return make_test_pki(tmp_path_factory.mktemp("pki"))


def tls_channel(pki: Path, *, client_ca: bool = False) -> ChannelSettings:
    return ChannelSettings(name="adt", listen="127.0.0.1:0", tls_cert=pki / "server.pem",
                           tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem" if client_ca else None)


async def send(*args: str) -> tuple[int, str, str]:
    """``hl7-agent send ARGS SAMPLE`` as a subprocess; (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
    # An empty trust store for "the system store": the test CA is surely not in it.
    env["SSL_CERT_FILE"] = os.devnull
    env.pop("SSL_CERT_DIR", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "send", "--timeout", "10", *args, str(SAMPLE),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class TestSendTls:
    def test_verified_server_gets_the_message(self, tmp_path: Path, pki: Path) -> None:
        """--tls --ca: the server's certificate is verified for --host and the sender gets AA."""

        async def scenario(port: int) -> None:
            code, out, err = await send("--host", "127.0.0.1", "--port", str(port), "--tls",
                                        "--ca", str(pki / "ca.pem"))
            assert code == 0, err
            assert "MSA|AA|MSG00001" in out

        run_with_agent(tmp_path, tls_channel(pki), scenario)

    def test_untrusted_or_misnamed_server_is_refused(self, tmp_path: Path, pki: Path) -> None:
        """Without --ca the system store does not know the CA; --host localhost is not the
        certificate's name (IP 127.0.0.1): both exit 1 with one line, nothing sent."""

        async def scenario(port: int) -> None:
            code, out, err = await send("--host", "127.0.0.1", "--port", str(port), "--tls")
            assert (code, out) == (1, "")
            assert err.startswith(f"hl7-agent: send: TLS handshake with 127.0.0.1:{port} failed: "
                                  "certificate verify failed")
            code, out, err = await send("--host", "localhost", "--port", str(port), "--tls",
                                        "--ca", str(pki / "ca.pem"))
            assert (code, out) == (1, "")
            assert "certificate verify failed" in err and "localhost" in err

        run_with_agent(tmp_path, tls_channel(pki), scenario)

    def test_client_certificate(self, tmp_path: Path, pki: Path) -> None:
        """A channel with tls_client_ca takes --cert/--key and refuses a sender without them."""

        async def scenario(port: int) -> None:
            base = ("--host", "127.0.0.1", "--port", str(port), "--tls", "--ca", str(pki / "ca.pem"))
            code, out, err = await send(*base, "--cert", str(pki / "client.pem"),
                                        "--key", str(pki / "client.key"))
            assert code == 0, err
            assert "MSA|AA|MSG00001" in out
            code, out, err = await send(*base)
            assert code == 1
            assert "MSA|AA" not in out

        run_with_agent(tmp_path, tls_channel(pki, client_ca=True), scenario)

    def test_tls_options_need_tls(self, tmp_path: Path, pki: Path) -> None:
        """--ca without --tls, --key without --cert, or a TLS file that does not load: a usage error (exit 2)."""

        async def scenario(port: int) -> None:
            code, _out, err = await send("--port", str(port), "--ca", str(pki / "ca.pem"))
            assert code == 2 and "need --tls" in err
            code, _out, err = await send("--port", str(port), "--tls", "--key", str(pki / "client.key"))
            assert code == 2 and "--key needs --cert" in err
            # A file named on the command line that does not load: a usage error too, with its path.
            code, _out, err = await send("--port", str(port), "--tls", "--ca", str(tmp_path / "nope.pem"))
            assert code == 2 and f"send: --ca: cannot read {tmp_path / 'nope.pem'}: No such file" in err, err
            code, _out, err = await send("--port", str(port), "--tls", "--ca", str(pki / "ca.pem"),
                                         "--cert", str(pki / "client.pem"), "--key", str(pki / "server.key"))
            assert code == 2 and "send: --key: the private key" in err and "does not belong" in err, err

        run_with_agent(tmp_path, tls_channel(pki), scenario)


class TestHandshakeFailuresLogged:
    def test_plain_mllp_on_a_tls_channel(self, tmp_path: Path, pki: Path) -> None:
        """A plain sender is logged once per minute per source, with the reason, no body; later
        failures of that source are counted, not logged; a TLS sender is still served."""
        with capture_logs() as logs:

            async def scenario(port: int) -> None:
                for _ in range(3):
                    with pytest.raises((ConnectionError, OSError, TimeoutError)):
                        await exchange(port, hl7_message("PLAIN1", pid="SECRET-PID"))
                context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
                assert b"MSA|AA|TLS1" in await exchange(port, hl7_message("TLS1"), tls=context)

            run_with_agent(tmp_path, tls_channel(pki), scenario)
        (failed,) = log_events(logs, "tls_handshake_failed")
        assert failed["log_level"] == "warning"
        assert failed["channel"] == "adt"
        assert failed["peer"].startswith("127.0.0.1:")
        assert "does not speak TLS" in failed["reason"]
        assert failed["not_logged"] == 0
        text = repr(logs)
        assert "SECRET-PID" not in text and "PLAIN1" not in text

    def test_missing_client_certificate_is_named(self, tmp_path: Path, pki: Path) -> None:
        """A sender without a certificate on a tls_client_ca channel: the reason says so."""
        with capture_logs() as logs:

            async def scenario(port: int) -> None:
                context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
                with pytest.raises((ConnectionError, OSError, ssl.SSLError)):
                    await exchange(port, hl7_message("NOCERT"), tls=context)

            run_with_agent(tmp_path, tls_channel(pki, client_ca=True), scenario)
        (failed,) = log_events(logs, "tls_handshake_failed")
        assert "certificate" in failed["reason"], failed

    def test_refused_source_gets_no_handshake(self, tmp_path: Path, pki: Path) -> None:
        """A peer outside allowed_sources is closed before any TLS: no handshake failure logged."""
        channel = tls_channel(pki).model_copy(update={"allowed_sources": ["10.0.0.0/8"]})
        with capture_logs() as logs:

            async def scenario(port: int) -> None:
                with pytest.raises((ConnectionError, OSError)):
                    await exchange(port, hl7_message("DENIED"))

            run_with_agent(tmp_path, channel, scenario)
        assert log_events(logs, "connection_refused_source")
        assert not log_events(logs, "tls_handshake_failed")


class TestHandshakeAdmission:
    def test_connections_that_never_finish_a_handshake_cannot_hold_the_channel(
            self, tmp_path: Path, pki: Path) -> None:
        """20 connections from one source that never send a ClientHello (max_connections 4, 2 per
        source): all but two are crowded out at once, those two closed at frame_timeout, and a
        sender from another address is served meanwhile. Before: all 20 held for 60 s."""
        channel = tls_channel(pki).model_copy(update={
            "max_connections": 4, "max_connections_per_source": 2, "frame_timeout": 3.0})
        with capture_logs() as logs:

            async def scenario(port: int) -> float:
                silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
                started = asyncio.get_running_loop().time()
                context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=context, local_addr=("127.0.0.2", 0))
                writer.write(b"\x0b" + hl7_message("OTHER") + b"\x1c\r")
                async with asyncio.timeout(10):
                    assert b"MSA|AA|OTHER" in await reader.readuntil(b"\x1c\r")
                writer.close()
                async with asyncio.timeout(3.0 + 5):  # frame_timeout, and slack for a loaded machine
                    for silent_reader, silent_writer in silent:
                        assert await silent_reader.read(100) == b""
                        silent_writer.close()
                return asyncio.get_running_loop().time() - started

            took = run_with_agent(tmp_path, channel, scenario)
        assert took >= 2.5, "the last two should have had their frame_timeout"
        crowded = [e for e in log_events(logs, "tls_handshake_failed") if "needed its place" in e["reason"]]
        assert crowded and crowded[0]["peer"].startswith("127.0.0.1:")


class TestTrustedCas:
    def test_a_configured_ca_is_the_only_one_trusted(self, tmp_path: Path, pki: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
        """tls_server_ca, server.ca_file and send --ca each trust that bundle alone, never the
        system's store beside it (a certificate of any public CA would pass). The system store is
        a decoy CA here, through SSL_CERT_FILE, which OpenSSL reads for its default paths."""
        from agent.app.client import ClientTls
        from agent.runtime.outbound import build_client_ssl
        from agent.runtime.upstream import upstream_ssl_context

        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-keyout", str(tmp_path / "decoy.key"), "-out", str(tmp_path / "decoy.pem"),
                        "-days", "1", "-subj", "/CN=decoy public CA"], check=True, capture_output=True, timeout=30)
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "decoy.pem"))
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        channel = ChannelSettings(name="lab", connect="127.0.0.1:1", tls_server_ca=pki / "ca.pem")
        contexts = {
            "tls_server_ca": build_client_ssl(channel),
            "ca_file": upstream_ssl_context("wss://127.0.0.1/agent", pki / "ca.pem", None, None),
            "--ca": ClientTls(ca=str(pki / "ca.pem")).context(),
        }
        for name, context in contexts.items():
            assert context is not None
            subjects = [dict(item[0] for item in c["subject"]).get("commonName") for c in context.get_ca_certs()]
            assert "decoy public CA" not in subjects and len(subjects) == 1, (name, subjects)
        # Without one, the system's store is what verifies (the decoy here).
        default = upstream_ssl_context("wss://127.0.0.1/agent", None, None, None)
        assert default is not None and len(default.get_ca_certs()) == 1


class _Log:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


class TestRateLimit:
    def test_once_per_source_per_minute_with_a_count(self) -> None:
        """The second minute's first failure carries the count of those not logged in the first."""
        now = [1000.0]
        log = _Log()
        failures = HandshakeFailures(log, clock=lambda: now[0])
        error = ConnectionResetError()
        assert failures.failed("10.0.0.1", "10.0.0.1:5000", error)
        for _ in range(4):
            now[0] += 10
            assert not failures.failed("10.0.0.1", "10.0.0.1:5001", error)
        assert failures.failed("10.0.0.2", "10.0.0.2:6000", error), "another source is its own"
        now[0] += 25
        assert failures.failed("10.0.0.1", "10.0.0.1:5002", error)
        assert [(line["peer"], line["not_logged"]) for line in log.lines] == [
            ("10.0.0.1:5000", 0), ("10.0.0.2:6000", 0), ("10.0.0.1:5002", 4)]
        assert log.lines[0]["reason"] == "connection closed during the handshake"


class TestTlsFilesLoadBeforeStart:
    """A certificate whose key does not match loads only when its context is built: check-config and run build them first."""

    @staticmethod
    def _cli(tmp_path: Path, config: str, *args: str) -> tuple[int, str]:
        path = tmp_path / "agent.toml"
        path.write_text(config, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HL7_AGENT_")}
        done = subprocess.run([sys.executable, "-m", "agent", *args, "--config", str(path)], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        return done.returncode, done.stderr

    def test_a_channel_certificate_with_another_key(self, tmp_path: Path, pki: Path) -> None:
        config = (f'[agent]\ndata_dir = "{tmp_path / "data"}"\n[admin]\nlisten = ""\n'
                  f'[[channels]]\nname = "adt"\nlisten = "127.0.0.1:{free_port()}"\n'
                  f'tls_cert = "{pki / "server.pem"}"\ntls_key = "{pki / "client.key"}"\n')
        code, err = self._cli(tmp_path, config, "check-config")
        assert code == 2, err
        assert "channels[0].tls_key: cannot load the TLS files of channel 'adt'" in err
        assert f"the private key {pki / 'client.key'} does not belong to the certificate" in err
        assert "Traceback" not in err

    def test_a_key_that_needs_a_passphrase_is_refused_without_prompting(self, tmp_path: Path, pki: Path) -> None:
        """A daemon cannot type a passphrase: one line naming tls_key and the fix, never a prompt
        (on a terminal OpenSSL would ask and block; here stdin is closed, and a prompt would fail
        with another message)."""
        encrypted = tmp_path / "encrypted.key"
        subprocess.run(["openssl", "pkey", "-in", str(pki / "server.key"), "-aes256", "-passout", "pass:x",
                        "-out", str(encrypted)], check=True, capture_output=True, timeout=30)
        config = (f'[agent]\ndata_dir = "{tmp_path / "data"}"\n[admin]\nlisten = ""\n'
                  f'[[channels]]\nname = "adt"\nlisten = "127.0.0.1:{free_port()}"\n'
                  f'tls_cert = "{pki / "server.pem"}"\ntls_key = "{encrypted}"\n')
        for command in ("check-config", "run"):
            code, err = self._cli(tmp_path, config, command)
            assert code == 2, err
            assert f"channels[0].tls_key: cannot load the TLS files of channel 'adt': the private key {encrypted} " \
                   "is encrypted with a passphrase" in err, err

    def test_a_key_anyone_can_read_and_a_certificate_about_to_expire_are_warned_about(
            self, tmp_path: Path) -> None:
        """Neither stops a start, both should be fixed: check-config says so on stderr (and run logs
        config_warning); an expired certificate is named as such, whose it is."""
        from agent.app.config import load_settings
        from agent.app.preflight import file_warnings

        cert, key = tmp_path / "short.pem", tmp_path / "short.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
        os.chmod(key, 0o644)
        config = (f'[agent]\ndata_dir = "{tmp_path / "data"}"\n[admin]\nlisten = ""\n'
                  f'[[channels]]\nname = "adt"\nlisten = "127.0.0.1:{free_port()}"\n'
                  f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
        code, err = self._cli(tmp_path, config, "check-config")
        assert code == 0, err
        assert f"warning: channels[0].tls_key: {key} is readable by every user of this host (mode 0644)" in err
        assert f"warning: channels[0].tls_cert: the certificate {cert} expires on " in err
        settings = load_settings(str(tmp_path / "agent.toml"), {})
        later = [words for k, words in file_warnings(settings, time.time() + 3 * 86400) if k.endswith("tls_cert")]
        assert later and "expired on" in later[0] and "every TLS handshake with it fails" in later[0]

    def test_upstream_client_files_that_do_not_load(self, tmp_path: Path, pki: Path) -> None:
        """check-config and run exit 2 (a configuration error), run before it starts, rather than
        starting and failing every connect; the message names the file at fault."""
        config = (f'[agent]\ndata_dir = "{tmp_path / "data"}"\n[admin]\nlisten = ""\n'
                  f'[server]\nurl = "wss://127.0.0.1:9/agent"\n'
                  f'client_cert = "{pki / "client.pem"}"\nclient_key = "{pki / "server.key"}"\n'
                  f'[[channels]]\nname = "adt"\nlisten = "127.0.0.1:{free_port()}"\n')
        code, err = self._cli(tmp_path, config, "check-config")
        assert code == 2 and "server.client_key: cannot load the TLS files" in err, err
        code, err = self._cli(tmp_path, config, "run")
        assert code == 2 and "server.client_key: cannot load the TLS files" in err, err
        ca_is_a_key = config.replace(f'client_cert = "{pki / "client.pem"}"\nclient_key = "{pki / "server.key"}"\n',
                                     f'ca_file = "{pki / "ca.key"}"\n')
        code, err = self._cli(tmp_path, ca_is_a_key, "check-config")
        assert code == 2 and "server.ca_file: cannot load the TLS files" in err, err
