"""Fakes of the router's seams: a scripted ``Launcher``, a recording ``RoomAborter``, a fleet snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from bootstrap.messages import InstanceLoad, InstanceStatus
from serving.delta import Delta
from serving.router.config import RouterConfig
from serving.router.fleet import Fleet, FleetSnapshot
from serving.router.launch import ChildCall, ChildUnavailable

#: per call: a list of (delay_s, Delta | Exception); keyed by (role, instance id) or role
Script = list[tuple[float, "Delta | Exception"]]


class ScriptedLauncher:
    """``Launcher`` whose streams play scripts; records every call and every stream that was cancelled.

    A decode call with ``resume_token_ids`` (a migration) plays the next script of ``resumed``."""

    def __init__(self, scripts: dict[str, Script] | None = None,
                 by_instance: dict[str, Script] | None = None, resumed: list[Script] | None = None) -> None:
        self.scripts = scripts or {}
        self.by_instance = by_instance or {}
        self.resumed = list(resumed or [])
        self.calls: list[ChildCall] = []
        self.cancelled: list[ChildCall] = []
        self.cancelled_when_done: list[ChildCall] = []   # set by the test's runner
        self.resets: list[str] = []

    async def stream(self, call: ChildCall) -> AsyncIterator[Delta]:
        self.calls.append(call)
        script = self.by_instance.get(call.target.instance_id, self.scripts.get(call.role, []))
        if call.resume_token_ids:
            script = self.resumed.pop(0)
        finished = False
        try:
            for delay_s, item in script:
                await asyncio.sleep(delay_s)
                if isinstance(item, Exception):
                    raise item
                finished = item.final
                yield item
        finally:
            if not finished:
                self.cancelled.append(call)

    def reset(self, endpoint: str) -> None:
        self.resets.append(endpoint)

    async def close(self) -> None:
        pass


def status(instance_id: str, role: str, free_pages: int = 100, queued_tokens: int = 0, age_s: float = 0.0,
           epoch: int = 1, model: str = "") -> InstanceStatus:
    model = model or instance_id.split("@")[0]
    return InstanceStatus(instance_id, role, epoch, "127.0.0.1:8001", model,
                          InstanceLoad(num_queued_prompt_tokens=queued_tokens, num_free_pages=free_pages,
                                       num_total_pages=max(free_pages, 100), page_size=16), age_s,
                          f"http://{instance_id.split('@')[0]}:1")


def fleet_of(*statuses: InstanceStatus, config: RouterConfig | None = None,
             now: Callable[[], float] | None = None) -> Fleet:
    fleet = Fleet(config or RouterConfig(), now=now or (lambda: 100.0))
    fleet.update(FleetSnapshot(tuple(statuses), taken_s=100.0))
    return fleet


def unavailable(message: str = "connection refused") -> ChildUnavailable:
    return ChildUnavailable(message)
