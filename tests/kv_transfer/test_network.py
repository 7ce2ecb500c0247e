"""The transport's network settings follow the advertised address (``kv_transfer.network``): loopback pins UCX
to ``lo``, a host's address to the interface that owns it, network-only keeps UCX off shared memory, and the
start-up check names each configuration that cannot reach other hosts."""

from __future__ import annotations

import socket

import pytest

from kv_transfer import network


def _own_address() -> tuple[str, str] | None:
    """(interface, address) of a non-loopback IPv4 interface of this machine, if any."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        try:
            import fcntl
            import struct
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                raw = fcntl.ioctl(sock.fileno(), network.SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            return name, socket.inet_ntoa(raw[20:24])
        except OSError:
            continue
    return None


def test_loopback_pins_ucx_to_lo() -> None:
    settings = network.ucx_settings("127.0.0.1", rdma=False)
    assert settings["UCX_NET_DEVICES"] == "lo" and "UCX_TLS" not in settings
    assert settings["UCX_MODULES"] == "^ib" and settings["UCX_MM_ERROR_HANDLING"] == "y"
    assert network.interface_for("localhost") == "lo"


def test_network_only_keeps_ucx_off_shared_memory() -> None:
    assert network.ucx_settings("127.0.0.1", network_only=True, rdma=False)["UCX_TLS"] == "tcp,self"
    assert network.ucx_settings("127.0.0.1", network_only=True, rdma=True)["UCX_TLS"] == "^sm"
    assert "UCX_MM_ERROR_HANDLING" not in network.ucx_settings("127.0.0.1", network_only=True, rdma=False)


def test_a_hosts_address_selects_its_interface() -> None:
    own = _own_address()
    if own is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = own
    assert network.interface_for(address) == name
    assert network.ucx_settings(address, rdma=False)["UCX_NET_DEVICES"] == name
    assert "UCX_NET_DEVICES" not in network.ucx_settings(address, rdma=True)   # RDMA: UCX chooses


def test_an_address_no_interface_owns_is_left_to_ucx_with_a_warning() -> None:
    assert "UCX_NET_DEVICES" not in network.ucx_settings("198.51.100.7", rdma=False)
    warnings = network.reachability_warnings("198.51.100.7", environ={})
    assert len(warnings) == 1 and "no interface here has" in warnings[0]


def test_start_up_check_names_a_pin_to_lo() -> None:
    own = _own_address()
    if own is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    name, address = own
    assert network.reachability_warnings(address, {"UCX_NET_DEVICES": name}) == []
    assert network.reachability_warnings(address, {}) == []
    pinned = network.reachability_warnings(address, {"UCX_NET_DEVICES": "lo"})
    assert len(pinned) == 1 and "UCX_NET_DEVICES=lo leaves out" in pinned[0] and name in pinned[0]
    shm = network.reachability_warnings(address, {"UCX_TLS": "sm,self"})
    assert len(shm) == 1 and "no network transport" in shm[0]
    assert network.reachability_warnings("127.0.0.1", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "sm"}) == []
    assert network.reachability_warnings("no-such-host.invalid", {})[0].startswith("the advertised address")


def test_operator_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    monkeypatch.delenv("UCX_TLS", raising=False)
    in_force = network.apply({"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"})
    assert in_force == {"UCX_NET_DEVICES": "eth7", "UCX_TLS": "tcp,self"}
