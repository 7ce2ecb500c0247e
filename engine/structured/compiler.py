"""``GrammarCompiler``: a spec compiled against the model's vocabulary, once per distinct spec (bounded LRU).

Compiling (llguidance: the spec's grammar, validated against the tokenizer, and a fresh ``LLMatcher`` over it,
kept as a template that every request of that spec copies) costs about a millisecond for a small JSON schema
and more for large ones; a cached spec costs a dictionary look-up. The tokenizer description
(``llguidance.LLTokenizer``, ~0.9 s for a 49k vocabulary) is built on the first compile.

Thread safety: every method may be called from any thread. The lock is held only to look up and store, so a
slow compile never holds up look-ups of other specs, and two threads asking for one new spec compile it once.
The serving layer compiles at admission (on the Triton thread: ``LLMEngine.prepare_request``) so the engine
thread finds the spec cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidSamplingParams
from engine.structured.spec import StructuredSpec, first_line, to_grammar

#: Compiled specs kept by default; the least recently used one is dropped beyond it.
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: ``template`` (an ``llguidance.LLMatcher`` at the grammar's start: copy it, never
    advance it) and the stop tokens that end its sentences."""

    template: Any
    stop_token_ids: frozenset[int]


@dataclass(frozen=True)
class CompileStats:
    """Counters since start: ``hits`` (spec found compiled), ``misses`` (compiled now), ``size`` (cached
    now)."""

    hits: int
    misses: int
    size: int


class GrammarCompiler:
    """Compiles ``StructuredSpec``s for one tokenizer.

    Args:
        tokenizer_json: the tokenizer's ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``).
        vocab_size: the logits' vocabulary size (masks cover ``[0, vocab_size)``; ids the tokenizer lacks are
            never allowed).
        stop_token_ids: tokens that end a sentence of the grammar (the EOS ids): once the output is complete,
            the mask allows only these.
        cache_size: most compiled specs kept (>= 1).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if not stop_token_ids:
            raise ValueError("stop_token_ids must name at least one token")
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._pending: dict[StructuredSpec, threading.Event] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._tokenizer: Any = None
        self._hits = 0
        self._misses = 0

    @property
    def vocab_size(self) -> int:
        """Token ids the masks cover (``[0, vocab_size)``)."""
        return self._vocab_size

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled form of ``spec`` (shared: ``GrammarState`` copies its template).

        Raises:
            InvalidSamplingParams: ``structured_outputs.<kind>`` when llguidance refuses the spec.
        """
        while True:
            with self._lock:
                compiled = self._cache.get(spec)
                if compiled is not None:
                    self._cache.move_to_end(spec)
                    self._hits += 1
                    return compiled
                pending = self._pending.get(spec)
                if pending is None:
                    self._pending[spec] = threading.Event()
                    break
            pending.wait()  # another thread compiles it: take its result (or its error, by compiling again)
        try:
            compiled = self._compile(spec)
            with self._lock:
                self._misses += 1
                self._cache[spec] = compiled
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._pending.pop(spec).set()

    def is_cached(self, spec: StructuredSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._hits, self._misses, len(self._cache))

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        field_name = f"structured_outputs.{spec.kind}"
        try:
            grammar = to_grammar(spec)
        except Exception as e:  # llguidance raises ValueError / RuntimeError for some bad specs
            raise InvalidSamplingParams(field_name, f"cannot be compiled: {first_line(e)}") from None
        tokenizer = self.tokenizer()
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidSamplingParams(field_name, f"cannot be compiled: {first_line(error)}")
        template = LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidSamplingParams(field_name, f"cannot be compiled: {first_line(template.get_error())}")
        return CompiledGrammar(template, frozenset(self._stop_token_ids))

    def tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (built on first use, once)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                              eos_token=self._stop_token_ids)
            return self._tokenizer
