"""``RegistryMembership``: membership through the embedded registry (``bootstrap.membership.service``).

One thread (``membership-registry-client``) does everything, every ``refresh_s``: removes withdrawn members,
registers announced ones not yet registered (PUT), renews the others when due (keepalive every ``ttl_s / 3``;
a 404 means the registry lost them, restarted empty or expired them: PUT again), then reads the member list
into the view. Any failure marks the view stale (``fresh=False``, last members kept) and the next tick
retries. Every request is signed with the fleet secret (``HmacAuth``) when one is set, and so is every
announced member (``Member.signed``): the view holds only the listed members whose record ``MemberCheck``
accepts (signed with the secret; not an older epoch than one read before), whatever the registry answers, so
an open or compromised registry cannot add or redirect members. With the fleet's TLS setting
(``bootstrap.tls``) the registry must be ``https://``, its certificate one the fleet's CA signed for its host.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import quote

import requests

from bootstrap.auth import HmacAuth
from bootstrap.membership.base import Announced, Announcements, MemberCheck, Membership, ViewState
from bootstrap.membership.member import MEMBER_VERSION, Member, MembershipError, MembershipView

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS

logger = logging.getLogger(__name__)


def _member_path(instance_id: str) -> str:
    return "/v1/members/" + quote(instance_id, safe="@:")


class RegistryMembership(Membership):
    """Membership kept in a registry at ``url`` (``http://host:port``, ``https://`` with TLS); see the module
    docstring.

    ``timeout_s`` bounds every HTTP call (so one tick takes at most a few of them when the registry hangs).
    ``tls``: the fleet's TLS setting (the registry is checked against its CA). Raises ``MembershipError`` for
    an ``http://`` URL with TLS.
    """

    def __init__(self, url: str, secret: bytes | None, refresh_s: float = 0.25, timeout_s: float = 1.0,
                 tls: FleetTLS | None = None) -> None:
        if tls is not None and url.startswith("http://"):
            raise MembershipError(f"registry {url} is plaintext, but this fleet speaks TLS (PD_TLS_* are "
                                  "set): give its https:// URL")
        self._url = url.rstrip("/")
        self._refresh_s = refresh_s
        self._timeout_s = timeout_s
        self._session = requests.Session()
        if tls is not None:
            tls.apply(self._session)
        self._session.auth = HmacAuth(secret) if secret is not None else None
        self._announced = Announcements()
        self._state = ViewState(logger, self._url)
        self._check = MemberCheck(secret, logger, self._url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="membership-registry-client", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        for entry in self._announced.take_all():
            if time.monotonic() >= deadline:
                break
            try:
                self._delete(entry)
            except (requests.RequestException, MembershipError) as exc:
                logger.warning("withdrawing %s on stop failed (%s): it expires by TTL",
                               entry.member.instance_id,
                               exc)
        self._session.close()

    def announce(self, member: Member, ttl_s: float = 10.0) -> None:
        self._announced.add(self._check.sign(member), ttl_s)

    def withdraw(self, instance_id: str) -> None:
        self._announced.remove(instance_id)

    def view(self) -> MembershipView:
        return self._state.get()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except (requests.RequestException, MembershipError, ValueError) as exc:
                self._state.mark_failed(str(exc))
            self._stop.wait(self._refresh_s)

    def _tick(self) -> None:
        for entry in self._announced.take_withdrawn():
            self._delete(entry)
        now_s = time.monotonic()
        for entry in self._announced.entries():
            if not entry.registered:
                self._put(entry)
            elif now_s >= entry.renew_at_s:
                self._keepalive(entry)
        self._read()

    def _request(self, method: str, path: str, **kwargs: object) -> requests.Response:
        response = self._session.request(method, self._url + path, timeout=self._timeout_s,
                                         **kwargs)  # type: ignore[arg-type]
        if response.status_code in (400, 401, 403):
            raise MembershipError(f"{method} {path}: HTTP {response.status_code}: {_reason(response)}")
        return response

    def _put(self, entry: Announced) -> None:
        member = entry.member
        body = {"version": MEMBER_VERSION, "member": member.to_dict(), "ttl_s": entry.ttl_s}
        response = self._request("PUT", _member_path(member.instance_id), json=body)
        if response.status_code == 409:
            logger.error("not announcing %s epoch %d any more: %s", member.instance_id, member.epoch,
                         _reason(response))
            self._announced.drop(member.instance_id)
            return
        response.raise_for_status()
        entry.registered, entry.renew_at_s = True, time.monotonic() + entry.ttl_s / 3
        logger.info("announced %s %s epoch %d", member.role, member.instance_id, member.epoch)

    def _keepalive(self, entry: Announced) -> None:
        member = entry.member
        response = self._request("POST", _member_path(member.instance_id) + "/keepalive",
                                 params={"epoch": str(member.epoch)})
        if response.status_code == 404:
            logger.warning("registry no longer holds %s: registering it again", member.instance_id)
            self._put(entry)
            return
        response.raise_for_status()
        entry.renew_at_s = time.monotonic() + entry.ttl_s / 3

    def _delete(self, entry: Announced) -> None:
        response = self._request("DELETE", _member_path(entry.member.instance_id),
                                 params={"epoch": str(entry.member.epoch)})
        if response.status_code not in (200, 404):
            response.raise_for_status()

    def _read(self) -> None:
        response = self._request("GET", "/v1/members")
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, dict) or body.get("version") != MEMBER_VERSION:
            raise MembershipError(f"GET /v1/members: answer of another version ({str(body)[:80]})")
        listed = body.get("members")
        if not isinstance(listed, list):
            raise MembershipError(f"GET /v1/members: 'members' is not a list ({str(listed)[:80]})")
        newest: dict[str, Member] = {}   # one record per id (a registry that lists two: the newer epoch)
        for record in listed:
            member = self._check.accept(record, _member_path(_id_of(record)))
            if member is not None and member.epoch >= newest.get(member.instance_id, member).epoch:
                newest[member.instance_id] = member
        self._state.publish(newest.values())


def _id_of(record: object) -> str:
    """The instance id a listed record claims (for the log line), ``"?"`` when it has none."""
    instance_id = record.get("instance_id") if isinstance(record, dict) else None
    return instance_id if isinstance(instance_id, str) and instance_id else "?"


def _reason(response: requests.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
