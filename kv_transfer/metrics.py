"""Counters of one manager (names carry units); updated under the manager lock."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Metrics:
    kv_bytes_total: int = 0          # KV bytes posted (prefill): whole pages, and the filled slots of a
                                     # prompt's partly filled last page (aux data not counted)
    chunks_total: int = 0            # chunks posted (prefill) or received (decode)
    transfers_total: int = 0         # rooms that reached Success
    failed_rooms_total: int = 0      # rooms that ended Failed (timeouts included)
    timed_out_rooms_total: int = 0   # rooms failed by the bootstrap or waiting timeout
    fenced_rooms_total: int = 0      # failed rooms (decode) whose writer was fenced before their pages went
                                     # back (a write failed or the writer vanished; a no-op fence on NIXL)
    skipped_pages_total: int = 0     # prompt pages not sent (prefill) / not received (decode) because decode
                                     # already held them (its prefix cache)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
