"""Stop conditions, incremental detokenization and ``RequestOutput`` assembly.

Stop checks run on every appended token, in this order: EOS (unless ``ignore_eos``) and ``stop_token_ids``
give ``"stop"`` (the token is kept in ``new_token_ids``; its text is not added, except a ``stop_token_ids``
token's with ``include_stop_str_in_output``); then a stop string appearing in the text gives ``"stop"`` (the
text is cut where the string starts, or where it ends with ``include_stop_str_in_output``); then
``max_tokens`` gives ``"length"``. While fewer than ``min_tokens`` tokens were generated, neither EOS, stop
tokens (the sampler masks them) nor stop strings end the request (vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.model_runner import SampledToken
from engine.outputs import FinishReason, PrefillChunk, RequestOutput, TokenLogprob
from engine.sampler import TopLogprobs
from engine.sequence import RequestId, Sequence


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Feed one token; return the text it completes (may be empty while a UTF-8 char is partial)."""
        ...


class _TextState:
    """Decoded text of one request and how much of it was emitted."""

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...], include_stop: bool) -> None:
        self.detokenizer = detokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.holdback_chars = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.last_delta = ""

    def push(self, token_id: int, check_stop: bool = True) -> bool:
        """Add a token's text (kept in ``last_delta``); True when ``check_stop`` and a stop string appeared
        (the text is cut at its start, or after it with ``include_stop``)."""
        old_len = len(self.text)
        self.last_delta = self.detokenizer.push(token_id)
        self.text += self.last_delta
        if not self.stop or not check_stop:
            return False
        search_from = max(0, old_len - self.holdback_chars)
        hits = [(i, len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            start, length = min(hits)
            self.text = self.text[:start + length if self.include_stop else start]
        return bool(hits)

    def take(self, final: bool) -> str:
        """Text not emitted yet, minus a tail that could still start a stop string unless ``final``."""
        end = len(self.text) if final else max(self.num_emitted_chars, len(self.text) - self.holdback_chars)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta


class OutputProcessor:
    """Per-engine: tracks each live request's text; decides when a request stops."""

    def __init__(self, eos_token_ids: frozenset[int], make_detokenizer: Callable[[], Detokenizer],
                 decode_token: Callable[[int], str] = str) -> None:
        """
        Args:
            eos_token_ids: the tokenizer's EOS ids.
            make_detokenizer: a fresh incremental detokenizer per request.
            decode_token: the text of one token decoded alone (for the top-logprob alternatives).
        """
        self.eos_token_ids = eos_token_ids
        self.make_detokenizer = make_detokenizer
        self.decode_token = decode_token
        self._texts: dict[RequestId, _TextState] = {}

    def start(self, seq: Sequence) -> None:
        p = seq.params
        self._texts[seq.request_id] = _TextState(self.make_detokenizer(), p.stop,
                                                 p.include_stop_str_in_output)

    def drop(self, request_id: RequestId) -> None:
        self._texts.pop(request_id, None)

    def append_token(self, seq: Sequence, token_id: int, logprob: float,
                     top: TopLogprobs | None = None) -> FinishReason | None:
        """Append a generated token to ``seq``; return why it finishes, or None.

        ``top``: the token's rank and top alternatives (``SampledToken.top``); None when the request asked no
        logprobs, or when the token came from elsewhere (the prefill side's first token on a decode engine:
        its logprob details were reported there).
        """
        seq.append_token(token_id, logprob)
        p = seq.params
        text = self._texts[seq.request_id]
        may_stop = seq.num_output_tokens >= p.min_tokens
        reason: FinishReason | None = None
        if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            text.last_delta = ""
            if p.include_stop_str_in_output and token_id in p.stop_token_ids:
                text.push(token_id, check_stop=False)
            reason = "stop" if may_stop else None
        elif text.push(token_id, check_stop=may_stop):
            reason = "stop"
        if p.logprobs is not None and top is not None:
            seq.output_token_logprobs.append(TokenLogprob(
                token_id, logprob, top.rank, text.last_delta,
                tuple((t, lp, self.decode_token(t)) for t, lp in zip(top.token_ids, top.logprobs))))
        if reason is None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        return reason

    def append_sampled(self, seq: Sequence, sampled: SampledToken) -> FinishReason | None:
        """``append_token`` of what the sampler chose for ``seq``."""
        return self.append_token(seq, sampled.token_id, sampled.logprob, sampled.top)

    def mark_emitted(self, seq: Sequence) -> None:
        """Count everything ``seq`` produced so far as already sent (by the prefill side of PD): tokens, and
        the text a non-final output would have carried."""
        seq.num_emitted_tokens = seq.num_output_tokens
        text = self._texts.get(seq.request_id)
        if text is not None:
            text.take(final=False)

    def make_output(self, seq: Sequence, finish_reason: FinishReason | None,
                    prefill_chunk: PrefillChunk | None = None, hold_text: bool = False) -> RequestOutput:
        """Everything ``seq`` produced since its previous output.

        ``hold_text`` keeps back a possible stop string's start even when the request finished (prefill mode:
        the decode side goes on from the same point).
        """
        start = seq.num_emitted_tokens
        seq.num_emitted_tokens = seq.num_output_tokens
        text = self._texts.get(seq.request_id)
        # token logprobs exist for the tokens sampled here (a decode engine's first token came with none)
        num_unlogged = seq.num_output_tokens - len(seq.output_token_logprobs)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.token_ids[seq.num_prompt_tokens + start:],
            new_logprobs=seq.output_logprobs[start:],
            new_text=text.take(final=finish_reason is not None and not hold_text) if text else "",
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            prefill_chunk=prefill_chunk,
            new_token_logprobs=seq.output_token_logprobs[max(0, start - num_unlogged):]
            if seq.params.logprobs is not None else [],
            cumulative_logprob=seq.cumulative_logprob,
            num_cached_tokens=seq.num_cached_tokens,
        )
