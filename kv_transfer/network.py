"""Where a transport's bytes go: the interface behind the address this instance advertises, and the UCX
settings that follow from it.

The operator gives one thing, the address peers reach this instance at (``KVArgs.local_hostname``, from
``ADVERTISE_HOST``). From it:

* ``UCX_NET_DEVICES`` is the interface that owns that address (``lo`` for a loopback address), so UCX's TCP
  transport listens and connects where peers can reach it, and only there. On a host with RDMA devices it is
  left to UCX (which prefers RDMA and adds TCP on every interface). An address no interface owns (NAT, a name
  that does not resolve here) leaves it to UCX too, with a warning.
* ``network_only`` (``NixlOptions.network_only``: ``kv_network_only``, ``PD_KV_NETWORK_ONLY=1``) sets
  ``UCX_TLS`` so the bytes never take shared memory or ``cma``: ``tcp,self`` without RDMA devices, ``^sm``
  with them. Only needed where "hosts" share one kernel (network namespaces, ``scripts/fleet/netns.py``): on
  separate machines UCX has no shared-memory path between them anyway.
* No UCX TCP tuning: socket buffers, segment sizes and polling were tried against raw TCP on one link and none
  moved the figures beyond the noise of this (shared) machine (docs/multihost.md, "Tuning").

Settings the operator put in the environment always win (``os.environ.setdefault``). This is the one module of
``kv_transfer`` that touches the environment, and only for the transport libraries' own variables (UCX's
``UCX_*``, Mooncake's ``MC_*``), which those libraries read from it themselves: ``apply`` puts defaults there
(``kv_transfer.nixl_transport`` before UCX is initialised, ``kv_transfer.mooncake_transport`` before its
engine starts), ``library_setting`` reads back what a library sees, ``reachability_warnings`` checks them.
The project's own settings come from the config layer (``serving.config``) as values.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping

LOOPBACK_DEVICE = "lo"
INFINIBAND_SYSFS = "/sys/class/infiniband"
SIOCGIFADDR = 0x8915
#: UCX's transports that cross a network (UCX_TLS names); any of them in UCX_TLS lets peers on other hosts in.
NETWORK_TLS = ("tcp", "rc", "rc_x", "rc_v", "ud", "ud_x", "ud_v", "dc", "dc_x", "ib", "all")


def has_rdma_devices() -> bool:
    """True when the kernel lists RDMA devices (``/sys/class/infiniband``)."""
    return os.path.isdir(INFINIBAND_SYSFS) and bool(os.listdir(INFINIBAND_SYSFS))


def resolve_ipv4(host: str) -> str | None:
    """``host`` as a dotted IPv4 address (names resolved here), or None when it does not resolve to one."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8 (and names that resolve there, ``localhost``)."""
    address = resolve_ipv4(host)
    return address is not None and ipaddress.IPv4Address(address).is_loopback


def interface_for(host: str) -> str | None:
    """The name of this network namespace's interface whose (primary) IPv4 address is ``host``'s; ``lo`` for
    a loopback address; None when no interface has it (or it is not IPv4)."""
    address = resolve_ipv4(host)
    if address is None:
        return None
    if ipaddress.IPv4Address(address).is_loopback:
        return LOOPBACK_DEVICE
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue   # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def ucx_settings(local_hostname: str, network_only: bool = False, rdma: bool | None = None) -> dict[str, str]:
    """The UCX variables for an instance that advertises ``local_hostname`` (see the module docstring):
    ``UCX_MM_ERROR_HANDLING=y`` (notifications through shared memory on one host), ``UCX_MODULES=^ib`` without
    RDMA devices (``kv_transfer.nixl_transport.ucx_defaults`` says why), ``UCX_NET_DEVICES``, and ``UCX_TLS``
    with ``network_only``. ``rdma``: None asks the kernel."""
    rdma = has_rdma_devices() if rdma is None else rdma
    settings = {} if network_only else {"UCX_MM_ERROR_HANDLING": "y"}   # unused (and warned about) without sm
    if not rdma:
        settings["UCX_MODULES"] = "^ib"
    device = interface_for(local_hostname)
    if device is not None and (device == LOOPBACK_DEVICE or not rdma):
        settings["UCX_NET_DEVICES"] = device
    if network_only:
        settings["UCX_TLS"] = "^sm" if rdma else "tcp,self"
    return settings


def apply(settings: Mapping[str, str]) -> dict[str, str]:
    """Puts ``settings`` into ``os.environ`` where the operator set nothing; returns the values now in force
    for those keys."""
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in settings}


def library_setting(name: str, default: str = "") -> str:
    """The value of a transport library's environment variable ``name`` as the library reads it (``default``
    when unset)."""
    return os.environ.get(name, default)


def _tls_reach_network(tls: str) -> bool:
    """True when ``UCX_TLS`` (``a,b`` or ``^a,b``: all but those) lets a network transport in."""
    names = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
    if tls.strip().startswith("^"):
        return "tcp" not in names or has_rdma_devices()
    return bool(names & set(NETWORK_TLS))


def reachability_warnings(local_hostname: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why peers on other hosts could not reach this instance's transport with the settings in ``environ``
    (``os.environ`` when None); empty when nothing is wrong or ``local_hostname`` is loopback (one host)."""
    env = os.environ if environ is None else environ
    address = resolve_ipv4(local_hostname)
    if address is None:
        return [f"the advertised address {local_hostname!r} does not resolve to IPv4 here"]
    if ipaddress.IPv4Address(address).is_loopback:
        return []
    out = []
    device = interface_for(address)
    if device is None:
        out.append(f"no interface here has the advertised address {address} (NAT or a wrong "
                   "ADVERTISE_HOST?): peers may not reach this instance at it")
    devices = [d.strip() for d in env.get("UCX_NET_DEVICES", "all").split(",")]
    if "all" not in devices and device is not None and not any(d.split(":")[0] == device for d in devices):
        out.append(f"UCX_NET_DEVICES={env['UCX_NET_DEVICES']} leaves out {device}, the interface of the "
                   f"advertised address {address}: peers on other hosts cannot reach this instance "
                   f"(unset UCX_NET_DEVICES to use {device})")
    tls = env.get("UCX_TLS", "")
    if tls and not _tls_reach_network(tls):
        out.append(f"UCX_TLS={tls} has no network transport: peers on other hosts cannot reach this instance")
    return out
