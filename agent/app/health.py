"""`hl7-agent health`: is the daemon at the admin address alive?

Docker's HEALTHCHECK and the upgrade script run this every few seconds, so it
is kept light (stdlib only, no prometheus-client import) and it answers with a
bool — the CLI (``cmd_health``) turns it into exit 0/1, never 2, because Docker reserves exit 2
(docs/operations.md#exit-codes).
"""

from __future__ import annotations

import http.client

from agent.core.addresses import parse_listen

#: Wildcard binds are probed over loopback: "listening on every address"
#: includes loopback, and the probe runs on the same host.
_WILDCARD_PROBE = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def check_health(listen: str, timeout: float = 3.0) -> bool:
    """True when ``GET /healthz`` on the admin address answers 200.

    Every failure — a bad address, a refused connection, a timeout, a non-200
    — is False: the caller only needs live or not.
    """
    try:
        host, port = parse_listen(listen, allow_port_zero=True)
        host = _WILDCARD_PROBE.get(host, host)
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/healthz", headers={"Connection": "close"})
            response = conn.getresponse()
            response.read(1024)
            return response.status == 200
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException):
        return False

