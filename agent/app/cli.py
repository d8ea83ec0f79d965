"""The ``hl7-agent`` command line (docs/operations.md).

Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error. Errors
are one line on stderr; ``--debug`` adds the traceback. Global flags
(``--config``, ``--debug``) work before or after the subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from agent import __version__
from agent.core.states import ALL, REDRIVABLE
from agent.errors import AgentError, ConfigError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, when it has one worth saying.

    Like argparse's ArgumentDefaultsHelpFormatter, without "(default: None)"
    and "(default: False)" for options that are simply off unless given.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("%(default)" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors already; keep its one-line style. Help shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 - argparse's signature
        kwargs.setdefault("formatter_class", _HelpFormatter)
        # No abbreviations: "dev-server --token SECRET" would be read as
        # --token-file SECRET and the secret echoed in the error.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # noqa: ANN401 - argparse's signature
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _port(text: str) -> int:
    """A TCP port for --port: 1-65535 (a usage error, exit 2, otherwise)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return int(text)


def _seconds(text: str) -> float:
    """A positive, finite number of seconds for --timeout (a usage error, exit 2, otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (more than 0, at most 86400)")
    return value


def _global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # SUPPRESS on subparsers so a flag given before the subcommand is not reset.
    default: Any = None if top else argparse.SUPPRESS
    parser.add_argument("--config", metavar="PATH", default=default,
                        help="configuration file (else $HL7_AGENT_CONFIG, else /etc/hl7-agent/agent.toml)")
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show tracebacks and debug logs")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hl7-agent", description="Durable HL7 v2 MLLP edge agent.")
    parser.add_argument("--version", action="version", version=f"hl7-agent {__version__}",
                        help="print the version and exit")
    _global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        _global_flags(p, top=False)
        return p

    command("run", "run the daemon in the foreground until SIGTERM/SIGINT")
    command("check-config", "validate and print the effective configuration (secrets masked)")
    command("health", "exit 0 when the daemon's admin endpoint answers /healthz, else 1")

    send = command("send", "send HL7 files over MLLP and print each ACK")
    send.add_argument("--host", default="127.0.0.1", help="the MLLP listener's host")
    send.add_argument("--port", type=_port, required=True, help="the MLLP listener's TCP port")
    send.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for each ACK")
    send.add_argument("--tls", action="store_true",
                      help="MLLP over TLS; the server's certificate must name --host")
    send.add_argument("--ca", metavar="FILE", help="CA bundle (PEM) to verify the server "
                      "(default: the system's trust store); needs --tls")
    send.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for a channel "
                      "that requires one; needs --tls")
    send.add_argument("--key", metavar="FILE", help="private key of --cert (default: in the --cert file)")
    send.add_argument("files", nargs="+", metavar="FILE",
                      help="files of one or more messages (one message per MSH), or MLLP-framed")

    dev = command("dev-server", "run the reference upstream server (protocol v1)")
    dev.add_argument("--host", default="127.0.0.1", help="address to listen on")
    dev.add_argument("--port", type=_port, default=8080, help="TCP port to listen on")
    dev.add_argument("--token-file", default=None, help="file holding the expected bearer token "
                     "(else $HL7_AGENT_DEV_TOKEN; neither: every agent is let in)")
    dev.add_argument("--no-replay", action="store_true", help="announce replay: false")
    dev.add_argument("--store", default=None, metavar="FILE", help="append every transmit as a JSON line")

    queue = command("queue", "inspect and operate the message queue")
    qsub = queue.add_subparsers(dest="queue_command", metavar="SUBCOMMAND", parser_class=_Parser)
    qsub.required = True

    def qcommand(name: str, help_: str) -> argparse.ArgumentParser:
        p = qsub.add_parser(name, help=help_, description=help_)
        _global_flags(p, top=False)
        return p

    id_help = "a row id, or a unique prefix of it (at least 8 characters)"
    states = ", ".join(ALL)

    stats = qcommand("stats", "counts by state, per-channel depth, lease holder")
    stats.add_argument("--json", action="store_true",
                       help="print one JSON object (docs/queue-stats.schema.json)")

    lst = qcommand("list", "rows, newest first (no bodies unless --show-body)")
    lst.add_argument("--state", help=f"only rows in this state ({states})")
    lst.add_argument("--channel", help="only rows of this channel")
    lst.add_argument("--since", metavar="DURATION|TIME",
                     help="only rows received in the last DURATION (30m, 2h, 7d) or since an "
                          "RFC 3339 time with its offset")
    lst.add_argument("--control-id", help="only rows with this MSH-10")
    lst.add_argument("--limit", type=int, default=50, metavar="N", help="at most N rows; 0 means all")
    lst.add_argument("--show-body", action="store_true",
                     help="add each message's text (patient data)")
    lst.add_argument("--json", action="store_true",
                     help="print a JSON array (docs/queue-list.schema.json) instead of a table")

    show = qcommand("show", "one row with its history fields")
    show.add_argument("id", metavar="ID", help=id_help)
    show.add_argument("--raw", action="store_true",
                      help="print the stored message (patient data): the exact bytes when "
                           "redirected, a segment per line on a terminal")
    show.add_argument("--json", action="store_true",
                      help="print one JSON object (docs/queue-show.schema.json)")

    retry = qcommand("retry", "put failed/rejected rows back to queued (keeps each id)")
    retry.add_argument("ids", nargs="*", metavar="ID", help=f"rows to re-drive: {id_help}")
    retry.add_argument("--state", choices=[s.value for s in REDRIVABLE],
                       help="every row in this state instead of ids")
    retry.add_argument("--channel", help="with --state: only rows of this channel")
    retry.add_argument("--dry-run", action="store_true", help="show what would move; change nothing")

    fail = qcommand("fail", "set queued rows aside as failed (a stuck head stops blocking its "
                            "channel); `queue retry` brings them back")
    fail.add_argument("ids", nargs="+", metavar="ID", help=f"queued rows to set aside: {id_help}")
    fail.add_argument("--reason", metavar="TEXT",
                      help="why: stored with each row (error_text) and in the daemon's log")

    purge = qcommand("purge", "delete terminal rows older than a duration")
    purge.add_argument("--state", required=True,
                       help="the state to delete (processed, rejected, failed or nacked)")
    purge.add_argument("--older-than", required=True, metavar="DURATION",
                       help="rows last changed longer ago than this (30s, 5m, 2h, 7d; 0: all)")
    purge.add_argument("--channel", help="only rows of this channel")
    purge.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")

    export = qcommand("export", "write selected messages MLLP-framed for replay elsewhere")
    export.add_argument("--state", required=True, help=f"the state to export ({states})")
    export.add_argument("--channel", help="only rows of this channel")
    export.add_argument("--format", choices=["mllp", "lines"], default="mllp",
                        help="mllp: each message framed 0x0B…0x1C 0x0D; lines: a segment per line")
    export.add_argument("out", metavar="OUT", help="the file to write (mode 0600), or - for stdout")

    channel = command("channel", "pause or resume dispatch of a channel (durable)")
    csub = channel.add_subparsers(dest="channel_command", metavar="SUBCOMMAND", parser_class=_Parser)
    csub.required = True
    for name, help_ in (("pause", "hold dispatch (intake goes on) until resumed"),
                        ("resume", "resume dispatch")):
        p = csub.add_parser(name, help=help_, description=help_)
        _global_flags(p, top=False)
        p.add_argument("name", metavar="NAME", help="a configured channel")
    return parser


# -- commands ----------------------------------------------------------------


def _settings(args: argparse.Namespace) -> Any:
    from agent.app.config import load_settings

    return load_settings(args.config)


def cmd_run(args: argparse.Namespace) -> int:
    from agent.app.preflight import log_start_failure
    from agent.app.service import run_agent
    from agent.runtime.logs import configure_logging, flush_logs

    try:
        settings = _settings(args)
    except ConfigError as exc:
        # No configuration to take the log format from: JSON for a log reader, text on a terminal.
        configure_logging("info", "console" if sys.stderr.isatty() else "json")
        log_start_failure(exc)
        flush_logs()
        raise
    level = "debug" if args.debug else settings.logging.level
    configure_logging(level, settings.logging.format)
    try:
        if not settings.channels:
            import structlog

            structlog.get_logger("agent").warning(
                "no_channels_configured", hint="add [[channels]] tables or HL7_AGENT_CHANNELS"
            )
        return asyncio.run(run_agent(settings))
    finally:
        # Log lines are written by a thread: let them out (bounded) before
        # main() prints the error line, so the reader sees them in order.
        flush_logs()


def cmd_check_config(args: argparse.Namespace) -> int:
    from agent.app.config import render_effective
    from agent.app.preflight import data_dir_problem, file_warnings, tls_problem

    settings = _settings(args)
    # The daemon could not start with it: a configuration this user cannot run is not valid.
    problem = data_dir_problem(settings.agent.data_dir)
    if problem is not None:
        raise ConfigError(f"config error: {problem.message()}")
    tls = tls_problem(settings)
    if tls is not None:
        raise ConfigError(f"config error: {tls[1]}")
    for key, words in file_warnings(settings, time.time()):
        print(f"warning: {key}: {words}", file=sys.stderr)
    text = render_effective(settings)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    # Exit 0 or 1 only, even on configuration errors (Docker reserves 2).
    try:
        from agent.app.health import check_health

        settings = _settings(args)
        if not settings.admin.listen:
            print("hl7-agent: [admin] listen is disabled; nothing to check", file=sys.stderr)
            return EXIT_FAILURE
        ok = check_health(settings.admin.listen)
    except Exception as exc:  # noqa: BLE001 - health never exits 2
        print(f"hl7-agent: health: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if not ok:
        print(f"hl7-agent: no healthy daemon at {settings.admin.listen}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_FAILURE


def cmd_send(args: argparse.Namespace) -> int:
    from agent.app.client import ClientTls, send_files
    from agent.errors import UsageError

    if not args.tls and (args.ca or args.cert or args.key):
        raise UsageError("send: --ca, --cert and --key need --tls")
    if args.key and not args.cert:
        raise UsageError("send: --key needs --cert")
    tls = ClientTls(ca=args.ca, cert=args.cert, key=args.key) if args.tls else None
    if tls is not None:
        try:
            tls.context()  # a file named on the command line that does not load is a usage error
        except (OSError, ValueError) as exc:
            raise UsageError(f"send: {getattr(exc, 'key', '--tls')}: {exc}") from None
    # "[::1]" as in a URL is the address ::1.
    host = args.host[1:-1] if args.host.startswith("[") and args.host.endswith("]") else args.host
    return send_files(host, args.port, args.files, timeout=args.timeout, tls=tls)


def cmd_dev_server(args: argparse.Namespace) -> int:
    from agent.app.devserver import read_dev_token, run_dev_server
    from agent.runtime.logs import configure_logging, flush_logs

    configure_logging("debug" if args.debug else "info", "console" if sys.stderr.isatty() else "json")
    try:
        token = read_dev_token(args.token_file)
        return run_dev_server(args.host, args.port, token, not args.no_replay, args.store)
    finally:
        flush_logs()


def cmd_queue(args: argparse.Namespace) -> int:
    from agent.app.commands import queue as queuecmd
    handler: Callable[[Any, argparse.Namespace], int] = getattr(queuecmd, f"cmd_{args.queue_command}")
    return handler(_settings(args), args)


def cmd_channel(args: argparse.Namespace) -> int:
    from agent.app.commands import channel as channelcmd
    return channelcmd.cmd_channel(_settings(args), args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "check-config": cmd_check_config,
    "health": cmd_health,
    "send": cmd_send,
    "dev-server": cmd_dev_server,
    "queue": cmd_queue,
    "channel": cmd_channel,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:
        # `health` exits 0 or 1 only (Docker reserves 2), even for a bad flag.
        if exc.code == EXIT_USAGE and "health" in words:
            return EXIT_FAILURE
        raise
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        if args.debug:
            traceback.print_exc()
        message = str(exc)
        print(message if message.startswith("config error") else f"hl7-agent: {message}", file=sys.stderr)
        return EXIT_USAGE
    except AgentError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"hl7-agent: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"hl7-agent: {exc}", file=sys.stderr)
        return EXIT_FAILURE
