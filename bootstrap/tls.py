"""``FleetTLS``: encryption in transit for the fleet's own listeners, an option beside the fleet secret.

With it, every instance's rendezvous and the membership registry serve HTTPS (their URLs say ``https://``),
the worker endpoints speak TLS, and every client of them (``BootstrapClient``, the registry client, the
router's ``EndpointLauncher``) checks the server's certificate against the fleet's CA and the host it dialed.
The fleet secret's signatures stay the authentication either way (``bootstrap.auth``): TLS adds
confidentiality (prompts and tokens on the child streams, addresses and page ids on the rendezvous) and a
server identity; it does not replace the secret, and clients present no certificate (no mutual TLS: holding
the secret is what lets a caller in, one check rather than two to keep in step).

One setting per process, read at its edge (``load_fleet_tls`` from ``PD_TLS_CERT``, ``PD_TLS_KEY``,
``PD_TLS_CA``, called by ``serving.config`` and the registry's CLI) and passed down; None means plaintext. A
fleet is TLS everywhere or nowhere: a listener speaks one or the other, and a client with TLS on refuses an
``http://`` URL rather than fall back to plaintext.

Certificates: each server presents ``cert_file`` (PEM chain, the server's certificate first) with
``key_file``; it must name the host its peers dial, the advertised host (``ADVERTISE_HOST``, the host of
``grpc_url``, the registry's ``--advertise-host``), as a DNS or IP subject alternative name: clients check it
(``server_hostname``). Certificates are usually issued per host; one naming every host of the fleet works too.

Python's ``ssl`` module is imported only when TLS is on: an interpreter that cannot import it (a python
backend stub whose libpython is not the one the standard library was built for) runs a plaintext fleet as
before, and with ``PD_TLS_*`` set fails at start-up with a ``TLSError`` that says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import requests
from requests.adapters import HTTPAdapter

from bootstrap.errors import BootstrapError

if TYPE_CHECKING:
    import ssl

CERT_ENV = "PD_TLS_CERT"
KEY_ENV = "PD_TLS_KEY"
CA_ENV = "PD_TLS_CA"
TLS_ENV: tuple[str, str, str] = (CERT_ENV, KEY_ENV, CA_ENV)


class TLSError(BootstrapError):
    """The fleet's TLS setting is incomplete, a file is missing or unreadable, or the certificate and key do
    not load; ``str()`` names the variable or file."""


@dataclass(frozen=True)
class FleetTLS:
    """The fleet's TLS files (PEM), one set per host. Immutable, so any thread may use it; each
    ``server_context``/``client_context`` call makes a new ``ssl.SSLContext`` (one per server or client).

    Attributes:
        cert_file: this host's certificate chain (the server's certificate first), presented by its servers;
            it must name the advertised host (DNS or IP subject alternative name).
        key_file: the private key of ``cert_file``.
        ca_file: the certificate authority (or bundle) that signed every server's certificate; clients trust
            it and nothing else.

    Raises:
        TLSError: at construction, naming the file, when a file is missing or unreadable, or the certificate
            and key do not load (a key of another certificate, a malformed PEM).
    """

    cert_file: str
    key_file: str
    ca_file: str

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.cert_file), ("key", self.key_file), ("CA", self.ca_file)):
            if not path or not Path(path).is_file():
                raise TLSError(f"TLS {what} file {path!r} does not exist")
        self.server_context()
        self.client_context()

    def server_context(self) -> ssl.SSLContext:
        """A context for a server socket (TLS 1.2 or later, this host's certificate and key; clients are not
        asked for one). Files are read now: a renewed certificate is served by the next server started.

        Raises:
            TLSError: a file cannot be read, or the certificate and key do not load together.
        """
        tls = ssl_module()
        context = tls.create_default_context(tls.Purpose.CLIENT_AUTH)
        context.minimum_version = tls.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, tls.SSLError) as exc:
            raise TLSError(f"TLS certificate {self.cert_file} with key {self.key_file} does not load: "
                           f"{exc}") from None
        return context

    def client_context(self) -> ssl.SSLContext:
        """A context for client connections: the server's certificate must chain to ``ca_file`` and name the
        host given as ``server_hostname`` (asyncio's ``open_connection(ssl=..., server_hostname=host)``).

        Raises:
            TLSError: ``ca_file`` cannot be read or holds no certificate.
        """
        tls = ssl_module()
        try:
            context = tls.create_default_context(tls.Purpose.SERVER_AUTH, cafile=self.ca_file)
        except (OSError, tls.SSLError) as exc:
            raise TLSError(f"TLS CA file {self.ca_file} does not load: {exc}") from None
        context.minimum_version = tls.TLSVersion.TLSv1_2
        return context

    def requests_verify(self) -> str:
        """``requests``' ``verify``: the CA bundle servers are checked against (the host name is checked too).
        Clients present no certificate (``cert`` stays None)."""
        return self.ca_file

    def apply(self, session: requests.Session) -> None:
        """Makes ``session`` check every ``https://`` server against ``ca_file`` only: not the system's CAs,
        and not a bundle named by ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` (which ``requests`` would
        otherwise put before ``session.verify``)."""
        session.verify = self.requests_verify()
        session.cert = None
        session.mount("https://", _FleetCAAdapter(self.ca_file))


class _FleetCAAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that verifies every connection against one CA bundle, whatever ``verify`` the
    session's environment settings chose."""

    def __init__(self, ca_file: str) -> None:
        super().__init__()
        self._ca_file = ca_file

    def send(self, request: requests.PreparedRequest, stream: bool = False,
             timeout: float | tuple[float | None, float | None] | None = None, verify: bool | str = True,
             cert: str | tuple[str, str] | None = None, proxies: dict[str, str] | None = None
             ) -> requests.Response:
        return super().send(request, stream=stream, timeout=timeout, verify=self._ca_file, cert=cert,
                            proxies=proxies)


def ssl_module() -> ModuleType:
    """Python's ``ssl`` module. Raises ``TLSError`` when this interpreter cannot import it."""
    try:
        import ssl
    except ImportError as exc:
        raise TLSError(f"TLS is set ({CERT_ENV}) but this Python cannot import its ssl module ({exc}): "
                       "inside tritonserver, the python backend stub's libpython must be the interpreter the "
                       "environment's standard library belongs to (docs/security.md)") from None
    return ssl


def check_url(url: str, tls: FleetTLS | None, what: str) -> None:
    """Refuses a plaintext ``http://`` URL when TLS is on (no silent fall back to plaintext). ``what`` names
    the server in the message. Raises ``TLSError``."""
    if tls is not None and url.startswith("http://"):
        raise TLSError(f"{what} {url} is plaintext, but this fleet speaks TLS ({CERT_ENV} is set): "
                       "give its https:// URL")


def load_fleet_tls(environ: Mapping[str, str]) -> FleetTLS | None:
    """The fleet's TLS setting from ``PD_TLS_CERT``, ``PD_TLS_KEY`` and ``PD_TLS_CA`` in ``environ`` (all
    three or none); None (plaintext) when none is set.

    Raises:
        TLSError: naming the variable, when only some are set, a file does not exist, or the files do not
            load.
    """
    values = {name: environ.get(name, "").strip() for name in TLS_ENV}
    missing = [name for name, value in values.items() if not value]
    if len(missing) == len(TLS_ENV):
        return None
    if missing:
        given = [name for name in TLS_ENV if name not in missing]
        raise TLSError(f"incomplete TLS setting: {', '.join(missing)} unset, {', '.join(given)} set; set all "
                       f"three of {', '.join(TLS_ENV)} (TLS) or none (plaintext)")
    for name, value in values.items():
        if not Path(value).is_file():
            raise TLSError(f"{name}={value}: no such file")
    try:
        return FleetTLS(values[CERT_ENV], values[KEY_ENV], values[CA_ENV])
    except TLSError as exc:
        raise TLSError(f"{', '.join(f'{n}={v}' for n, v in values.items())}: {exc}") from None
