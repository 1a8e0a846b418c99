"""Test certificates made with the openssl CLI (already needed by the tests; no extra Python package).

One test CA signs a server certificate (``localhost`` / ``127.0.0.1``) and a client certificate. A second CA, which
nobody trusts, signs the "wrong" client certificate and a server certificate that a client trusting only the test CA
must refuse; ``self_signed_*`` is a client certificate signed by nobody. EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import attrs

__all__ = ["NAMED_SERVER", "Certs", "make_certs"]

_SERIALS = itertools.count(1001)
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@attrs.frozen(kw_only=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_server_cert: Path
    other_server_key: Path
    wrong_client_cert: Path
    wrong_client_key: Path
    self_signed_cert: Path
    self_signed_key: Path
    # Names only a DNS name (no address): a client connecting to an address must check it against that name.
    named_server_cert: Path
    named_server_key: Path


NAMED_SERVER = "triton-fleet.test"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    return cert, key


def _leaf(
    folder: Path, name: str, ca: tuple[Path, Path], *, server: bool, names: str = "DNS:localhost,IP:127.0.0.1"
) -> tuple[Path, Path]:
    cert, key, csr, ext = (folder / f"{name}{s}" for s in (".pem", ".key", ".csr", ".ext"))
    _openssl("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
    if server:
        lines += ["extendedKeyUsage=serverAuth", f"subjectAltName={names}"]
    else:
        lines += ["extendedKeyUsage=clientAuth"]
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-out", str(cert),
             "-days", "2", "-set_serial", str(next(_SERIALS)), "-extfile", str(ext))  # fmt: skip
    return cert, key


def make_certs(folder: Path) -> Certs:
    """Write every certificate and key under ``folder`` (PEM) and return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = _ca(folder, "test-ca")
    other = _ca(folder, "other-ca")
    server = _leaf(folder, "localhost", ca, server=True)
    other_server = _leaf(folder, "other-server", other, server=True)
    client = _leaf(folder, "client", ca, server=False)
    named = _leaf(folder, NAMED_SERVER, ca, server=True, names=f"DNS:{NAMED_SERVER}")
    wrong = _leaf(folder, "wrong-client", other, server=False)
    lone = folder / "self-signed.pem", folder / "self-signed.key"
    _openssl("req", "-x509", *_EC, "-keyout", str(lone[1]), "-out", str(lone[0]), "-days", "2",
             "-subj", "/CN=self-signed-client", "-addext", "extendedKeyUsage=clientAuth")  # fmt: skip
    return Certs(
        ca=ca[0],
        server_cert=server[0],
        server_key=server[1],
        client_cert=client[0],
        client_key=client[1],
        other_ca=other[0],
        other_server_cert=other_server[0],
        other_server_key=other_server[1],
        wrong_client_cert=wrong[0],
        wrong_client_key=wrong[1],
        self_signed_cert=lone[0],
        self_signed_key=lone[1],
        named_server_cert=named[0],
        named_server_key=named[1],
    )
