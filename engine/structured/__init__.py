"""Structured outputs: a request's output held to a JSON schema, regex, choice list or grammar (llguidance).

``spec`` parses and validates vLLM's ``structured_outputs`` / ``guided_decoding`` object (``StructuredSpec``);
``compiler`` compiles a spec against the model's vocabulary once (bounded LRU, thread-safe); ``matcher`` holds
one request's grammar state and builds the batched token mask the sampler applies. See
docs/structured_outputs.md.
"""

from engine.structured.compiler import CompileStats, GrammarCompiler
from engine.structured.matcher import GrammarState, apply_mask, fill_masks
from engine.structured.spec import SPEC_KEYS, StructuredSpec, parse_structured

__all__ = ["SPEC_KEYS", "CompileStats", "GrammarCompiler", "GrammarState", "StructuredSpec", "apply_mask",
           "fill_masks", "parse_structured"]
