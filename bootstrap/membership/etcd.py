"""``EtcdMembership``: membership in etcd. Each announced member is one key ``/triton-pd/members/<id>``
holding ``Member.to_json()``, attached to its own lease (TTL = the member's ``ttl_s``, whole seconds).
With a fleet secret the JSON is signed (``Member.signed``) and the view holds only the keys whose record
``MemberCheck`` accepts (signed with the secret, under the key of its own instance id, not an older epoch);
a key written by anyone else is left out and logged, so an etcd others can write cannot add or redirect
members (deleting keys it still can: etcd's auth is what stops that, docs/membership.md).

Threads (both daemon, both named, both ended by ``stop``):
  ``membership-etcd-lease``  every ``tick_s``: revokes the leases of withdrawn members (etcd deletes their
  keys
      at once); grants a lease and puts the key of each member not yet registered; renews each lease every
      ``ttl_s / 3`` and reads its key back: a lease etcd no longer knows (expired during an outage, or a wiped
      etcd) is granted again and the key put again, so is a key deleted or overwritten by another writer (a
      forged record there comes back to ours within ``ttl_s / 3``). Before a put the key is read: a newer
      epoch there means a successor process holds the id, and this one stops announcing it (logged as an
      error); a record there that is not genuine (not signed with the fleet secret) is overwritten.
  ``membership-etcd-watch``  reads every key under the prefix (the view), then watches the prefix from the
      next revision and applies each change. The watch stream is reopened from the next revision after
      ``watch_idle_s`` without data (which also proves etcd still answers: the view stays fresh). A broken
      stream or failed call marks the view stale (last members kept) and, on recovery, the prefix is read
      whole again before watching; a compacted start revision does the same.
Failures never raise out of a method; the first failure of an outage is logged once (``ViewState``).
"""

from __future__ import annotations

import logging
import threading
import time

import requests

from bootstrap.membership.base import Announced, Announcements, MemberCheck, Membership, ViewState
from bootstrap.membership.etcd_client import EtcdClient, EtcdError, EtcdOptions, WatchCompacted
from bootstrap.membership.member import Member, MembershipError, MembershipView

logger = logging.getLogger(__name__)
PREFIX = "/triton-pd/members/"


class EtcdMembership(Membership):
    """Membership in the etcd cluster of ``options``; see the module docstring. ``secret``: the fleet secret
    that signs the announced members and that every record read must carry (None: nothing signed or
    checked)."""

    def __init__(self, options: EtcdOptions, secret: bytes | None = None, tick_s: float = 0.25,
                 watch_idle_s: float = 1.0, retry_s: float = 0.5) -> None:
        self._options = options
        self._check = MemberCheck(secret, logger, "etcd://" + ",".join(options.endpoints))
        self._tick_s, self._watch_idle_s, self._retry_s = tick_s, watch_idle_s, retry_s
        self._announced = Announcements()
        self._state = ViewState(logger, "etcd://" + ",".join(options.endpoints))
        self._lease_health = ViewState(logger, "etcd://" + ",".join(options.endpoints) + " (leases)")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_client: EtcdClient | None = None    # the watch thread's, so that stop can interrupt it

    def start(self) -> None:
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._lease_loop, name="membership-etcd-lease", daemon=True),
                         threading.Thread(target=self._watch_loop, name="membership-etcd-watch", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._watch_client is not None:
            self._watch_client.interrupt()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        client = EtcdClient(self._options)
        try:
            for entry in self._announced.take_all():
                if time.monotonic() >= deadline:
                    break
                self._remove(client, entry)
        finally:
            client.close()

    def announce(self, member: Member, ttl_s: float = 10.0) -> None:
        self._announced.add(self._check.sign(member), ttl_s)

    def withdraw(self, instance_id: str) -> None:
        self._announced.remove(instance_id)

    def view(self) -> MembershipView:
        return self._state.get()

    # -- leases ---------------------------------------------------------------------------------------------

    def _lease_loop(self) -> None:
        client = EtcdClient(self._options)
        try:
            while not self._stop.is_set():
                try:
                    self._lease_tick(client)
                except (requests.RequestException, MembershipError, ValueError, KeyError) as exc:
                    self._lease_health.mark_failed(str(exc))
                self._stop.wait(self._tick_s)
        finally:
            client.close()

    def _lease_tick(self, client: EtcdClient) -> None:
        for entry in self._announced.take_withdrawn():
            self._remove(client, entry)
        now_s = time.monotonic()
        for entry in self._announced.entries():
            if not entry.registered or entry.lease_id == 0:
                self._register(client, entry)
            elif now_s >= entry.renew_at_s:
                if client.keepalive(entry.lease_id) <= 0:
                    logger.warning("etcd lost the lease of %s: registering it again",
                                   entry.member.instance_id)
                    self._register(client, entry)
                elif client.get(PREFIX + entry.member.instance_id) != entry.member.to_json():
                    logger.warning("the etcd key of %s no longer holds its record (deleted or overwritten by "
                                   "another writer): putting it again", entry.member.instance_id)
                    self._register(client, entry)
                else:
                    entry.renew_at_s = time.monotonic() + entry.ttl_s / 3
        self._lease_health.touch()

    def _register(self, client: EtcdClient, entry: Announced) -> None:
        member, key = entry.member, PREFIX + entry.member.instance_id
        held = self._held_epoch(client.get(key))
        if held > member.epoch:
            logger.error("not announcing %s epoch %d any more: etcd holds epoch %d (a newer process)",
                         member.instance_id, member.epoch, held)
            self._announced.drop(member.instance_id)
            return
        if entry.lease_id and client.keepalive(entry.lease_id) <= 0:
            entry.lease_id = 0
        if entry.lease_id == 0:
            entry.lease_id = client.grant(entry.ttl_s)
        client.put(key, member.to_json(), entry.lease_id)
        entry.registered, entry.renew_at_s = True, time.monotonic() + entry.ttl_s / 3
        logger.info("announced %s %s epoch %d (lease %x, ttl %.0f s)", member.role, member.instance_id,
                    member.epoch, entry.lease_id, entry.ttl_s)

    def _remove(self, client: EtcdClient, entry: Announced) -> None:
        try:
            if entry.lease_id:
                client.revoke(entry.lease_id)    # deletes the key with it
            elif entry.registered:
                client.delete(PREFIX + entry.member.instance_id)
        except (requests.RequestException, EtcdError) as exc:
            logger.warning("withdrawing %s failed (%s): it expires with its lease",
                           entry.member.instance_id, exc)

    # -- view -----------------------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        client = self._watch_client = EtcdClient(self._options)
        members: dict[str, Member] = {}
        revision, reread = 0, True
        try:
            while not self._stop.is_set():
                try:
                    if reread:
                        members, revision = self._read_all(client)
                        reread = False
                    for events in client.watch(PREFIX, revision + 1, self._watch_idle_s):
                        for event in events:
                            self._apply(members, event.kv.key, event.kv.value, event.deleted)
                            revision = max(revision, event.kv.mod_revision)
                        self._state.publish(members.values())
                        if self._stop.is_set():
                            break
                    self._state.touch()
                except WatchCompacted:
                    reread = True
                except (requests.RequestException, MembershipError, ValueError, KeyError) as exc:
                    if self._stop.is_set():
                        break   # interrupted by stop()
                    self._state.mark_failed(str(exc))
                    reread = True
                    self._stop.wait(self._retry_s)
        finally:
            client.close()

    def _read_all(self, client: EtcdClient) -> tuple[dict[str, Member], int]:
        kvs, revision = client.range_prefix(PREFIX)
        members: dict[str, Member] = {}
        for kv in kvs:
            self._apply(members, kv.key, kv.value, False)
        self._state.publish(members.values())
        return members, revision

    def _apply(self, members: dict[str, Member], key: str, value: str, deleted: bool) -> None:
        """One key's change into ``members`` (keyed by etcd key): a record ``MemberCheck`` refuses (logged
        there) leaves the key out, also when it replaced an accepted one."""
        member = None if deleted else self._check.accept(value, key, key.removeprefix(PREFIX))
        if member is None:
            members.pop(key, None)
        else:
            members[key] = member

    def _held_epoch(self, value: str | None) -> int:
        """The epoch of the genuine record ``value`` (-1: none, unreadable, or not signed by this fleet)."""
        try:
            member = Member.from_json(value) if value is not None else None
        except MembershipError:
            return -1
        return member.epoch if member is not None and self._check.genuine(member) else -1
