"""A small client of etcd v3's JSON gateway (``/v3/...`` over HTTP, which every etcd >= 3.4 serves on its
client port), with ``requests``: ranges, puts, leases and the watch stream, etcd auth and TLS.

Why the gateway and not a gRPC client package: ``etcd3`` (0.12, 2020) pins old protobuf/grpcio generated code
and ``aetcd`` brings its own grpcio/protobuf ranges, both beside tritonclient's grpcio and protobuf in the
same venv (a python-backend stub imports both); the gateway needs nothing beyond ``requests``, already a
dependency, and speaks the same API (keys and values base64, int64 as strings). Its one cost, a watch being an
HTTP stream, is handled by reopening it from the next revision after an idle read timeout.

``EtcdOptions.from_url`` is the only reader of the settings ``PD_ETCD_USER``, ``PD_ETCD_PASSWORD``,
``PD_ETCD_CA``, ``PD_ETCD_CERT`` and ``PD_ETCD_KEY`` (``ETCD_ENV``), from the mapping its caller passes (a
process's config layer reads them from the environment). Not thread-safe: one ``EtcdClient`` per thread.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

from bootstrap.membership.member import MembershipError

JsonObject = dict[str, Any]   # a gateway message, as json.loads gives it
#: etcd's own auth and TLS settings, by environment variable name (``EtcdOptions.from_url``)
ETCD_ENV = ("PD_ETCD_USER", "PD_ETCD_PASSWORD", "PD_ETCD_CA", "PD_ETCD_CERT", "PD_ETCD_KEY")
CODE_NOT_FOUND = 5
CODE_UNAUTHENTICATED = 16


class EtcdError(MembershipError):
    """etcd answered an error (``code`` is its gRPC code, 0 when unknown) or a watch ended."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: read everything again."""


@dataclass(frozen=True)
class EtcdOptions:
    """Where etcd is and how to log in. ``endpoints``: ``"host:port"`` each; ``user``/``password``: etcd auth
    (both or neither); ``ca``: a CA bundle path (turns on https); ``cert``/``key``: a client certificate."""

    endpoints: tuple[str, ...]
    user: str = ""
    password: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.endpoints or not all(self.endpoints):
            raise MembershipError("etcd membership needs at least one endpoint host:port")
        if bool(self.user) != bool(self.password):
            raise MembershipError("set both PD_ETCD_USER and PD_ETCD_PASSWORD, or neither")
        if bool(self.cert) != bool(self.key):
            raise MembershipError("set both PD_ETCD_CERT and PD_ETCD_KEY, or neither")

    @property
    def scheme(self) -> str:
        return "https" if self.ca or self.cert else "http"

    @classmethod
    def from_url(cls, url: str, environ: Mapping[str, str]) -> EtcdOptions:
        """``etcd://host:port[,host:port...]`` plus the ``PD_ETCD_*`` variables of ``environ``."""
        if not url.startswith("etcd://"):
            raise MembershipError(f"etcd URL {url!r} must look like etcd://host:port[,host:port...]")
        endpoints = tuple(e.strip() for e in url[len("etcd://"):].rstrip("/").split(","))
        return cls(endpoints, environ.get("PD_ETCD_USER", ""), environ.get("PD_ETCD_PASSWORD", ""),
                   environ.get("PD_ETCD_CA", ""), environ.get("PD_ETCD_CERT", ""),
                   environ.get("PD_ETCD_KEY", ""))


def b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def unb64(text: str) -> str:
    return base64.b64decode(text).decode("utf-8")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` covering every key that starts with ``prefix`` (last byte + 1; ASCII prefixes)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str          # "" for a DELETE event
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KeyValue


class EtcdClient:
    """Calls of etcd's JSON gateway; each raises ``EtcdError`` (an etcd error) or
    ``requests.RequestException`` (unreachable). Tries the endpoints in turn on a connection failure; logs in
    again when the token expired."""

    def __init__(self, options: EtcdOptions) -> None:
        self._options = options
        self._session = requests.Session()
        # Per call, not on the session: requests lets REQUESTS_CA_BUNDLE override a session's ``verify``.
        self._tls: dict[str, Any] = {}
        if options.ca:
            self._tls["verify"] = options.ca
        if options.cert:
            self._tls["cert"] = (options.cert, options.key)
        self._endpoint = 0
        self._token = ""
        self._stream: requests.Response | None = None   # the open watch stream, for ``interrupt``

    def close(self) -> None:
        self._session.close()

    def interrupt(self) -> None:
        """Ends an open ``watch`` at once (its read raises); callable from another thread. Without urllib3's
        ``shutdown`` (urllib3 < 2.3) the watch ends at its next idle timeout instead."""
        stream = self._stream
        shutdown = getattr(stream.raw, "shutdown", None) if stream is not None else None
        if shutdown is not None:
            try:
                shutdown()
            except (OSError, ValueError, RuntimeError):
                pass   # the stream closed meanwhile: nothing to interrupt

    def _url(self, path: str) -> str:
        return f"{self._options.scheme}://{self._options.endpoints[self._endpoint]}{path}"

    def _authenticate(self) -> None:
        body = {"name": self._options.user, "password": self._options.password}
        self._token = ""
        self._token = str(self._post_once("/v3/auth/authenticate", body)["token"])

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    def _post_once(self, path: str, body: JsonObject) -> JsonObject:
        response = self._session.post(self._url(path), json=body, headers=self._headers(),
                                      timeout=self._options.timeout_s, **self._tls)
        try:
            answer = response.json() if response.content else {}
        except ValueError:   # the gateway's own refusals are plain text
            answer = {"message": response.text.strip()[:200]}
        if response.status_code != 200 or "error" in answer:
            raise _error(path, answer, response.status_code)
        return dict(answer)

    def post(self, path: str, body: JsonObject) -> JsonObject:
        """One gateway call, on the next endpoint after a connection failure, logged in again after 401."""
        for attempt in range(len(self._options.endpoints)):
            try:
                if self._options.user and not self._token:
                    self._authenticate()
                try:
                    return self._post_once(path, body)
                except EtcdError as exc:
                    if exc.code != CODE_UNAUTHENTICATED or not self._options.user:
                        raise
                    self._authenticate()
                    return self._post_once(path, body)
            except requests.ConnectionError:
                self._endpoint = (self._endpoint + 1) % len(self._options.endpoints)
                self._token = ""
                if attempt == len(self._options.endpoints) - 1:
                    raise
        raise AssertionError("unreachable")

    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store's revision at the read."""
        answer = self.post("/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        kvs = [_kv(kv) for kv in answer.get("kvs", [])]
        return kvs, int(answer["header"]["revision"])

    def get(self, key: str) -> str | None:
        answer = self.post("/v3/kv/range", {"key": b64(key)})
        kvs = answer.get("kvs", [])
        return _kv(kvs[0]).value if kvs else None

    def put(self, key: str, value: str, lease_id: int = 0) -> None:
        self.post("/v3/kv/put", {"key": b64(key), "value": b64(value), "lease": str(lease_id)})

    def delete(self, key: str) -> None:
        self.post("/v3/kv/deleterange", {"key": b64(key)})

    def grant(self, ttl_s: float) -> int:
        """A new lease of ``ttl_s`` seconds (rounded up to whole seconds); its id."""
        return int(self.post("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl_s)))})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Renews the lease; its remaining TTL in seconds, 0 when etcd no longer knows it (expired)."""
        result = self.post("/v3/lease/keepalive", {"ID": str(lease_id)}).get("result", {})
        return int(result.get("TTL", 0))

    def revoke(self, lease_id: int) -> None:
        """Ends the lease and deletes its keys; an unknown lease is not an error."""
        try:
            self.post("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if exc.code != CODE_NOT_FOUND:
                raise

    def watch(self, prefix: str, start_revision: int, idle_s: float) -> Iterator[list[WatchEvent]]:
        """The changes under ``prefix`` from ``start_revision`` on, one list per etcd result. Ends normally
        after ``idle_s`` seconds without data (reopen from the next revision); raises ``WatchCompacted``,
        ``EtcdError`` (refused, or the stream ended: etcd stopped) or ``requests.RequestException``."""
        if self._options.user and not self._token:
            self.post("/v3/kv/range", {"key": b64(prefix), "limit": "1"})   # logs in
        body = {"create_request": {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        with self._session.post(self._url("/v3/watch"), json=body, headers=self._headers(), stream=True,
                                timeout=(self._options.timeout_s, idle_s), **self._tls) as response:
            self._stream = response
            if response.status_code != 200:
                raise _error("/v3/watch", response.json(), response.status_code)
            try:
                for line in response.iter_lines(
                        chunk_size=None):  # type: ignore[call-overload]  # None: as the chunks come
                    if line:
                        yield _watch_events(json.loads(line))
            except EtcdError as exc:
                if exc.code == CODE_UNAUTHENTICATED:
                    self._token = ""   # expired: the next call logs in again
                raise
            except requests.ConnectionError as exc:
                if exc.args and isinstance(exc.args[0], urllib3.exceptions.ReadTimeoutError):
                    return
                raise
            finally:
                self._stream = None
        raise EtcdError("the watch stream ended (etcd stopped?)")


def _kv(kv: JsonObject) -> KeyValue:
    return KeyValue(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))


def _watch_events(message: JsonObject) -> list[WatchEvent]:
    if "error" in message:
        raise _error("/v3/watch", message, 0)
    result: JsonObject = message.get("result", {})
    if int(result.get("compact_revision", 0)):
        raise WatchCompacted(f"watch start revision compacted (now {result['compact_revision']})")
    if result.get("canceled"):
        raise EtcdError(f"etcd refused the watch: {result.get('cancel_reason', 'canceled')}",
                        CODE_UNAUTHENTICATED if "Unauthenticated" in str(result.get("cancel_reason")) else 0)
    return [WatchEvent(e.get("type") == "DELETE", _kv(e["kv"])) for e in result.get("events", [])]


def _error(path: str, answer: JsonObject, status: int) -> EtcdError:
    message = str(answer.get("message") or answer.get("error") or f"HTTP {status}")
    code = int(answer.get("code", 0))
    if "user name is empty" in message:
        message += " (etcd has auth enabled: set PD_ETCD_USER and PD_ETCD_PASSWORD)"
    if "CommonName of client" in message:
        message += (" (with etcd auth enabled, PD_ETCD_CERT must be a certificate without a common name: the "
                    "gateway logs in by PD_ETCD_USER/PD_ETCD_PASSWORD only)")
    return EtcdError(f"etcd {path}: {message}", code)
