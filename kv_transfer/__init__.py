"""KV transfer between prefill and decode instances: prefill WRITEs KV pages straight into the pages decode
reserved, over NIXL (or in-process for tests). No project imports besides ``bootstrap`` (the rendezvous).

Contract: docs/architecture.md ("KV transfer API"); protocol and lifecycles: docs/protocol.md.
"""

from __future__ import annotations

from bootstrap.errors import BootstrapError
from kv_transfer.aux import AuxData
from kv_transfer.config import KVArgs
from kv_transfer.errors import CompatibilityError, KVTransferError, TransferError
from kv_transfer.layout import KVLayout, PageId
from kv_transfer.manager import KVManager
from kv_transfer.poll import KVPoll
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, Room
from kv_transfer.transport import Transport

BACKENDS = ("nixl", "inprocess")


def make_transport(args: KVArgs, backend: str) -> Transport:
    if backend == "nixl":
        from kv_transfer.nixl_transport import NixlTransport
        return NixlTransport(args.instance_id, args.mem_type, args.device_id)
    if backend == "inprocess":
        from kv_transfer.inprocess import InProcessTransport
        return InProcessTransport(args.instance_id)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def make_kv_manager(args: KVArgs, backend: str = "nixl") -> KVManager:
    """A manager for ``args`` on ``backend`` ("nixl" or "inprocess"); nothing starts until ``start()``."""
    return KVManager(args, make_transport(args, backend))


__all__ = ["BACKENDS", "AuxData", "BootstrapError", "CompatibilityError", "KVArgs", "KVLayout",
           "KVManager", "KVPoll", "KVReceiver", "KVSender", "KVTransferError", "PageId", "Room",
           "TransferError", "make_kv_manager", "make_transport"]
