"""``GrammarCompiler``: a spec compiled against the model's vocabulary, once per distinct spec (bounded LRU).

Compiling (xgrammar's ``GrammarCompiler``: the grammar's token-mask tables over the whole vocabulary) costs
milliseconds to tens of milliseconds for a JSON schema; a cached spec costs a dictionary look-up. The vocabulary
description (``xgrammar.TokenizerInfo``, ~0.3 s for a 49k vocabulary) is built on the first compile.

Thread safety: every method may be called from any thread. ``compile`` holds a lock while it compiles, so a
spec is compiled once even when two threads ask for it together; the serving layer calls it at admission (on
the Triton thread) so the engine thread finds the spec cached (``LLMEngine.prepare_request``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidSamplingParams
from engine.structured.spec import StructuredSpec, choice_ebnf, native_message

#: Compiled specs kept by default; the least recently used one is dropped beyond it.
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompileStats:
    """Counters since start: ``hits`` (spec found compiled), ``misses`` (compiled now), ``size`` (cached now)."""

    hits: int
    misses: int
    size: int


class GrammarCompiler:
    """Compiles ``StructuredSpec``s for one vocabulary.

    Args:
        encoded_vocab: every token's string as the tokenizer stores it (byte-level BPE: ``"Ġthe"``), by id;
            ``len(encoded_vocab)`` is the logits' vocabulary size.
        stop_token_ids: tokens that end a sentence of the grammar (the tokenizer's EOS ids): once the output is
            complete, the mask allows only these.
        vocab_type: ``"byte_level"`` (GPT-2 style byte-level BPE), ``"byte_fallback"`` (SentencePiece with
            ``<0xNN>`` byte tokens) or ``"raw"``.
        cache_size: most compiled specs kept (>= 1).
        vocab_size: the logits' vocabulary size when larger than ``len(encoded_vocab)`` (padded embeddings:
            the extra ids are never allowed).
    """

    def __init__(self, encoded_vocab: Sequence[str], stop_token_ids: Sequence[int],
                 vocab_type: str = "byte_level", cache_size: int = DEFAULT_CACHE_SIZE,
                 vocab_size: int | None = None) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self._encoded_vocab = list(encoded_vocab)
        self._vocab_size = max(vocab_size or 0, len(self._encoded_vocab))
        self._stop_token_ids = list(stop_token_ids)
        self._vocab_type = vocab_type
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._pending: dict[StructuredSpec, threading.Event] = {}
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None
        self._hits = 0
        self._misses = 0

    @property
    def vocab_size(self) -> int:
        """Token ids the masks cover (``[0, vocab_size)``)."""
        return self._vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self._stop_token_ids)

    def compile(self, spec: StructuredSpec) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (cached).

        The lock is held only to look up and store: a slow compile never holds up look-ups of other specs (the
        engine thread's), and two threads asking for the same new spec compile it once (the second waits).

        Raises:
            InvalidSamplingParams: ``structured_outputs.<kind>`` when xgrammar cannot compile the spec.
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
        except Exception as e:  # xgrammar raises RuntimeError / ValueError for a bad spec
            raise InvalidSamplingParams(f"structured_outputs.{spec.kind}",
                                        f"cannot be compiled: {native_message(e)}") from None
        else:
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

    def _compile(self, spec: StructuredSpec) -> Any:
        compiler = self._xgrammar_compiler()
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.value, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
        return compiler.compile_grammar(spec.value)

    def _xgrammar_compiler(self) -> Any:
        """Built on first use. Its own cache is off: ``_cache`` bounds what stays compiled."""
        with self._compiler_lock:
            return self._compiler or self._build_compiler()

    def _build_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            vocab_type = {"byte_level": xgrammar.VocabType.BYTE_LEVEL,
                          "byte_fallback": xgrammar.VocabType.BYTE_FALLBACK,
                          "raw": xgrammar.VocabType.RAW}[self._vocab_type]
            info = xgrammar.TokenizerInfo(self._encoded_vocab, vocab_type, vocab_size=self._vocab_size,
                                          stop_token_ids=self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def vocab_of(backend: Any) -> tuple[list[str], str]:
    """The encoded vocabulary (by id) and vocabulary type of a ``tokenizers.Tokenizer``.

    The type follows the tokenizer's decoder: ``ByteLevel`` -> ``"byte_level"``; a ``ByteFallback`` step ->
    ``"byte_fallback"``; anything else -> ``"raw"``. Ids with no token (holes) get ``""``.
    """
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps if isinstance(step, dict)}
    vocab_type = "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else "raw"
    return encoded, vocab_type
