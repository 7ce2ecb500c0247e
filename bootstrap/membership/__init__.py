"""Fleet membership: who is in the fleet (prefill, decode and router instances), kept in a store whose loss
only freezes membership (every process keeps its last view). Backends: the embedded registry
(``http://host:port``, ``RegistryMembership`` + ``RegistryServer``) and etcd (``etcd://host:port[,...]``,
``EtcdMembership``). ``make_membership`` picks one from a URL. See docs/membership.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from bootstrap.membership.base import Membership
from bootstrap.membership.etcd import EtcdMembership
from bootstrap.membership.etcd_client import ETCD_ENV, EtcdClient, EtcdError, EtcdOptions
from bootstrap.membership.member import (
    MEMBER_VERSION,
    Member,
    MembershipError,
    MembershipView,
    MemberSignatureError,
)
from bootstrap.membership.registry_client import RegistryMembership
from bootstrap.membership.service import RegistryServer

if TYPE_CHECKING:
    from bootstrap.tls import FleetTLS


def make_membership(url: str, secret: bytes | None, etcd_settings: Mapping[str, str] | None = None,
                    tls: FleetTLS | None = None) -> Membership | None:
    """The membership backend ``url`` names, not started.

    ``""``: None (no registry: the router discovers the workers of its own tritonserver instead).
    ``http://host:port``: ``RegistryMembership`` signing with ``secret``; ``https://host:port`` with ``tls``
    (the fleet's TLS setting, ``bootstrap.tls``; with it an ``http://`` URL is refused).
    ``etcd://host:port[,host:port...]``: ``EtcdMembership`` with etcd's own auth/TLS from ``etcd_settings``
    (``PD_ETCD_USER``/``PD_ETCD_PASSWORD``, ``PD_ETCD_CA``/``PD_ETCD_CERT``/``PD_ETCD_KEY`` by name:
    ``ETCD_ENV``, as the caller's config layer read them; None: none).
    Either way ``secret`` (the fleet secret, None: none) signs the members this process announces and every
    member read must carry its signature (``MemberCheck``). Raises ``MembershipError`` for any other URL or a
    bad etcd setting.
    """
    if not url:
        return None
    if url.startswith(("http://", "https://")):
        return RegistryMembership(url, secret, tls=tls)
    if url.startswith("etcd://"):
        return EtcdMembership(EtcdOptions.from_url(url, etcd_settings or {}), secret)
    raise MembershipError(f"membership URL {url!r}: want '' (none), http://host:port (the registry) or "
                          "etcd://host:port[,host:port...]")


__all__ = ["ETCD_ENV", "MEMBER_VERSION", "EtcdClient", "EtcdError", "EtcdMembership", "EtcdOptions", "Member",
           "MemberSignatureError", "Membership", "MembershipError", "MembershipView", "RegistryMembership",
           "RegistryServer", "make_membership"]
