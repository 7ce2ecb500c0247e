"""Which slice of a Llama-family model one tensor-parallel rank holds (Megatron-style; pure arithmetic).

A rank of ``world_size`` holds:

- attention: a contiguous range of KV heads and the query heads of their groups (column-parallel q/k/v,
  row-parallel o). Where ``world_size <= num_kv_heads`` the KV heads are split, as evenly as whole heads
  allow (``split_range``: when ``num_kv_heads % world_size != 0`` the ranks differ by one KV head, and the
  ones with fewer come first, so rank 0, which also schedules and samples, carries the lighter share; e.g.
  SmolLM2's 3 KV heads over 2 ranks: rank 0 holds head 0 with 3 query heads, rank 1 heads 1-2 with 6).
  Where ``world_size > num_kv_heads`` (it must then be a multiple of it, and divide ``num_heads``), each KV
  head is *replicated* on ``world_size // num_kv_heads`` ranks, each holding ``num_heads // world_size`` of
  its query heads. The cost of replication: every replica computes the same K/V projection (its k/v weight
  rows are read ``replicas`` times per step in all) and stores the same K/V, so the instance's KV pool holds
  ``replicas`` copies of every token's KV: KV capacity per byte of memory falls by that factor.
- MLP: a contiguous range of the intermediate columns (column-parallel gate/up, row-parallel down), split
  evenly even where the attention is not: every all-reduce is a barrier, so a step costs the slowest rank's
  attention plus the slowest rank's MLP, and columns moved to the rank with less attention only lengthen the
  MLP part (tried on SmolLM2 over 2 ranks with 856 + 680 columns: rank 0 still waited ~100 us per layer after
  the attention, none after the MLP, where rank 1 now waited for rank 0's extra columns). The uneven KV
  split's cost is that attention wait alone.
- LM head: a contiguous range of vocabulary rows (vocabulary-parallel; rank 0 gathers the logits).
- replicated on every rank: the token embedding (a lookup reads one row per token), the norms, RoPE.

``KVHeadSlice`` is what a rank's KV pool holds, in the model's head numbering: what a head-sliced KV transfer
between instances of different TP sizes maps (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class HeadShape(Protocol):
    """The part of ``engine.model.config.ModelConfig`` the layout reads."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class KVHeadSlice:
    """The KV heads one rank's KV pool holds: model heads ``[start, stop)``, in this order, as local heads
    ``0 .. num_heads - 1`` (the pool's ``num_kv_heads`` dimension).

    Attributes:
        rank, world_size: the rank and the instance's tensor-parallel size.
        start, stop: the model's KV head range held here (``stop - start >= 1``).
        num_model_kv_heads: the model's KV heads in all.
        replicas: how many ranks hold each of these heads: 1 when the heads are split; ``world_size //
            num_model_kv_heads`` when they are replicated.
    """

    rank: int
    world_size: int
    start: int
    stop: int
    num_model_kv_heads: int
    replicas: int = 1

    @property
    def num_heads(self) -> int:
        """KV heads in this rank's pool."""
        return self.stop - self.start

    def local_index(self, model_head: int) -> int:
        """Position of model KV head ``model_head`` in this rank's pool. Raises ValueError when not held."""
        if not self.start <= model_head < self.stop:
            raise ValueError(f"rank {self.rank} holds KV heads [{self.start}, {self.stop}), not {model_head}")
        return model_head - self.start

    @classmethod
    def whole(cls, num_kv_heads: int) -> KVHeadSlice:
        """Every KV head (a single-rank instance)."""
        return cls(0, 1, 0, num_kv_heads, num_kv_heads)


@dataclass(frozen=True)
class RankShard:
    """One rank's slice of the model (ranges in units of heads, intermediate columns and vocabulary rows).

    Attributes:
        rank, world_size: as in ``KVHeadSlice``.
        heads: the query heads held (model numbering); their q rows and o columns.
        kv_heads: the KV heads held.
        intermediate: the MLP columns held (gate/up rows, down columns).
        vocab: the LM head rows held (this rank's logits columns).
        head_dim: elements per head.
        dp_attention: every head held (``heads`` and ``kv_heads`` whole): the rank runs attention on its own
            requests with its own KV pool, the MLP columns and LM head rows still split
            (``dp_attention_shard``).
    """

    rank: int
    world_size: int
    heads: range
    kv_heads: KVHeadSlice
    intermediate: range
    vocab: range
    head_dim: int
    dp_attention: bool = False

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.num_heads

    @property
    def is_whole(self) -> bool:
        """True for a single-rank instance (nothing is split)."""
        return self.world_size == 1

    @property
    def q_rows(self) -> range:
        """Rows of ``q_proj`` (columns of ``o_proj``) held."""
        return range(self.heads.start * self.head_dim, self.heads.stop * self.head_dim)

    @property
    def kv_rows(self) -> range:
        """Rows of ``k_proj`` and of ``v_proj`` held."""
        return range(self.kv_heads.start * self.head_dim, self.kv_heads.stop * self.head_dim)


def split_range(size: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(size)`` cut into ``parts`` contiguous pieces whose lengths differ by at most
    one, the shorter ones first (``index * size // parts`` to ``(index + 1) * size // parts``)."""
    return range(index * size // parts, (index + 1) * size // parts)


def check_tensor_parallel_size(cfg: HeadShape, world_size: int) -> None:
    """Raise ValueError, naming ``tensor_parallel_size``, when ``cfg``'s heads cannot be split over
    ``world_size`` ranks: more ranks than KV heads needs a multiple of the KV heads that divides the
    attention heads (each rank then takes whole query heads of one replicated KV head)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world_size!r}")
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    if world_size <= kv:
        return
    if world_size % kv or heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} does not fit the model's {heads} attention "
                         f"heads and {kv} KV heads: use at most {kv} ranks, or a multiple of {kv} that "
                         f"divides {heads}")


def shard_for(cfg: HeadShape, rank: int, world_size: int) -> RankShard:
    """The slice of rank ``rank`` (0-based) of ``world_size``.

    Raises:
        ValueError: ``world_size`` does not fit the heads (``check_tensor_parallel_size``), or ``rank`` is
            outside ``[0, world_size)``.
    """
    check_tensor_parallel_size(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    q_range, kv_slice = _attention(cfg, rank, world_size)
    return RankShard(rank, world_size, q_range, kv_slice,
                     split_range(cfg.intermediate_size, world_size, rank),
                     split_range(cfg.vocab_size, world_size, rank), cfg.head_dim)


def _attention(cfg: HeadShape, rank: int, world_size: int) -> tuple[range, KVHeadSlice]:
    """Rank ``rank``'s query heads and KV heads (``world_size`` already checked)."""
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    if world_size <= kv:
        kv_range = split_range(kv, world_size, rank)
        group = heads // kv
        q_range = range(kv_range.start * group, kv_range.stop * group)
        kv_slice = KVHeadSlice(rank, world_size, kv_range.start, kv_range.stop, kv)
    else:
        replicas = world_size // kv
        q_range = split_range(heads, world_size, rank)
        head = rank // replicas
        kv_slice = KVHeadSlice(rank, world_size, head, head + 1, kv, replicas)
    return q_range, kv_slice


def whole_model(cfg: HeadShape) -> RankShard:
    """The single-rank ``RankShard``: every head, column and vocabulary row."""
    return shard_for(cfg, 0, 1)


def dp_attention_shard(cfg: HeadShape, rank: int, world_size: int) -> RankShard:
    """The slice of rank ``rank`` of a DP-attention instance of ``world_size`` ranks: every query and KV
    head (attention weights replicated; the rank's KV pool holds its own requests' tokens, every head), a
    range of the MLP columns and of the LM head rows as in ``shard_for``. Any ``world_size`` fits.

    Raises:
        ValueError: ``rank`` is outside ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    kv = cfg.num_kv_heads
    return RankShard(rank, world_size, range(cfg.num_heads), KVHeadSlice(rank, world_size, 0, kv, kv),
                     split_range(cfg.intermediate_size, world_size, rank),
                     split_range(cfg.vocab_size, world_size, rank), cfg.head_dim, dp_attention=True)
