"""One request's state inside the engine.

Lifecycle (forward-only; ``FINISHED`` is terminal):

1. ``WAITING``: queued by ``add_request``; holds no pages.
   (decode mode) ``RESERVED``: ``reserve_request`` took its pages; the prompt KV is being written by a peer.
2. ``RUNNING``: admitted; holds pages for its whole life (its longest cached prefix shared with the prefix
   cache, the rest new); computes the uncached prompt in chunks, then one token per step.
   (decode mode: ``add_prebuilt_request`` moves it here with the prompt already computed.)
3. (prefill mode) ``HELD``: prompt done, first token sampled; pages kept until ``release_request``.
4. ``FINISHED``: pages returned to the pool (full pages with a key stay cached for later requests).
"""

from __future__ import annotations

import enum

import torch

from engine.outputs import FinishReason, TokenLogprob
from engine.page_allocator import PageId
from engine.prefix_cache import PageHash
from engine.sampler import TokenHistory
from engine.sampling_params import SamplingParams
from engine.structured.matcher import GrammarState

RequestId = str


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RESERVED = 1
    RUNNING = 2
    HELD = 3
    FINISHED = 4


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold the KV of ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class Sequence:
    """A request's tokens, progress, pages and output state.

    Attributes:
        token_ids: prompt followed by the generated tokens.
        num_computed_tokens: tokens whose KV is in the pool.
        num_prefill_tokens: leading tokens computed as a prefill (in chunks, no sampling before the last one):
            the prompt, plus the generated tokens a resumed request arrived with (``LLMEngine.add_request``'s
            ``resumed_output_ids``).
        num_cached_tokens: leading prompt tokens whose KV came from the prefix cache at admission (whole
            pages, at most ``num_prompt_tokens - 1``).
        page_hashes: prefix-cache keys of the sequence's first full pages, in order (filled lazily).
        num_registered_pages: leading pages already offered to the prefix cache.
        page_table: every page the request holds, in sequence order (allocated at admission, all at once).
        num_reserved_tokens: KV tokens the request may ever need; sizes ``page_table``.
        num_sent_pages: prefill mode: pages already reported in a ``PrefillChunk``.
        num_emitted_tokens: generated tokens already reported in a ``RequestOutput``.
        generator: draws this request's samples (its own when ``params.seed`` is set).
        output_logprobs: raw logprob of each generated token.
        output_token_logprobs: logprob details of each generated token (only when ``params.logprobs`` is set).
        cumulative_logprob: sum of ``output_logprobs``.
        grammar: the structured-outputs state (``params.structured``), moved past every sampled token; None
            without a constraint.
        dp_rank: the DP-attention rank whose KV pool holds the request (``engine.dp_scheduler``); 0 otherwise.
    """

    def __init__(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams,
                 num_reserved_tokens: int, generator: torch.Generator) -> None:
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_reserved_tokens = num_reserved_tokens
        self.num_computed_tokens = 0
        self.num_prefill_tokens = self.num_prompt_tokens
        self.num_cached_tokens = 0
        self.page_hashes: list[PageHash] = []
        self.num_registered_pages = 0
        self.page_table: list[PageId] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.output_logprobs: list[float] = []
        self.output_token_logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.num_sent_pages = 0
        self.num_emitted_tokens = 0
        self.generator = generator
        self.grammar: GrammarState | None = None
        self.dp_rank = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def history(self) -> TokenHistory:
        """The prompt and the generated tokens, for penalties and ``min_tokens`` (copies)."""
        return TokenHistory(self.token_ids[:self.num_prompt_tokens], self.token_ids[self.num_prompt_tokens:])

    @property
    def is_prefilling(self) -> bool:
        """True until the KV of the whole prompt (and of the resumed tokens) is computed."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def set_status(self, status: SequenceStatus) -> None:
        """Move forward in the lifecycle.

        Raises:
            ValueError: a backward move, or leaving ``FINISHED``.
        """
        if status < self.status or self.status == SequenceStatus.FINISHED:
            raise ValueError(f"request {self.request_id!r}: illegal move {self.status.name} -> {status.name}")
        self.status = status

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.cumulative_logprob += logprob

