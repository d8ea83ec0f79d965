"""A PostgreSQL connection string as the operator may see it: with its password masked.

``queue.dsn`` is a libpq connection URL (``postgresql://user:pw@host:5432/db?…``)
or a key/value conninfo (``host=db user=hl7 password=pw``), the two forms
libpq documents ("Connection Strings", libpq 34.1.1). ``check-config``,
``queue stats`` and every error message show it with the password replaced
by ``***``. Pure string work (no driver needed), so the configuration can
mask a DSN on a host without psycopg.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, urlencode

__all__ = ["dsn_has_password", "is_url", "mask_dsn"]

MASK = "***"

_URL_SCHEMES = ("postgresql://", "postgres://")
#: ``password = value`` in key/value form: a value is single-quoted (with \' and \\ escapes)
#: or runs to the next whitespace.
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:\\.|[^'\\])*'|\S*)")


def is_url(dsn: str) -> bool:
    return dsn.strip().lower().startswith(_URL_SCHEMES)


def _split_url(dsn: str) -> tuple[str, str, str, str]:
    """(scheme://, userinfo, rest of the authority and path, query) of a URL DSN."""
    scheme, _, rest = dsn.strip().partition("://")
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    return scheme + "://", userinfo if at else "", hosts + slash + path, query


#: Any ``scheme://``: a wrong one (``mysql://u:pw@h/db``) is shown in the error
#: that refuses it, and must be masked like a right one.
_ANY_URL = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")


def mask_dsn(dsn: str) -> str:
    """``dsn`` with any password shown as ``***`` (URL user info, URL query, or ``password=``)."""
    if not _ANY_URL.match(dsn):
        return _KV_PASSWORD.sub(lambda m: m.group(1) + MASK, dsn)
    scheme, userinfo, rest, query = _split_url(dsn)
    if ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":" + MASK
    authority = f"{userinfo}@" if userinfo else ""
    if query:
        pairs = [(k, MASK if k == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        query = "?" + urlencode(pairs, safe="*/:,", quote_via=quote)
    return f"{scheme}{authority}{rest}{query}"


def dsn_has_password(dsn: str) -> bool:
    """Whether ``dsn`` itself carries a password (then ``password_file`` would be a second one)."""
    if not is_url(dsn):
        return _KV_PASSWORD.search(dsn) is not None
    _scheme, userinfo, _rest, query = _split_url(dsn)
    return ":" in userinfo or any(k == "password" for k, _ in parse_qsl(query, keep_blank_values=True))
