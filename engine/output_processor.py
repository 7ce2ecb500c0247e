"""Stop conditions, incremental detokenization and ``RequestOutput`` assembly.

Stop checks run on every appended token, in this order: EOS (unless ``ignore_eos``) and ``stop_token_ids``
give ``"stop"`` (the token is kept in ``new_token_ids``, its text is not added); then a stop string appearing
in the text gives ``"stop"`` (the text is cut where the string starts); then ``max_tokens`` gives
``"length"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.outputs import FinishReason, PrefillChunk, RequestOutput
from engine.sequence import RequestId, Sequence


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Feed one token; return the text it completes (may be empty while a UTF-8 char is partial)."""
        ...


class _TextState:
    """Decoded text of one request and how much of it was emitted."""

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...]) -> None:
        self.detokenizer = detokenizer
        self.stop = stop
        self.holdback_chars = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0

    def push(self, token_id: int) -> bool:
        """Add a token's text; True when a stop string appeared (the text is cut at its start)."""
        old_len = len(self.text)
        self.text += self.detokenizer.push(token_id)
        if not self.stop:
            return False
        search_from = max(0, old_len - self.holdback_chars)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def take(self, final: bool) -> str:
        """Text not emitted yet, minus a tail that could still start a stop string unless ``final``."""
        end = len(self.text) if final else max(self.num_emitted_chars, len(self.text) - self.holdback_chars)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta


class OutputProcessor:
    """Per-engine: tracks each live request's text; decides when a request stops."""

    def __init__(self, eos_token_ids: frozenset[int], make_detokenizer: Callable[[], Detokenizer]) -> None:
        self.eos_token_ids = eos_token_ids
        self.make_detokenizer = make_detokenizer
        self._texts: dict[RequestId, _TextState] = {}

    def start(self, seq: Sequence) -> None:
        self._texts[seq.request_id] = _TextState(self.make_detokenizer(), seq.params.stop)

    def drop(self, request_id: RequestId) -> None:
        self._texts.pop(request_id, None)

    def append_token(self, seq: Sequence, token_id: int, logprob: float) -> FinishReason | None:
        """Append a generated token to ``seq``; return why it finishes, or None."""
        seq.append_token(token_id, logprob)
        p = seq.params
        if (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            return "stop"
        if self._texts[seq.request_id].push(token_id):
            return "stop"
        return "length" if seq.num_output_tokens >= p.max_tokens else None

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
        )
