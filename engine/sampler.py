"""The batch sampler: one token per logits row, under each row's ``engine.sampling_params.SamplingParams``.

Per row, the sampler applies, in vLLM's order: ``logit_bias``; ``min_tokens`` (EOS and ``stop_token_ids``
masked while fewer tokens were generated); ``repetition_penalty`` (prompt and output tokens: a positive logit
is divided by it, a negative one multiplied, as in CTRL, Keskar et al. 2019); ``frequency_penalty`` and
``presence_penalty`` (output tokens only: ``logit -= frequency * count + presence * (count > 0)``, as in
OpenAI's API); then the structured-outputs token mask (``structured``: tokens its grammar does not allow next
get ``-inf``; ``engine.structured``); then greedy argmax, or temperature, ``min_p`` (drop tokens below
``min_p`` times the top token's probability), top-k, top-p and a draw.

Logprobs: the reported logprob of a chosen token (and the top ``logprobs`` alternatives, with ranks) is taken
from the *raw* model distribution, ``log_softmax(logits)`` before any of the above (vLLM's default
``raw_logprobs``), so greedy and sampled requests report comparable numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.structured.matcher import apply_mask


@dataclass(frozen=True)
class TopLogprobs:
    """Logprob details of one sampled token (asked for with ``SamplingParams.logprobs``).

    Attributes:
        rank: 1-based rank of the chosen token in the raw distribution (1 = most likely).
        token_ids: the ``logprobs`` most likely token ids, most likely first.
        logprobs: their raw-distribution logprobs, same order.
    """

    rank: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class SampleResult:
    """Chosen token and its raw-distribution logprob, one entry per logits row; ``top`` is None for rows that
    asked no logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[TopLogprobs | None] = field(default_factory=list)


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's penalties and ``min_tokens`` look at: the prompt, then what was generated so far."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


class Sampler:
    """Picks one token per logits row; plain greedy rows are argmax'ed together, the others one row at a time.

    Each non-greedy row draws from its own ``torch.Generator`` (exponential-race sampling, ``vocab_size``
    draws per token), so a seeded request yields the same tokens whatever else shares its batch.

    Args:
        eos_token_ids: the tokenizer's EOS ids, masked (with each row's ``stop_token_ids``) while a row is
            below its ``min_tokens``.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator],
                 histories: Sequence[TokenHistory] | None = None,
                 masks: torch.Tensor | None = None) -> SampleResult:
        """Sample.

        Args:
            logits: ``[num_rows, vocab_size]`` float32, raw model output.
            params: one per row.
            generators: one per row, on ``logits.device``; used by non-greedy rows only.
            histories: one per row: the tokens penalties and ``min_tokens`` see; None: no row has any (every
                row is then sampled as if its prompt and output were empty).
            masks: ``[num_rows, ceil(vocab_size / 32)]`` int32 allowed-token bitmask (``engine.structured``),
                applied to the rows whose params carry ``structured``, after the penalties; None: no mask.
        Returns:
            ``SampleResult`` with ``num_rows`` tokens and logprobs (and top logprobs where asked).
        """
        logits = logits.float()
        token_ids = torch.argmax(logits, dim=-1)
        for i, p in enumerate(params):
            masked = masks is not None and p.structured is not None
            if p.greedy and not p.processes_logits and not masked:
                continue
            row = logits[i]
            if p.processes_logits:
                history = histories[i] if histories is not None else TokenHistory((), ())
                row = self._process(row, p, history)
            if masked:
                assert masks is not None
                row = apply_mask(row, masks[i])
                if not bool(torch.isfinite(row).any()):  # min_tokens forbids the only tokens the
                                                         # grammar allows
                    row = apply_mask(logits[i], masks[i])  # the grammar wins
            token_ids[i] = int(torch.argmax(row)) if p.greedy else _sample_row(row, p, generators[i])
        log_norm = torch.logsumexp(logits, dim=-1)
        chosen = torch.gather(logits, 1, token_ids[:, None]).squeeze(1)
        logprobs = chosen - log_norm
        top: list[TopLogprobs | None] = [None] * len(params)
        for i, p in enumerate(params):
            if p.logprobs is not None:
                top[i] = _top_logprobs(logits[i] - log_norm[i], float(logprobs[i]), p.logprobs)
        return SampleResult(token_ids.tolist(), logprobs.tolist(), top)

    def _process(self, row: torch.Tensor, p: SamplingParams, history: TokenHistory) -> torch.Tensor:
        """``row`` ``[vocab_size]`` after logit bias, ``min_tokens`` and the penalties (a new tensor)."""
        row = row.clone()
        vocab = row.shape[0]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype,
                                                device=row.device))
        if p.min_tokens > 0 and len(history.output_token_ids) < p.min_tokens:
            stop_ids = [t for t in set(self.eos_token_ids) | set(p.stop_token_ids) if t < vocab]
            if stop_ids:
                row[torch.tensor(stop_ids, dtype=torch.int64, device=row.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history.prompt_token_ids) | set(history.output_token_ids)),
                                dtype=torch.int64, device=row.device)
            if seen.numel():
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                        values * p.repetition_penalty)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(history.output_token_ids):
            out = torch.tensor(list(history.output_token_ids), dtype=torch.int64, device=row.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return row


def _top_logprobs(logprobs_row: torch.Tensor, chosen_logprob: float, k: int) -> TopLogprobs:
    """Rank of the chosen token and the ``k`` best of ``logprobs_row`` ``[vocab_size]`` (raw logprobs)."""
    rank = int((logprobs_row > chosen_logprob).sum()) + 1
    if k == 0:
        return TopLogprobs(rank, (), ())
    values, ids = torch.topk(logprobs_row, k)
    return TopLogprobs(rank, tuple(ids.tolist()), tuple(values.tolist()))


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``logits`` ``[vocab_size]`` under temperature, min-p, top-k and top-p."""
    scaled = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_vals, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # exactly one exponential per vocabulary entry per token: a decode engine replays this draw for the first
    # token a prefill engine sampled (LLMEngine.add_prebuilt_request)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))
