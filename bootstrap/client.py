"""HTTP client of the bootstrap service; every call has a timeout and raises ``BootstrapError`` on failure.

Not thread-safe: one client per thread (a KV manager uses its own from its background thread).
"""

from __future__ import annotations

from typing import TypeVar
from urllib.parse import quote

import requests

from bootstrap.errors import BootstrapError
from bootstrap.messages import (
    AbortLog,
    Destination,
    DestinationBatch,
    Heartbeat,
    InstanceList,
    InstanceLoad,
    InstanceStatus,
    PostResult,
    Registration,
    Room,
    RoomAbort,
    RoomRelease,
    RoomReleased,
    decode,
    encode,
)

M = TypeVar("M")


class BootstrapClient:
    def __init__(self, base_url: str, timeout_s: float = 2.0) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._session = requests.Session()

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
        batch = self._call("GET", f"/v1/instances/{_path(prefill_instance_id)}/destinations", None, DestinationBatch)
        assert batch is not None
        return batch.destinations

    def release_room(self, room: Room, decode_instance_id: str) -> RoomReleased:
        message = RoomRelease(room, decode_instance_id)
        released = self._call("POST", "/v1/rooms/release", message, RoomReleased)
        assert released is not None
        return released

    def abort_room(self, room: Room, reason: str = "") -> None:
        """Appends ``room`` to the service's abort log (the orchestrator's way to stop both halves)."""
        self._call("POST", "/v1/rooms/abort", RoomAbort(room, reason), RoomAbort)

    def aborted_rooms(self, after: int = -1, wait_s: float = 0.0) -> AbortLog:
        """Rooms aborted and routers gone since cursor ``after`` (-1: every retained one), with the cursor for
        the next call (``last_seq``). With ``wait_s`` > 0 the service holds the call until there is news or
        ``wait_s`` seconds (at most 30) have passed: a long poll, answered at once when there is news."""
        log = self._call("GET", f"/v1/aborts?after={int(after)}&wait_s={wait_s:g}", None, AbortLog,
                         timeout_s=self._timeout_s + wait_s)
        assert log is not None
        return log

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
        except requests.RequestException as exc:
            raise BootstrapError(f"{method} {path}: {exc}") from exc


def _path(instance_id: str) -> str:
    """An instance id as one URL path segment (ids hold ``@`` and ``:``, e.g. ``prefill@10.0.0.2:8001``)."""
    return quote(instance_id, safe="@:")
