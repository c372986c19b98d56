"""Certificates for the TLS tests: a CA and one certificate every part of a stack
presents (as one cluster Secret would mount them), and a stranger's certificate signed
by another CA (a client that must be refused)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme
from splitserve.tls import TlsConfig

SERVER_NAME = "decode.splitserve.test"


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path
    other_ca: Path
    """A CA that signed nothing here: a sender trusting it must refuse the port."""
    other_cert: Path
    """A certificate (for 127.0.0.1 and :data:`SERVER_NAME`) that ``other_ca`` signed."""
    other_key: Path

    def config(self, *, server_name: str | None = None, mutual: bool = False) -> TlsConfig:
        """Every part's settings, as each worker of a stack gets them."""
        return TlsConfig(str(self.cert), str(self.key), str(self.ca), server_name, mutual)

    def stranger(self) -> TlsConfig:
        """A client with a certificate of the wrong CA (and trusting the right one)."""
        return TlsConfig(str(self.other_cert), str(self.other_key), str(self.ca))


def make_tls_files(folder: Path) -> TlsFiles:
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert(SERVER_NAME, "127.0.0.1")
    stranger = other.issue_cert(SERVER_NAME, "127.0.0.1")
    files = TlsFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt",
                     folder / "other-ca.crt", folder / "other.crt",
                     folder / "other.key")  # fmt: skip
    cert.private_key_pem.write_to_path(str(files.key))
    cert.cert_chain_pems[0].write_to_path(str(files.cert))
    ca.cert_pem.write_to_path(str(files.ca))
    other.cert_pem.write_to_path(str(files.other_ca))
    stranger.private_key_pem.write_to_path(str(files.other_key))
    stranger.cert_chain_pems[0].write_to_path(str(files.other_cert))
    return files
