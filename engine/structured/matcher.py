"""``GrammarState``: one request's position in its grammar, and the batched token mask it yields.

Per step, for the rows of the batch that carry a grammar (``GrammarState``): ``fill_masks`` writes each row's
allowed-token bitmask into one ``[num_rows, ceil(vocab / 32)]`` int32 tensor (bit ``t % 32`` of word
``t // 32`` set = token ``t`` allowed); the sampler applies it (``apply_masks``: disallowed logits ->
``-inf``) after logit bias, ``min_tokens`` and the penalties and before temperature / top-k / top-p / the
draw, vLLM's order; the engine then ``accept``s the sampled token, which moves the state on.

Thread: a ``GrammarState`` belongs to its sequence and is used on the engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.structured.compiler import CompiledGrammar

logger = logging.getLogger(__name__)


class GrammarState:
    """An ``llguidance.LLMatcher`` at the grammar's beginning: a copy of a compiled template.

    Args:
        compiled: what ``GrammarCompiler.compile`` returned (its template is copied here, never advanced).
        request_id: for log lines.
    """

    def __init__(self, compiled: CompiledGrammar, request_id: str = "") -> None:
        self._matcher = compiled.template.deep_copy()
        self._stop_token_ids = compiled.stop_token_ids
        self._terminated = False
        self.request_id = request_id
        self.num_accepted_tokens = 0
        self.failed = False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (``[num_rows, words]`` int32, CPU, contiguous;
        ``words = ceil(vocab_size / 32)`` of the compiler's vocabulary)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept(self, token_id: int) -> bool:
        """Move past ``token_id``; False (and ``failed`` set, logged) when the grammar does not allow it.

        A token the mask allowed is always accepted; a refused one can only come from outside the mask
        (a replayed first token from a peer that ran another grammar). A stop token accepted at the end
        of a complete sentence terminates the state.
        """
        if self.failed:
            return False
        if self._matcher.consume_token(int(token_id)) and not self._matcher.is_error():
            self.num_accepted_tokens += 1
            self._terminated = int(token_id) in self._stop_token_ids
            return True
        self.failed = True
        logger.warning("request %s: token %d is outside its grammar after %d tokens: %s", self.request_id,
                       token_id, self.num_accepted_tokens, self._matcher.get_error())
        return False

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted (the sentence is over; later tokens, with ``ignore_eos``, are
        not constrained)."""
        return self._terminated

    @property
    def is_completed(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (a stop token may come next)."""
        return bool(self._matcher.is_accepting())


def allocate_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[num_rows, ceil(vocab_size / 32)]`` int32 CPU bitmask with every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_masks(states: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The bitmask of a batch: row ``i`` from ``states[i]``, every token allowed where ``states[i]`` is None;
    None when no row has a grammar (or every grammar state failed: its row samples freely)."""
    rows = [(i, s) for i, s in enumerate(states) if s is not None and not s.failed and not s.is_terminated]
    if not rows:
        return None
    masks = allocate_masks(len(states), vocab_size)
    for i, state in rows:
        state.fill_mask(masks, i)
    return masks


def apply_mask(row: torch.Tensor, mask_row: torch.Tensor) -> torch.Tensor:
    """``row`` ``[vocab_size]`` float with disallowed tokens set to ``-inf`` (a new tensor).

    ``mask_row`` is ``[ceil(vocab_size / 32)]`` int32 (one bitmask row); tokens past ``32 * words`` are
    disallowed. If the mask allows nothing, ``row`` is returned unchanged (logged): better an unconstrained
    token than a NaN draw.
    """
    vocab = row.shape[0]
    bits = torch.arange(32, dtype=torch.int32, device=mask_row.device)
    allowed = ((mask_row.to(torch.int32)[:, None] >> bits) & 1).bool().reshape(-1)
    if allowed.shape[0] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
    allowed = allowed[:vocab].to(row.device)
    if not bool(allowed.any()):
        logger.warning("a grammar mask allows no token; the row is sampled unconstrained")
        return row
    return row.masked_fill(~allowed, float("-inf"))
