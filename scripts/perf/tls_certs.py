"""A throwaway certificate authority and host certificates for TLS tests and benchmarks (``bootstrap.tls``),
made with the ``openssl`` command (OpenSSL 1.1.1 or later): ECDSA P-256 keys, valid for two days.

``make_fleet_certs(directory)`` writes a CA and one server certificate whose subject alternative names are the
given hosts (default ``127.0.0.1`` and ``localhost``), the files ``PD_TLS_CA``, ``PD_TLS_CERT`` and
``PD_TLS_KEY`` take. docs/security.md gives the same commands for a real fleet.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FleetCerts:
    """PEM files: the CA's certificate, the host's certificate and the host's private key."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def env(self) -> dict[str, str]:
        """``PD_TLS_CERT``, ``PD_TLS_KEY`` and ``PD_TLS_CA`` for a process of this fleet."""
        return {"PD_TLS_CERT": str(self.cert_file), "PD_TLS_KEY": str(self.key_file),
                "PD_TLS_CA": str(self.ca_file)}


def have_openssl() -> bool:
    """Whether the ``openssl`` command is on PATH."""
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA in ``directory``: (``<name>.pem``, ``<name>.key``). Raises ``CalledProcessError`` when
    openssl fails."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN=triton-pd test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_host_cert(directory: Path, ca: tuple[Path, Path], hosts: Sequence[str], name: str = "host"
                   ) -> tuple[Path, Path]:
    """A server certificate signed by ``ca`` (its certificate and key) naming ``hosts`` (IP addresses as IP
    SANs, others as DNS SANs): (``<name>.pem``, ``<name>.key``)."""
    cert, key, csr, ext = (directory / f"{name}.{s}" for s in ("pem", "key", "csr", "ext"))
    sans = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    ext.write_text(f"subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={hosts[0]}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


def make_fleet_certs(directory: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                     ca_name: str = "ca") -> FleetCerts:
    """A new CA and one host certificate for ``hosts`` in ``directory``."""
    ca = make_ca(directory, ca_name)
    cert, key = make_host_cert(directory, ca, hosts, f"{ca_name}-host")
    return FleetCerts(ca[0], cert, key)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
