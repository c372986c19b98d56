"""TLS between splitserve's parts: which files a process was given, checked when the
settings are built, and the contexts and credentials made from them for every port and
every call (a worker's gRPC server, its ``tcp`` KV port, the router's and the prefill
workers' calls to workers, KV pushes over ``tcp`` or ``grpc``).

Plain by default. The same flags on every part (``--tls-cert``, ``--tls-key``,
``--tls-ca``, ``--tls-server-name``, ``--tls-mutual``):

- ``--tls-cert`` / ``--tls-key``: this process's certificate. A worker given them serves
  its gRPC port and its KV port over TLS only; any part presents it when it calls a
  worker (the client certificate of mutual TLS).
- ``--tls-ca``: the CA bundle peers' certificates are checked against. A part given it
  calls workers over TLS only (it refuses a plain port rather than fall back), and a
  worker given it with ``--tls-mutual`` takes only clients that present a certificate
  the CA signed.
- ``--tls-server-name``: the name workers' certificates carry. Pods are addressed by
  IP, so in a cluster every worker's certificate carries one name and every caller
  checks that name; without it the host of the address called is checked.
- ``--tls-mutual``: a worker refuses a client without a certificate signed by
  ``--tls-ca`` (needs all three files).

Every part of a stack gets the same three files (one Secret, ``tls.crt``, ``tls.key``,
``ca.crt``), so turning on mutual TLS is one flag. grpcio makes the gRPC credentials
from the same bytes the ``ssl`` contexts are loaded from.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

SERVER_NAME_OPTION = "grpc.ssl_target_name_override"
"""The gRPC channel option that makes a channel check ``--tls-server-name`` instead of
the host it dials."""


class TlsError(ValueError):
    """The TLS settings or files cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str | None = None
    """PEM certificate (chain) this process presents: as a worker's server certificate,
    and as the client certificate of its calls."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM CA bundle the certificates of the workers called (and, with ``mutual``, of the
    clients taken) are checked against."""
    server_name: str | None = None
    """Name the workers' certificates must carry; ``None``: the host of the address."""
    mutual: bool = False
    """A worker's ports take only clients presenting a certificate ``ca_file`` signed."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("--tls-cert and --tls-key go together: give both or neither")
        if self.server_name is not None and self.ca_file is None:
            raise TlsError("--tls-server-name needs --tls-ca (the CA that checks it)")
        if self.mutual and (self.cert_file is None or self.ca_file is None):
            raise TlsError(
                "--tls-mutual needs --tls-cert, --tls-key and --tls-ca: the worker's own "
                "certificate, and the CA its clients' certificates are checked against"
            )

    @property
    def enabled(self) -> bool:
        return self.serves or self.verifies

    @property
    def serves(self) -> bool:
        """A worker's ports speak TLS only."""
        return self.cert_file is not None

    @property
    def verifies(self) -> bool:
        """Calls to workers go over TLS only, checking the peer against the CA."""
        return self.ca_file is not None

    def check(self) -> None:
        """Read every file given now, so a wrong one stops the process before it serves."""
        if self.serves:
            self.server_context()
        if self.verifies:
            self.client_context()
            self.grpc_channel_credentials()
        if self.serves:
            self.grpc_server_credentials()

    # the ssl contexts (the tcp KV port and its pushes)

    def server_context(self) -> ssl.SSLContext:
        assert self.cert_file is not None and self.key_file is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(ctx)
        if self.mutual:
            ctx.verify_mode = ssl.CERT_REQUIRED
            self._load_ca(ctx)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        assert self.ca_file is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        self._load_ca(ctx)
        if self.cert_file is not None:
            self._load_chain(ctx)
        return ctx

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(self.cert_file or "", self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(
                f"cannot load --tls-cert {self.cert_file} / --tls-key {self.key_file}: {e}; "
                "give a PEM certificate and its PEM private key"
            ) from None

    def _load_ca(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_verify_locations(self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(
                f"cannot load --tls-ca {self.ca_file}: {e}; give a PEM CA bundle"
            ) from None

    # grpcio's credentials (the worker's gRPC server and every call to it)

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        assert self.cert_file is not None and self.key_file is not None
        cert, key = self._read("--tls-cert", self.cert_file), self._read("--tls-key", self.key_file)
        ca = self._read("--tls-ca", self.ca_file) if self.mutual and self.ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.mutual
        )

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        assert self.ca_file is not None
        ca = self._read("--tls-ca", self.ca_file)
        if self.cert_file is None or self.key_file is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=self._read("--tls-key", self.key_file),
            certificate_chain=self._read("--tls-cert", self.cert_file),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """Options a TLS channel adds: the name to check, when one is set."""
        return [(SERVER_NAME_OPTION, self.server_name)] if self.server_name else []

    @staticmethod
    def _read(flag: str, path: str) -> bytes:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise TlsError(f"cannot read {flag} {path}: {e.strerror}; check the path") from None
        if b"-----BEGIN" not in data:
            raise TlsError(f"{flag} {path} holds no PEM block; give a PEM file")
        return data


def grpc_channel(
    address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]]
) -> grpc.Channel:
    """A blocking channel to a worker: over TLS when ``tls`` verifies, else plain."""
    import grpc

    if tls is None or not tls.verifies:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(
        address, tls.grpc_channel_credentials(), options=[*options, *tls.channel_options()]
    )


def grpc_aio_channel(
    address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Channel:
    """An asyncio channel to a worker: over TLS when ``tls`` verifies, else plain."""
    import grpc

    if tls is None or not tls.verifies:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, tls.grpc_channel_credentials(), options=[*options, *tls.channel_options()]
    )
