"""TLS for the ``tcp`` KV backend: which files a worker was given, and the contexts built
from them.

Plain by default. A decode worker given a certificate and key (``--kv-tls-cert``,
``--kv-tls-key``) serves its KV port over TLS, and its Reserve answers say so; a prefill
worker given the CA that signed them (``--kv-tls-ca``) verifies the decode worker's
certificate and pushes over TLS only (it refuses a plain port rather than fall back).
Pod addresses are not names, so the chain is what is checked, plus the name in
``--kv-tls-server-name`` when one is given.

Every worker of a pool gets the same three files (one Secret), so turning on mutual TLS
later is the server verifying client certificates against the same CA and the client
presenting its own: the contexts below are the only place either changes.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


class TlsError(ValueError):
    """The TLS files cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str | None = None
    """PEM certificate (chain) the decode side's KV port presents."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM CA bundle a sender verifies decode workers' certificates against."""
    server_name: str | None = None
    """Name the decode workers' certificates must carry; ``None``: the chain alone."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("--kv-tls-cert and --kv-tls-key go together: give both or neither")
        if self.server_name is not None and self.ca_file is None:
            raise TlsError("--kv-tls-server-name needs --kv-tls-ca (the CA that checks it)")

    @property
    def serves(self) -> bool:
        """The decode side's KV port speaks TLS."""
        return self.cert_file is not None

    @property
    def verifies(self) -> bool:
        """The prefill side pushes over TLS only, checking the peer against the CA."""
        return self.ca_file is not None

    def server_context(self) -> ssl.SSLContext:
        assert self.cert_file is not None and self.key_file is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(
                f"cannot load --kv-tls-cert {self.cert_file} / --kv-tls-key {self.key_file}: {e}"
            ) from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        assert self.ca_file is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.server_name is not None
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"cannot load --kv-tls-ca {self.ca_file}: {e}") from None
        return ctx
