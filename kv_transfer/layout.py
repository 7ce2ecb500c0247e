"""KV pool layout math (the contract in docs/architecture.md) and the handshake compatibility check.

The pool of one engine instance is one contiguous, page-major region, head-major inside a page:
``[num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]`` (dim 3: 0 = K, 1 = V). Page ``p`` (every
head and layer, K and V) is the one contiguous range ``[p * page_bytes, (p + 1) * page_bytes)``; its KV head
``h`` is the range of ``page_head_bytes`` from ``p * page_bytes + h * page_head_bytes`` (so heads ``[a, b)``
of a page are one range); the block of page ``p``, head ``h``, layer ``l``, K or V (``kv``), ``page_size``
vectors, starts at ``(((p * num_kv_heads + h) * num_layers + l) * 2 + kv) * block_bytes``. Version history: 1
was layer-major (``[num_layers, 2, num_pages, ...]``, a page was ``2 * num_layers`` separate blocks); 2 was
page-major with the heads innermost (``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``: a
token's heads contiguous, so one head range of a page was one span per token, layer and plane); 3 is
head-major inside the page. The version is part of the compatibility hash.

``kind`` names what a token's KV is: ``"mha"`` (K and V planes of ``num_kv_heads`` heads, as above) or
``"mla"`` (multi-head latent attention, DeepSeek-V2/V3: one plane holding the latent ``c_kv | k_pe``, one
"head" of ``kv_lora_rank + qk_rope_head_dim``, no V): the 2 above becomes ``num_planes`` (1 for MLA). Peers
compare it by name, so an MLA pool never pairs with an MHA pool of equal byte sizes. It enters the hash only
when not ``"mha"``: dense layouts keep the hash they had before the field existed, and a peer whose JSON lacks
it is ``"mha"``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kv_transfer.errors import CompatibilityError

LAYOUT_VERSION = 3
PageId = int

_ITEMSIZE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1}
#: KV layout kinds and their planes per (page, layer)
KV_KINDS = {"mha": 2, "mla": 1}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one instance's KV pool. ``num_pages`` may differ between peers; nothing else may."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    version: int = LAYOUT_VERSION
    weight_quant: str = "none"  # the producing weights' format: KV of int8 weights differs from fp32's
    kind: str = "mha"           # "mha" (K and V planes) or "mla" (one latent plane): see the module docstring

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _ITEMSIZE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} not one of {sorted(_ITEMSIZE_BYTES)}")
        if self.kind not in KV_KINDS:
            raise ValueError(f"KVLayout.kind {self.kind!r} not one of {sorted(KV_KINDS)}")

    @property
    def num_planes(self) -> int:
        """Planes per (page, layer): 2 (K, V) for ``"mha"``, 1 (the latent) for ``"mla"``."""
        return KV_KINDS[self.kind]

    @property
    def itemsize_bytes(self) -> int:
        return _ITEMSIZE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one (page, head, layer, plane) block: ``page_size`` vectors of ``head_dim``."""
        return self.page_size * self.head_dim * self.itemsize_bytes

    @property
    def page_head_bytes(self) -> int:
        """Bytes of one KV head in one page, every layer and plane (one contiguous range)."""
        return self.num_layers * self.num_planes * self.block_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page summed over all heads, layers and planes."""
        return self.num_kv_heads * self.page_head_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def block_offset_bytes(self, page: PageId, head: int, layer: int, kv: int) -> int:
        """Byte offset of the block of page ``page``, KV head ``head``, layer ``layer``, plane ``kv``."""
        return (((page * self.num_kv_heads + head) * self.num_layers + layer) * self.num_planes
                + kv) * self.block_bytes

    def page_offset_bytes(self, page: PageId) -> int:
        """Byte offset of page ``page``; the page spans ``page_bytes`` from there."""
        return page * self.page_bytes

    def slot_index(self, pages: Sequence[PageId], position: int) -> int:
        """Flat slot index of token ``position`` of a sequence whose page table is ``pages``."""
        return pages[position // self.page_size] * self.page_size + position % self.page_size

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVLayout:
        """The layout of ``to_json``'s dict; a dict without ``kind`` (a peer from before it) is ``"mha"``.
        Raises KeyError for another missing field, ValueError as the constructor."""
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k != "kind" or k in data})


COMPAT_FIELDS = ("version", "kind", "dtype", "weight_quant", "page_size", "num_layers", "num_kv_heads",
                 "head_dim")


def compat_hash(model_id: str, layout: KVLayout, sliced: bool = False) -> str:
    """Hash over every field two peers must share; equal hashes mean compatible instances (``kind`` only
    when not ``"mha"``: see the module docstring). ``sliced``: the instance's KV is split over tensor-parallel
    ranks (``kv_transfer.head_slices``); it enters the hash only when True, so that a peer from before
    head-sliced transfers, which would address the registration as one pool, refuses it."""
    names = [f for f in COMPAT_FIELDS if f != "kind" or layout.kind != "mha"]
    fields: dict[str, object] = {"model_id": model_id, **{f: getattr(layout, f) for f in names}}
    if sliced:
        fields["kv_regions"] = True
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def describe(model_id: str, layout: KVLayout) -> str:
    """One line naming every compatibility field of a layout and its hash (for errors and logs)."""
    fields = " ".join(f"{f}={getattr(layout, f)}" for f in COMPAT_FIELDS)
    return f"model_id={model_id} {fields} hash={compat_hash(model_id, layout)}"


def check_compatible(model_id: str, ours: KVLayout, their_model_id: str, theirs: KVLayout,
                     their_hash: str | None = None, their_sliced: bool = False) -> None:
    """Raise ``CompatibilityError`` naming the first field that differs (model id first) and both layouts.

    ``their_hash`` is the compatibility hash the peer registered; when it differs from the hash of what the
    peer's layout says (a peer computing it differently, e.g. another layout version), that alone fails;
    ``their_sliced``: the peer registered ``kv_regions`` (its hash says so)."""
    mine, theirs_text = describe(model_id, ours), describe(their_model_id, theirs)
    if model_id != their_model_id:
        raise CompatibilityError("model_id", model_id, their_model_id, mine, theirs_text)
    for field in COMPAT_FIELDS:
        if getattr(ours, field) != getattr(theirs, field):
            raise CompatibilityError(field, getattr(ours, field), getattr(theirs, field), mine, theirs_text)
    if their_hash is not None and their_hash != compat_hash(model_id, ours, their_sliced):
        raise CompatibilityError("compat_hash", compat_hash(model_id, ours, their_sliced), their_hash, mine,
                                 f"{theirs_text} registered hash={their_hash}")
