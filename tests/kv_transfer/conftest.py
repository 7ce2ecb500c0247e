"""Fixtures of the KV transfer tests: prefill/decode sides on each backend (in-process: both in this process;
nixl and mooncake: each a real OS process on loopback), each hosting its own rendezvous on a free port."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kv_harness import LocalSide, RemoteSide

from kv_transfer import unavailable_reason

_ids = itertools.count()
# a stopped peer must fail a Mooncake write within seconds here (the product's default is 10 s); the spawned
# side processes inherit it
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "3")


SideFactory = Callable[..., Any]


@pytest.fixture(scope="module", params=["inprocess", pytest.param("nixl", marks=pytest.mark.nixl),
                                        pytest.param("mooncake", marks=pytest.mark.mooncake)])
def make_side(request: pytest.FixtureRequest) -> Iterator[SideFactory]:
    """``make_side(role, instance_id=None, **kv_overrides)``: a started side on this module's backend."""
    backend = request.param   # every contract test runs on each backend
    reason = unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    sides: list[Any] = []

    def make(role: str, instance_id: str | None = None, **overrides: Any) -> Any:
        instance_id = instance_id or f"{role}-{backend}-{next(_ids)}"
        cls = LocalSide if backend == "inprocess" else RemoteSide
        side = cls(role, instance_id, backend, **overrides)
        side.start_free = side.call("start")
        side.rendezvous_url = side.call("rendezvous_url")
        sides.append(side)
        return side

    make.backend = backend  # type: ignore[attr-defined]
    yield make
    for side in sides:
        if isinstance(side, RemoteSide):
            side.close()
        else:
            with contextlib.suppress(Exception):  # a crashed side has nothing left to stop
                side.call("stop")


@pytest.fixture(scope="module")
def pair(make_side: SideFactory) -> tuple[Any, Any]:
    """A prefill and a decode side shared by the tests of one module (each test uses its own rooms)."""
    return make_side("prefill"), make_side("decode")
