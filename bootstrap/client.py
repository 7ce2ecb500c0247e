"""HTTP client of a rendezvous (one instance's own, ``bootstrap.rendezvous``); every call has a timeout and
raises ``BootstrapError`` on failure (``RendezvousRefused`` when nothing listens there any more).

With the fleet's TLS setting (``bootstrap.tls.FleetTLS``) a client speaks HTTPS only: it checks the server's
certificate against the fleet's CA and the URL's host, and refuses an ``http://`` URL.

Not thread-safe: one client per thread (a KV manager's thread keeps a ``ClientPool``, one client per peer
URL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

import requests

from bootstrap.errors import BootstrapError, RendezvousRefused, TLSRefused
from bootstrap.messages import (
    Destination,
    DestinationBatch,
    Heartbeat,
    InstanceList,
    InstanceLoad,
    InstanceStatus,
    PostResult,
    Registration,
    Room,
    RoomRelease,
    RoomReleased,
    decode,
    encode,
)

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

M = TypeVar("M")


class BootstrapClient:
    def __init__(self, base_url: str, timeout_s: float = 2.0, secret: bytes | None = None,
                 tls: FleetTLS | None = None) -> None:
        """``secret``: the fleet secret; every request is then signed (``bootstrap.auth.HmacAuth``). ``tls``:
        the fleet's TLS setting; the server must then be ``https://`` with a certificate its CA signed for the
        URL's host. Raises ``bootstrap.tls.TLSError`` (a ``BootstrapError``) for an ``http://`` URL with
        TLS."""
        if tls is not None:
            from bootstrap.tls import check_url

            check_url(base_url, tls, "the rendezvous")
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._session = requests.Session()
        if tls is not None:
            tls.apply(self._session)
        if secret is not None:
            from bootstrap.auth import HmacAuth

            self._session.auth = HmacAuth(secret)

    def register(self, registration: Registration) -> None:
        self._call("POST", "/v1/instances", registration, Registration)

    def heartbeat(self, instance_id: str, epoch: int, load: InstanceLoad | None = None) -> bool:
        """False when the service no longer knows this instance (it must register again)."""
        return self._call("POST", "/v1/heartbeat", Heartbeat(instance_id, epoch, load), Heartbeat,
                          missing_ok=True) is not None

    def list_instances(self, role: str = "") -> list[InstanceStatus]:
        """The registered instances (of ``role`` when given) with their last reported load."""
        listing = self._call("GET", "/v1/instances" + (f"?role={role}" if role else ""), None, InstanceList)
        assert listing is not None
        return listing.instances

    def deregister(self, instance_id: str, epoch: int) -> None:
        self._request("DELETE", f"/v1/instances/{_path(instance_id)}", params={"epoch": str(epoch)})

    def get_instance(self, instance_id: str) -> Registration | None:
        """The instance's current registration, or None when it is not (or no longer) registered."""
        return self._call("GET", f"/v1/instances/{_path(instance_id)}", None, Registration, missing_ok=True)

    def post_destination(self, destination: Destination) -> PostResult:
        response = self._request("POST", "/v1/rooms", data=encode(destination))
        if response.status_code not in (200, 404, 409):
            raise BootstrapError(f"POST /v1/rooms: HTTP {response.status_code} {response.text[:200]}")
        return decode(response.content, PostResult)

    def take_destinations(self, prefill_instance_id: str) -> list[Destination]:
        batch = self._call("GET", f"/v1/instances/{_path(prefill_instance_id)}/destinations", None,
                           DestinationBatch)
        assert batch is not None
        return batch.destinations

    def release_room(self, room: Room, decode_instance_id: str) -> RoomReleased:
        message = RoomRelease(room, decode_instance_id)
        released = self._call("POST", "/v1/rooms/release", message, RoomReleased)
        assert released is not None
        return released

    def close(self) -> None:
        self._session.close()

    def _call(self, method: str, path: str, body: object | None, expected: type[M],
              missing_ok: bool = False, timeout_s: float | None = None) -> M | None:
        response = self._request(method, path, data=encode(body) if body is not None else None,
                                 timeout=timeout_s or self._timeout_s)
        if missing_ok and response.status_code == 404:
            return None
        if response.status_code != 200:
            raise BootstrapError(f"{method} {path}: HTTP {response.status_code} {response.text[:200]}")
        return decode(response.content, expected)

    def _request(self, method: str, path: str, **kwargs: object) -> requests.Response:
        try:
            kwargs.setdefault("timeout", self._timeout_s)
            return self._session.request(method, self._base_url + path, **kwargs)  # type: ignore[arg-type]
        except requests.exceptions.SSLError as exc:
            error = TLSRefused if _tls_refused(exc) else BootstrapError
            raise error(f"{method} {self._base_url}{path}: TLS handshake failed (a server whose certificate "
                        f"the fleet's CA did not sign for this host, or one that does not speak TLS): "
                        f"{exc}") from exc
        except requests.ConnectionError as exc:
            if _refused(exc):
                raise RendezvousRefused(f"{method} {self._base_url}{path}: connection refused") from exc
            raise BootstrapError(f"{method} {self._base_url}{path}: {exc}") from exc
        except requests.RequestException as exc:
            raise BootstrapError(f"{method} {self._base_url}{path}: {exc}") from exc

    @property
    def base_url(self) -> str:
        return self._base_url


class ClientPool:
    """One ``BootstrapClient`` per rendezvous URL (a manager talks to each peer's own rendezvous); the owner's
    thread only, like the clients."""

    def __init__(self, timeout_s: float = 2.0, secret: bytes | None = None,
                 tls: FleetTLS | None = None) -> None:
        self._timeout_s = timeout_s
        self._secret = secret
        self._tls = tls
        self._clients: dict[str, BootstrapClient] = {}

    def get(self, url: str) -> BootstrapClient:
        """The client of rendezvous ``url`` (``http://host:port``, ``https://`` with TLS); raises
        ``BootstrapError`` on an empty URL, or an ``http://`` one with TLS."""
        if not url:
            raise BootstrapError("no rendezvous URL for this peer")
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = BootstrapClient(url, self._timeout_s, self._secret, self._tls)
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _tls_refused(exc: BaseException) -> bool:
    """True when the cause chain holds a certificate the client rejected, or a server that answered the
    handshake with something else than TLS (``TLSRefused``); False for a handshake cut short."""
    from bootstrap.tls import ssl_module

    ssl = ssl_module()
    return any(isinstance(e, ssl.SSLCertVerificationError)
               or (isinstance(e, ssl.SSLError) and getattr(e, "reason", "") == "WRONG_VERSION_NUMBER")
               for e in _causes(exc))


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception its cause chain, context and arguments hold (``requests`` wraps
    urllib3's, which wraps the socket's)."""
    seen: dict[int, BaseException] = {}
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen[id(e)] = e
        todo.extend([e.__cause__, e.__context__, *getattr(e, "args", ()), getattr(e, "reason", None)])
    return list(seen.values())


def _refused(exc: BaseException) -> bool:
    """True when the cause chain holds a ``ConnectionRefusedError`` (nothing listens at the port)."""
    causes = _causes(exc)
    return any(isinstance(e, ConnectionRefusedError) for e in causes) or "Connection refused" in str(exc)


def _path(instance_id: str) -> str:
    """An instance id as one URL path segment (ids hold ``@`` and ``:``, e.g. ``prefill@10.0.0.2:8001``)."""
    return quote(instance_id, safe="@:")
