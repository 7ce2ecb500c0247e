"""The one place KV transfer backends are registered by name (the plugin point).

A backend is a ``Transport`` implementation with its own options (a ``BackendOptions`` dataclass, next to the
transport in its module) and a factory that takes the manager's ``KVArgs`` and those options and returns a
transport that has not started anything (``register`` does). Adding a backend (Ascend's, say) is two files:
one new module with the ``Transport`` subclass, its options and its factory, and one ``register_backend`` line
below. Serving selects it with ``kv_backend`` in ``config.pbtxt`` and reads its options from the parameters
``kv_<option>`` (``parse_options``); nothing in ``serving`` or ``KVArgs`` names a backend's option. The
transport modules import their backend's package lazily (in ``register``), so an uninstalled backend costs
nothing until it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

from kv_transfer.config import KVArgs
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.mooncake_transport import MooncakeOptions, MooncakeTransport
from kv_transfer.nixl_transport import NixlOptions, NixlTransport
from kv_transfer.transport import BackendOptions, OptionError, Transport

__all__ = ["BackendOptions", "OptionError", "backend_names", "make_transport", "option_parameters",
           "options_type", "parse_options", "register_backend", "unavailable_reason"]

_O = TypeVar("_O", bound=BackendOptions)


@dataclass(frozen=True)
class _Backend:
    factory: Callable[[KVArgs, BackendOptions], Transport]
    options: type[BackendOptions]
    requires: str          # the module its transport imports ("" for none)


_BACKENDS: dict[str, _Backend] = {}


def register_backend(name: str, factory: Callable[[KVArgs, _O], Transport], options: type[_O],
                     requires: str = "") -> None:
    """Makes ``factory`` the backend ``name``, taking options of type ``options`` (``BackendOptions``: none);
    ``requires`` names the module its transport imports (checked by ``unavailable_reason``). Raises
    ``ValueError`` when ``name`` is taken."""
    if name in _BACKENDS:
        raise ValueError(f"KV backend {name!r} is registered already")
    _BACKENDS[name] = _Backend(cast(Callable[[KVArgs, BackendOptions], Transport], factory), options,
                               requires)


def _backend(name: str) -> _Backend:
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"backend must be one of {backend_names()}, got {name!r}")
    return backend


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run in this process, else why not (its module does not import: not
    installed, or a system library it loads is missing). Imports that module. Raises ``ValueError`` for an
    unknown name."""
    backend = _backend(name)
    if not backend.requires:
        return None
    try:
        importlib.import_module(backend.requires)
    except ImportError as exc:
        return f"KV backend {name!r} needs {backend.requires}: {exc}"
    return None


def backend_names() -> tuple[str, ...]:
    """Names of the registered backends, in registration order."""
    return tuple(_BACKENDS)


def options_type(name: str) -> type[BackendOptions]:
    """The options class of backend ``name``. Raises ``ValueError`` for an unknown name."""
    return _backend(name).options


def option_parameters() -> dict[str, tuple[str, ...]]:
    """Every backend's model parameters: ``{"kv_protocol": ("mooncake",), ...}`` (parameter -> the backends
    owning it), for serving to tell a backend's parameter from an unknown one."""
    owners: dict[str, tuple[str, ...]] = {}
    for name, backend in _BACKENDS.items():
        for param in backend.options.parameters():
            owners[param] = owners.get(param, ()) + (name,)
    return owners


def parse_options(name: str, parameters: Mapping[str, str],
                  environ: Mapping[str, str] | None = None) -> BackendOptions:
    """Backend ``name``'s options from model parameters (``{"kv_protocol": "rdma", ...}``: its own are read,
    the rest ignored) and ``environ`` (its ``ENV`` overrides; None: none). Raises ``ValueError`` for an
    unknown backend, ``OptionError`` for a value its options refuse."""
    return _backend(name).options.parse(parameters, environ)


def make_transport(args: KVArgs, backend: str, options: BackendOptions | None = None) -> Transport:
    """A fresh, unstarted transport of ``backend`` for ``args`` with ``options`` (None: the backend's
    defaults). Raises ``ValueError`` for an unknown name or options of another backend's type, ``ImportError``
    when the backend's package is missing (at ``register`` for the built-in ones)."""
    entry = _backend(backend)
    if options is None:
        options = entry.options()
    elif type(options) is not entry.options:
        raise ValueError(f"KV backend {backend!r} takes {entry.options.__name__}, "
                         f"got {type(options).__name__}")
    return entry.factory(args, options)


register_backend("nixl", NixlTransport.create, NixlOptions, requires="nixl._api")
register_backend("mooncake", MooncakeTransport.create, MooncakeOptions, requires="mooncake.engine")
register_backend("inprocess", InProcessTransport.create, BackendOptions)
