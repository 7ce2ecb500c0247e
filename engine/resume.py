"""Resuming a request elsewhere: a sequence that arrives with generated tokens it must not generate again.

A router migrates a request whose decode instance died mid-stream (docs/architecture.md, "Migration") by
sending the prompt and every token already streamed to another instance. ``replay_outputs`` makes the fresh
``Sequence`` look like the original one after those tokens, so that what follows is what the original would
have produced:

- each token goes through ``OutputProcessor.append_token`` (logprob 0.0, no details: they were reported
  where they were sampled), so stop checks, ``min_tokens``, penalties and the detokenizer see it as output;
- the text those tokens make counts as already sent (``mark_emitted``): the held-back tail that could start a
  stop string is the same as the original's, so the text the client has and the text sent from here join;
- a structured-outputs grammar moves past each token;
- a seeded non-greedy request skips the one draw per token its generator made for each of them
  (``engine.sampler._sample_row``: one exponential per vocabulary entry);
- the prompt and the tokens are then prefilled together in chunks (``Sequence.num_prefill_tokens``); the
  last chunk samples the next token.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.errors import RequestRejected
from engine.output_processor import OutputProcessor
from engine.sequence import Sequence


def check_resumed(seq: Sequence, token_ids: list[int], vocab_size: int) -> None:
    """Raises ``RequestRejected`` unless ``token_ids`` can resume ``seq``: ids in ``[0, vocab_size)`` and
    fewer than ``max_tokens`` of them (one must be left to generate)."""
    if len(token_ids) >= seq.params.max_tokens:
        raise RequestRejected(seq.request_id, f"{len(token_ids)} resumed tokens leave none of max_tokens "
                                              f"{seq.params.max_tokens} to generate")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestRejected(seq.request_id, f"resumed token ids outside [0, {vocab_size})")


def replay_outputs(seq: Sequence, token_ids: Iterable[int], outputs: OutputProcessor, vocab_size: int,
                   device: torch.device | str) -> None:
    """Append ``token_ids`` to a fresh (tracked, not scheduled) ``seq`` as generated and already sent.

    Raises:
        RequestRejected: a token is outside the request's grammar, or the tokens already end the request
            (EOS, a stop token or string): the original would not have gone on.
    """
    seeded = seq.params.seed is not None and not seq.params.greedy
    for index, token_id in enumerate(token_ids):
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            raise RequestRejected(seq.request_id,
                                  f"resumed token {index} ({token_id}) is outside the grammar")
        if seeded:
            torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=seq.generator)
        reason = outputs.append_token(seq, token_id, 0.0)
        if reason is not None:
            raise RequestRejected(seq.request_id, f"resumed token {index} ({token_id}) already ends the "
                                                  f"request ({reason})")
    outputs.mark_emitted(seq)
    seq.num_prefill_tokens = seq.num_tokens
