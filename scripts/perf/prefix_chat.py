"""The serving prefix-cache benchmark's pure parts (``scripts/bench_prefix_cache_serving.py``, issue #12).

Workload: the multi-turn chat of ``scripts/bench_prefix_cache.py`` as text. ``num_conversations``
conversations of ``num_turns`` turns share one system prompt (``system_tokens`` tokens of ``SYSTEM_TEXT``
repeated); turn ``t`` of a conversation sends the system prompt + every earlier (question, answer text) + a
new question, with no chat template. Requests go one at a time, turn by turn (turn 1 of every
conversation, then turn 2, ...): each runs alone on the server, so TTFT is the prefill of what the cache
lacks, not queueing, and the cache keeps every conversation across the other conversations' turns.

Figures per configuration (deployment x cache on/off): TTFT p50 of turn 1 and of turns 2+, the KV bytes the
prefill model posted per request (``pd_kv_transfer_bytes_total`` delta), and the prefix-cache hit rate of each
engine model (hits / queries of ``pd_prefix_cache_{hits,queries}_tokens_total`` over the measured requests).
Targets: TTFT p50 turns 2+ with the cache <= 0.3x without; KV bytes per request with the cache <=
(1 - decode's hit rate) x without.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from perf.server import Deployment
from perf.stats import percentile

# the workload text, shared with scripts/bench_prefix_cache.py (the in-process engine benchmark)
SYSTEM_TEXT = (
    "You are a careful assistant for a museum of maritime history. Answer questions about lighthouses, "
    "their keepers, the lenses and lamps they used, the ships they guided and the storms they survived. "
    "Be precise about dates and places, say when a fact is uncertain, and keep answers short. "
)
USER_MESSAGES = (
    "Who kept the light at the northern cape in the winter storms?",
    "How far could the beam of a Fresnel lens be seen on a clear night?",
    "What did keepers burn in their lamps before electricity arrived?",
    "Why were so many towers painted with stripes of red and white?",
    "How did supply boats reach the rock when the sea was rough?",
    "When did the last keeper leave the island lighthouse, and why?",
    "Which ships were lost on the reef before the tower was built?",
    "How does an automatic light know when the night has begun?",
)

TRANSFER_BYTES = "pd_kv_transfer_bytes_total"
QUERIES = "pd_prefix_cache_queries_tokens_total"
HITS = "pd_prefix_cache_hits_tokens_total"
TTFT_TARGET = 0.3   # TTFT p50 turns 2+, cache on / off


class TextTokenizer(Protocol):
    """What building the system prompt needs of ``engine.model.tokenizer.Tokenizer``."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def system_prompt(tokenizer: TextTokenizer, num_tokens: int) -> str:
    """The first ``num_tokens`` tokens of ``SYSTEM_TEXT`` repeated, as text (the server re-tokenizes it: its
    ``num_input_tokens`` is the exact count)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    repeats = math.ceil(num_tokens / len(tokenizer.encode(SYSTEM_TEXT))) + 1
    return tokenizer.decode(tokenizer.encode(SYSTEM_TEXT * repeats)[:num_tokens])


def user_message(conversation: int, turn: int) -> str:
    """The new question of ``turn`` of ``conversation`` (both 0-based), as bench_prefix_cache.py words it."""
    return f" Question {turn + 1} of visitor {conversation + 1}: " \
           f"{USER_MESSAGES[(conversation + turn) % len(USER_MESSAGES)]}"


def schedule(num_conversations: int, num_turns: int) -> list[tuple[int, int]]:
    """(turn, conversation) in sending order: every conversation's turn 1, then every turn 2, ..."""
    if num_conversations < 1 or num_turns < 1:
        raise ValueError(f"need >= 1 conversation and turn, got {num_conversations} x {num_turns}")
    return [(t, c) for t in range(num_turns) for c in range(num_conversations)]


@dataclass
class Chat:
    """The text each conversation has sent and received so far (starts as the system prompt)."""

    system: str
    histories: dict[int, str] = field(default_factory=dict)

    def prompt(self, conversation: int, turn: int) -> str:
        """What turn ``turn`` of ``conversation`` sends: its history + the new question."""
        return self.histories.get(conversation, self.system) + user_message(conversation, turn)

    def answered(self, conversation: int, prompt: str, answer: str) -> None:
        """The next turn resends ``prompt`` + ``answer`` (the model's text, as a chat client would)."""
        self.histories[conversation] = prompt + answer


@dataclass(frozen=True)
class CacheConfig:
    """One measured configuration: ``deployment`` (``"pd"`` or ``"colo"``) with the prefix cache on or off."""

    deployment: str
    cache: bool

    def __post_init__(self) -> None:
        if self.deployment not in ("pd", "colo"):
            raise ValueError(f"deployment must be 'pd' or 'colo', got {self.deployment!r}")

    @property
    def name(self) -> str:
        return f"{self.deployment}_{'on' if self.cache else 'off'}"

    @classmethod
    def parse(cls, name: str) -> CacheConfig:
        """``"pd_on"``, ``"pd_off"``, ``"colo_on"``, ``"colo_off"``. Raises ValueError on another name."""
        match = re.fullmatch(r"(pd|colo)_(on|off)", name.strip())
        if match is None:
            raise ValueError(f"configuration must be pd_on, pd_off, colo_on or colo_off, got {name!r}")
        return cls(match.group(1), match.group(2) == "on")

    def engine_models(self) -> tuple[str, ...]:
        """The models with an engine (and so prefix-cache counters)."""
        return ("prefill", "decode") if self.deployment == "pd" else ("colocated",)

    def deployment_spec(self, colo_threads: int) -> Deployment:
        """bench_serving.py's deployments plus ``enable_prefix_caching`` on every engine model: PD's prefill
        on core 0 and decode on core 1 with one torch thread each, colocated on both cores with
        ``colo_threads``."""
        cache = {"enable_prefix_caching": "true" if self.cache else "false"}
        if self.deployment == "pd":
            return Deployment(name=self.name, entry_model="pd_ensemble",
                              models=("prefill", "decode", "pd_ensemble"),
                              overrides={"prefill": {"num_threads": "1", **cache},
                                         "decode": {"num_threads": "1", **cache}},
                              cpus={"prefill": (0,), "decode": (1,)})
        return Deployment(name=self.name, entry_model="colocated", models=("colocated",),
                          overrides={"colocated": {"num_threads": str(colo_threads), **cache}},
                          cpus={"colocated": (0, 1)})


def model_counter(metrics: Mapping[str, float], name: str, model: str) -> float | None:
    """Sum of the series of ``name`` labelled ``model="<model>"`` (scraped key → value); None when none."""
    values = [v for k, v in metrics.items() if k.startswith(name + "{") and f'model="{model}"' in k]
    return sum(values) if values else None


def counters(metrics: Mapping[str, float], models: Sequence[str]) -> dict[str, float | None]:
    """The counters the benchmark differences: ``kv_bytes`` (prefill's), ``<model>_queries`` and
    ``<model>_hits``."""
    out: dict[str, float | None] = {"kv_bytes": model_counter(metrics, TRANSFER_BYTES, "prefill")}
    for model in models:
        queries = model_counter(metrics, QUERIES, model)
        hits = model_counter(metrics, HITS, model)
        out[f"{model}_queries"] = queries
        # a series appears at its first non-zero increment: queries without hits means no hit yet
        out[f"{model}_hits"] = 0.0 if hits is None and queries is not None else hits
    return out


def delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """``after - before`` per key; None where ``after`` lacks the counter; a counter absent before (created
    since, at its first increment) counts from 0."""
    return {k: None if v is None else v - (before.get(k) or 0.0) for k, v in after.items()}


@dataclass(frozen=True)
class TurnResult:
    """One request of the workload.

    Attributes:
        conversation / turn: 0-based indices.
        num_prompt_tokens: the server's ``num_input_tokens``.
        ttft_ms: client-side send → first token-carrying response; None when the request failed.
        counters: ``delta`` of ``counters`` over this request (``kv_bytes``: KV bytes prefill posted for it).
        answer: the generated text.
        error: the failure, else None.
    """

    conversation: int
    turn: int
    num_prompt_tokens: int
    ttft_ms: float | None
    counters: Mapping[str, float | None]
    answer: str
    error: str | None = None


def hit_rate(hits: float | None, queries: float | None) -> float | None:
    """hits / queries; None when the model reported no queries (cache off, or no such counter)."""
    if hits is None or not queries:
        return None
    return hits / queries


def _total(results: Sequence[TurnResult], key: str) -> float | None:
    """Sum of ``key`` over ``results``; None when any request lacks it."""
    values = [r.counters.get(key) for r in results]
    known = [v for v in values if v is not None]
    return sum(known) if values and len(known) == len(values) else None


def _p50(values: Sequence[float]) -> float | None:
    return percentile(values, 50) if values else None


def summarize_config(results: Sequence[TurnResult], models: Sequence[str]) -> dict[str, Any]:
    """One configuration's figures: TTFT p50 turn 1 / turns 2+ (ms, successful requests), KV bytes per request
    (mean over every request; None when prefill posted none, i.e. colocated), hit rate per engine model (over
    every request), failures and the prompt lengths."""
    ok = [r for r in results if r.error is None and r.ttft_ms is not None]
    kv = [r.counters.get("kv_bytes") for r in results]
    kv_known = [v for v in kv if v is not None]
    out: dict[str, Any] = {
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "ttft_p50_turn1_ms": _p50([r.ttft_ms for r in ok if r.turn == 0]),  # type: ignore[misc]
        "ttft_p50_turns2plus_ms": _p50([r.ttft_ms for r in ok if r.turn > 0]),  # type: ignore[misc]
        "kv_bytes_per_request": sum(kv_known) / len(kv_known) if kv_known else None,
        "prompt_tokens_min": min((r.num_prompt_tokens for r in results), default=0),
        "prompt_tokens_max": max((r.num_prompt_tokens for r in results), default=0),
    }
    for model in models:
        out[f"{model}_hit_rate"] = hit_rate(_total(results, f"{model}_hits"),
                                            _total(results, f"{model}_queries"))
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def answers_equal(on: Sequence[TurnResult], off: Sequence[TurnResult]) -> str | None:
    """``"k/n"``: requests whose answer text is the same with the cache on and off (greedy: it should be)."""
    by_key = {(r.conversation, r.turn): r.answer for r in off}
    pairs = [(r.answer, by_key[(r.conversation, r.turn)]) for r in on if (r.conversation, r.turn) in by_key]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}" if pairs else None


def page_rounded_bound(results: Sequence[TurnResult], page_size: int) -> float | None:
    """1 - decode's hit tokens / its prompts' tokens rounded up to whole pages: the KV bytes ratio on / off
    that sending every page after decode's cached prefix gives. KV moves in pages and a hit is whole pages, so
    each prompt's last, partly filled page is sent with and without the cache: the ratio is at or above
    ``1 - hit rate`` (equal only when every prompt fills its last page). None without decode hit counts."""
    hits = _total(results, "decode_hits")
    paged_tokens = sum(-(-r.num_prompt_tokens // page_size) * page_size for r in results)
    return None if hits is None or not paged_tokens else 1.0 - hits / paged_tokens


def final_line(summaries: Mapping[str, Mapping[str, Any]],
               results: Mapping[str, Sequence[TurnResult]], page_size: int = 16) -> dict[str, Any]:
    """The issue's figures: per deployment TTFT p50 turns 2+ on / off (target <= 0.3); for PD, KV bytes per
    request on / off against (1 - decode's hit rate with the cache on) (target: ratio <= that bound; None when
    decode reports no cache queries: then it has no cache to save bytes with), and beside it the same bound
    with prompts rounded up to ``page_size`` pages (``page_rounded_bound``)."""
    line: dict[str, Any] = {}
    for dep in ("pd", "colo"):
        on, off = summaries.get(f"{dep}_on", {}), summaries.get(f"{dep}_off", {})
        r = ratio(on.get("ttft_p50_turns2plus_ms"), off.get("ttft_p50_turns2plus_ms"))
        line[f"{dep}_ttft_p50_turns2plus_on_ms"] = on.get("ttft_p50_turns2plus_ms")
        line[f"{dep}_ttft_p50_turns2plus_off_ms"] = off.get("ttft_p50_turns2plus_ms")
        line[f"{dep}_ttft_ratio_on_over_off"] = r
        line[f"{dep}_ttft_target_met"] = None if r is None else r <= TTFT_TARGET
        line[f"{dep}_answers_equal_on_off"] = answers_equal(results.get(f"{dep}_on", ()),
                                                            results.get(f"{dep}_off", ()))
    on, off = summaries.get("pd_on", {}), summaries.get("pd_off", {})
    kv_ratio = ratio(on.get("kv_bytes_per_request"), off.get("kv_bytes_per_request"))
    decode_hit = on.get("decode_hit_rate")
    bound = None if decode_hit is None else 1.0 - decode_hit
    line.update(pd_kv_bytes_per_request_on=on.get("kv_bytes_per_request"),
                pd_kv_bytes_per_request_off=off.get("kv_bytes_per_request"),
                pd_kv_ratio_on_over_off=kv_ratio, pd_prefill_hit_rate_on=on.get("prefill_hit_rate"),
                pd_decode_hit_rate_on=decode_hit, pd_kv_bound_1_minus_decode_hit=bound,
                pd_kv_target_met=None if kv_ratio is None or bound is None else kv_ratio <= bound,
                pd_kv_bound_page_rounded=page_rounded_bound(results.get("pd_on", ()), page_size),
                colo_hit_rate_on=summaries.get("colo_on", {}).get("colocated_hit_rate"))
    return line


def _cell(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def format_table(summaries: Mapping[str, Mapping[str, Any]], loadavg: Mapping[str, Sequence[float]]) -> str:
    """A Markdown table, one row per configuration (the order of ``summaries``); ``loadavg``: configuration
    → 1-minute load average (before, after) its server ran."""
    rows = [("| config | load 1m before → after | requests (failed) | prompt tokens | TTFT p50 turn 1 ms "
             "| TTFT p50 turns 2+ ms | KV MiB / request | hit rate prefill | hit rate decode "
             "| hit rate colocated |"),
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        kv = s.get("kv_bytes_per_request")
        load = " → ".join(f"{v:.1f}" for v in loadavg.get(name, ())) or "—"
        rows.append(
            f"| {name} | {load} | {s['num_requests']} ({s['num_failed']}) | "
            f"{s['prompt_tokens_min']}–{s['prompt_tokens_max']} | {_cell(s['ttft_p50_turn1_ms'], '.0f')} | "
            f"{_cell(s['ttft_p50_turns2plus_ms'], '.0f')} | "
            f"{_cell(None if kv is None else kv / 2**20, '.2f')} | "
            f"{_cell(s.get('prefill_hit_rate'), '.3f')} | {_cell(s.get('decode_hit_rate'), '.3f')} | "
            f"{_cell(s.get('colocated_hit_rate'), '.3f')} |")
    return "\n".join(rows)
