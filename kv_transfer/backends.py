"""The one place KV transfer backends are registered by name (the plugin point).

A backend is a ``Transport`` implementation; its factory takes the manager's ``KVArgs`` and returns a transport
that has not started anything (``register`` does). Adding a backend (Ascend's, say) is one new module with a
``Transport`` subclass and one ``register_backend`` call below; serving selects it with ``kv_backend`` in
``config.pbtxt``. Factories import their backend's package lazily, so an uninstalled backend costs nothing
until it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kv_transfer.config import KVArgs
from kv_transfer.transport import Transport

TransportFactory = Callable[[KVArgs], Transport]

_FACTORIES: dict[str, TransportFactory] = {}
_REQUIRES: dict[str, str] = {}   # backend → the module its transport imports


def register_backend(name: str, factory: TransportFactory, requires: str = "") -> None:
    """Makes ``factory`` the backend ``name``; ``requires`` names the module it imports (checked by
    ``unavailable_reason``). Raises ``ValueError`` when ``name`` is taken."""
    if name in _FACTORIES:
        raise ValueError(f"KV backend {name!r} is registered already")
    _FACTORIES[name] = factory
    _REQUIRES[name] = requires


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run in this process, else why not (its module does not import: not
    installed, or a system library it loads is missing). Imports that module. Raises ``ValueError`` for an
    unknown name."""
    if name not in _FACTORIES:
        raise ValueError(f"backend must be one of {backend_names()}, got {name!r}")
    if not _REQUIRES[name]:
        return None
    try:
        importlib.import_module(_REQUIRES[name])
    except ImportError as exc:
        return f"KV backend {name!r} needs {_REQUIRES[name]}: {exc}"
    return None


def backend_names() -> tuple[str, ...]:
    """Names of the registered backends, in registration order."""
    return tuple(_FACTORIES)


def make_transport(args: KVArgs, backend: str) -> Transport:
    """A fresh, unstarted transport of ``backend`` for ``args``. Raises ``ValueError`` for an unknown name,
    ``ImportError`` when the backend's package is missing."""
    factory = _FACTORIES.get(backend)
    if factory is None:
        raise ValueError(f"backend must be one of {backend_names()}, got {backend!r}")
    return factory(args)


def _nixl(args: KVArgs) -> Transport:
    from kv_transfer.nixl_transport import NixlTransport
    return NixlTransport(args.instance_id, args.mem_type, args.device_id, local_hostname=args.local_hostname,
                         network_only=args.network_only)


def _mooncake(args: KVArgs) -> Transport:
    from kv_transfer.mooncake_transport import MooncakeTransport
    return MooncakeTransport(args.instance_id, args.local_hostname, args.transport_protocol,
                             args.transport_device)


def _inprocess(args: KVArgs) -> Transport:
    from kv_transfer.inprocess import InProcessTransport
    return InProcessTransport(args.instance_id)


register_backend("nixl", _nixl, requires="nixl._api")
register_backend("mooncake", _mooncake, requires="mooncake.engine")
register_backend("inprocess", _inprocess)
