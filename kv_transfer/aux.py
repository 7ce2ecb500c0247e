"""Per-request aux data written with the final chunk into the decode instance's aux region.

Slot format (little-endian, ``AUX_SLOT_BYTES`` bytes): magic u32, reserved u32, room u64,
first_token_id i64, first_logprob f64. A zeroed slot has no magic, so a slot that was never written
cannot pass for a written one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_FORMAT = "<IIQqd"
AUX_MAGIC = 0x4B565831  # "KVX1"
AUX_SLOT_BYTES = 32
assert struct.calcsize(_FORMAT) == AUX_SLOT_BYTES


@dataclass(frozen=True)
class AuxData:
    """What decode needs besides the KV to continue: the first sampled token and the room it belongs to."""

    first_token_id: int
    first_logprob: float
    room: int

    def pack(self) -> bytes:
        return struct.pack(_FORMAT, AUX_MAGIC, 0, self.room, self.first_token_id, self.first_logprob)

    @classmethod
    def unpack(cls, data: bytes) -> AuxData | None:
        """The aux data in ``data``, or None when the slot holds no valid record."""
        magic, _, room, token_id, logprob = struct.unpack(_FORMAT, bytes(data[:AUX_SLOT_BYTES]))
        if magic != AUX_MAGIC:
            return None
        return cls(first_token_id=token_id, first_logprob=logprob, room=room)
