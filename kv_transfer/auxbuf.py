"""The aux region of one manager: ``aux_slots`` slots of ``AUX_SLOT_BYTES``, registered with the KV region.

Decode: the destination of each room's aux data (one slot per open receiver). Prefill: the staging source of
the aux bytes of each room's last WRITE (one slot per last chunk in flight).
"""

from __future__ import annotations

import numpy as np

from kv_transfer.aux import AUX_SLOT_BYTES, AuxData


class AuxBuffer:
    def __init__(self, num_slots: int) -> None:
        # [num_slots, AUX_SLOT_BYTES] uint8, host memory
        self._data = np.zeros((num_slots, AUX_SLOT_BYTES), dtype=np.uint8)
        self._bytes = self._data.data.cast("B")   # plain byte access: no numpy on the hot path
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    @property
    def base_ptr(self) -> int:
        return int(self._data.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_ptr(self, slot: int) -> int:
        return self.base_ptr + slot * AUX_SLOT_BYTES

    def alloc(self) -> int | None:
        """A zeroed slot, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._bytes[slot * AUX_SLOT_BYTES:(slot + 1) * AUX_SLOT_BYTES] = bytes(AUX_SLOT_BYTES)
        return slot

    def free(self, slot: int) -> None:
        self._bytes[slot * AUX_SLOT_BYTES:(slot + 1) * AUX_SLOT_BYTES] = bytes(AUX_SLOT_BYTES)
        self._free.append(slot)

    def write(self, slot: int, aux: AuxData) -> None:
        self._bytes[slot * AUX_SLOT_BYTES:(slot + 1) * AUX_SLOT_BYTES] = aux.pack()

    def read(self, slot: int) -> AuxData | None:
        return AuxData.unpack(bytes(self._bytes[slot * AUX_SLOT_BYTES:(slot + 1) * AUX_SLOT_BYTES]))
