"""Certificates for the tcp KV backend's TLS tests: a CA and one decode worker's
certificate, written to files as a cluster Secret would mount them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme
from splitserve_worker.kv.tcp_tls import TlsConfig

SERVER_NAME = "decode.splitserve.test"


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path
    other_ca: Path
    """A CA that signed nothing here: a sender trusting it must refuse the port."""

    def config(self, *, server_name: str | None = None) -> TlsConfig:
        """Both sides' settings, as every worker of a pool gets them."""
        return TlsConfig(str(self.cert), str(self.key), str(self.ca), server_name)


def make_tls_files(folder: Path) -> TlsFiles:
    ca = trustme.CA()
    cert = ca.issue_cert(SERVER_NAME, "127.0.0.1")
    files = TlsFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt",
                     folder / "other-ca.crt")  # fmt: skip
    cert.private_key_pem.write_to_path(str(files.key))
    cert.cert_chain_pems[0].write_to_path(str(files.cert))
    ca.cert_pem.write_to_path(str(files.ca))
    trustme.CA().cert_pem.write_to_path(str(files.other_ca))
    return files
