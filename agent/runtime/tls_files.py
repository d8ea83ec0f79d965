"""Loading certificates and keys into an SSL context, with errors that name the file at fault.

``SSLContext.load_cert_chain`` reports one error for a pair of files ("[SSL]
PEM lib", "Permission denied") without saying which, and for an encrypted
key it asks for the passphrase on the terminal — a daemon under systemd
would block there for good. :func:`load_pair` and :func:`load_ca` check each
file first and turn OpenSSL's codes into what an operator can act on;
:class:`TlsFileError` carries the configuration key of the file at fault.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import NoReturn

__all__ = ["TlsFileError", "load_ca", "load_pair", "verifying_context"]


class TlsFileError(ValueError):
    """A TLS file that does not load: ``key`` names the setting (``tls_key``), the message the file and why."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


#: More than any certificate chain or key file holds: the rest is not read.
_READ_LIMIT = 1 << 20


def _read(key: str, path: str | Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(_READ_LIMIT)
    except OSError as exc:
        raise TlsFileError(key, f"cannot read {path}: {exc.strerror or exc}") from None


def _no_passphrase(key: str, path: str | Path) -> NoReturn:
    raise TlsFileError(key, f"the private key {path} is encrypted with a passphrase, which a daemon cannot "
                            "type: store it decrypted, readable by this user only "
                            f"(openssl pkey -in {path} -out {path}.plain)")


def load_pair(context: ssl.SSLContext, cert: str | Path, key: str | Path | None,
              *, cert_key: str = "tls_cert", key_key: str = "tls_key") -> None:
    """``context.load_cert_chain(cert, key)``, never prompting; TlsFileError naming the file at fault.

    ``cert_key``/``key_key``: the settings the files came from, for the message.
    """
    cert_pem = _read(cert_key, cert)
    key_pem = _read(key_key, key) if key is not None else cert_pem
    key_of = key_key if key is not None else cert_key
    key_path = key if key is not None else cert
    # Which file is at fault, before OpenSSL's "PEM lib" for both (RFC 7468 labels).
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise TlsFileError(cert_key, f"{cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if b"PRIVATE KEY-----" not in key_pem:
        raise TlsFileError(key_of, f"{key_path} holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    try:
        context.load_cert_chain(str(cert), None if key is None else str(key),
                                password=lambda: _no_passphrase(key_of, key_path))
    except TlsFileError:
        raise
    except ssl.SSLError as exc:
        reason = exc.reason or ""
        if reason == "KEY_VALUES_MISMATCH":
            raise TlsFileError(key_of, f"the private key {key_path} does not belong to the certificate "
                                       f"{cert}") from None
        raise TlsFileError(key_of, f"{cert} with {key_path}: {reason.lower().replace('_', ' ') or exc}") from None


def verifying_context(cafile: str | Path | None, *, setting: str) -> ssl.SSLContext:
    """A client context that verifies the server against ``cafile`` alone (None: the system's store).

    As ``ssl.create_default_context(cafile=...)`` does (same settings: TLS
    1.2+, certificate and host name checked), with :func:`load_ca`'s errors.
    Not ``create_default_context()`` and then the CA: that one has loaded the
    system's store already, and would trust every public CA beside ours.
    """
    if cafile is None:
        return ssl.create_default_context()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    load_ca(context, cafile, setting=setting)
    return context


def load_ca(context: ssl.SSLContext, cafile: str | Path, *, setting: str) -> None:
    """``context.load_verify_locations(cafile)``; TlsFileError naming ``setting`` and the file."""
    _read(setting, cafile)
    try:
        context.load_verify_locations(cafile=str(cafile))
    except ssl.SSLError as exc:
        raise TlsFileError(setting, f"{cafile}: no CA certificate in it "
                                    f"({(exc.reason or str(exc)).lower().replace('_', ' ')})") from None
