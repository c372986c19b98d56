"""The TLS flags, the same on ``splitserve worker``, ``router`` and ``up`` (what they
mean: :mod:`splitserve.tls`), and the settings read from them."""

from __future__ import annotations

import argparse

from splitserve.tls import TlsConfig

TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")


def add_tls_arguments(p: argparse.ArgumentParser, *, worker: bool) -> None:
    """The TLS flags, the same on workers, router and ``up`` (see :mod:`splitserve.tls`)."""
    serve = "serve this worker's gRPC and KV ports over TLS only, and present it to " if worker \
        else "present it to "  # fmt: skip
    p.add_argument(
        "--tls-cert",
        default=None,
        help=f"PEM certificate (with --tls-key): {serve}the workers called",
    )
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA bundle: call workers over TLS only, checking their certificates against it",
    )
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="name the workers' certificates carry (default: the host called)",
    )
    if worker:
        p.add_argument("--tls-mutual", action="store_true",
                       help="take only clients presenting a certificate --tls-ca signed "
                       "(needs --tls-cert, --tls-key and --tls-ca)")  # fmt: skip


def tls_from_args(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name,
                     getattr(args, "tls_mutual", False))  # fmt: skip


def tls_args(tls: TlsConfig) -> list[str]:
    """The flags that give a ``splitserve worker`` these settings (files, never secrets)."""
    pairs = [("--tls-cert", tls.cert_file), ("--tls-key", tls.key_file),
             ("--tls-ca", tls.ca_file), ("--tls-server-name", tls.server_name)]  # fmt: skip
    args = [part for flag, value in pairs if value is not None for part in (flag, value)]
    return [*args, "--tls-mutual"] if tls.mutual else args
