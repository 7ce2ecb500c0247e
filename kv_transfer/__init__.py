"""KV transfer between prefill and decode instances: prefill WRITEs KV pages straight into the pages decode
reserved, over a registered backend (NIXL, Mooncake, or in-process for tests). No project imports besides
``bootstrap`` (the rendezvous).

Contract: docs/architecture.md ("KV transfer API"); protocol and lifecycles: docs/protocol.md.
"""

from __future__ import annotations

from bootstrap.errors import BootstrapError
from kv_transfer.aux import AuxData
from kv_transfer.backends import (
    backend_names,
    make_transport,
    option_parameters,
    options_type,
    parse_options,
    register_backend,
    unavailable_reason,
)
from kv_transfer.base import BaseKVManager, BaseKVReceiver, BaseKVSender
from kv_transfer.config import KVArgs
from kv_transfer.errors import CompatibilityError, KVTransferError, TransferError
from kv_transfer.layout import KVLayout, PageId
from kv_transfer.manager import KVManager
from kv_transfer.poll import KVPoll
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, Room
from kv_transfer.transport import BackendOptions, OptionError, Transport

BACKENDS = backend_names()   # the built-in ones; ``backend_names()`` also lists later registrations


def make_kv_manager(args: KVArgs, backend: str = "nixl",
                    options: BackendOptions | None = None) -> BaseKVManager:
    """A manager for ``args`` on the registered ``backend`` (``kv_transfer.backends``) with that backend's
    ``options`` (None: its defaults); nothing starts until ``start()``. Raises ``ValueError`` for an unknown
    backend or options of another backend, ``ImportError`` when its package is missing."""
    return KVManager(args, make_transport(args, backend, options))


__all__ = ["BACKENDS", "AuxData", "BackendOptions", "BaseKVManager", "BaseKVReceiver", "BaseKVSender",
           "BootstrapError", "CompatibilityError", "KVArgs", "KVLayout", "KVManager", "KVPoll", "KVReceiver",
           "KVSender", "KVTransferError", "OptionError", "PageId", "Room", "TransferError", "Transport",
           "backend_names", "make_kv_manager", "make_transport", "option_parameters", "options_type",
           "parse_options", "register_backend", "unavailable_reason"]
