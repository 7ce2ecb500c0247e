"""The pure parts of the soak benchmark (``scripts/bench_soak.py``): its workload, how one stream ended, error
kinds, KV page accounting from the metrics text, the stub-process census, the summary and its pass/fail rule.

A request ends in exactly one ``Outcome``, decided by which came first:

1. FINAL seen → ``OK`` (or ``ERROR`` when an error response came first: an error also ends a stream);
2. the client's cancel point (k responses received, or a delay) → ``CANCELLED``;
3. the stream closed with neither FINAL nor an error, or the per-request deadline came after the stream had
   been silent for ``STILL_STREAMING_S`` (or had sent nothing) → ``NO_FINAL`` (a bug: must be 0);
4. the per-request deadline came while the stream was still delivering (a response within the last
   ``STILL_STREAMING_S``) → ``TIMED_OUT``: slow under the load, not lost (reported, not a failure);
5. the end of the drain → ``CUT_AT_DRAIN`` (the client gave up waiting; not counted against the server).

The three figures that must be 0: streams without FINAL, KV pages not returned after the drain
(sum over instances of ``pd_kv_total_pages - pd_kv_free_pages``), and stub deaths (a python-backend stub pid
of a model instance that disappeared or changed, or a "Stub process ... is not healthy" error).
"""

from __future__ import annotations

import enum
import ipaddress
import json
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from perf.stats import RequestRecord, percentile
from perf.workload import make_prompt

InstanceName = str  # a model instance as Triton names it, e.g. "decode_0_0"
STUB_BINARY = "triton_python_backend_stub"


class Outcome(enum.Enum):
    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    NO_FINAL = "no_final"
    TIMED_OUT = "timed_out"
    CUT_AT_DRAIN = "cut_at_drain"


#: A stream whose last response came at most this long before its deadline was still delivering there, seconds
#: (about 10x the worst inter-token latency of the chaos runs: 2.6 s p99).
STILL_STREAMING_S = 30.0


# --------------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class PromptClass:
    """Prompts of ``min_tokens``..``max_tokens`` words (about one token each), drawn with ``weight``."""

    name: str
    min_tokens: int
    max_tokens: int
    weight: float


DEFAULT_PROMPT_CLASSES = (PromptClass("short", 8, 64, 0.5), PromptClass("medium", 128, 512, 0.35),
                          PromptClass("long", 768, 1500, 0.15))
_ODD_WORDS = ("café", "naïve", "Zürich", "東京", "Привет", "🙂", "x=f(y);", "3.14159", "#42", "e-mail:", "—")


@dataclass(frozen=True)
class SoakWorkload:
    """How requests are drawn.

    Attributes:
        prompt_classes: prompt length classes, drawn by weight.
        min_new_tokens / max_new_tokens: ``max_tokens`` is uniform in this range.
        cancel_fraction: share of requests the client cancels (half after k responses, half after a delay).
        max_cancel_delay_s: a delayed cancel fires uniformly in (0, this] seconds after the send.
        seed: the run's seed; request ``i`` is drawn from ``seed`` and ``i`` alone.
    """

    prompt_classes: tuple[PromptClass, ...] = DEFAULT_PROMPT_CLASSES
    min_new_tokens: int = 1
    max_new_tokens: int = 128
    cancel_fraction: float = 0.2
    max_cancel_delay_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need 1 <= min_new_tokens <= max_new_tokens, got {self}")
        if not 0.0 <= self.cancel_fraction <= 1.0 or self.max_cancel_delay_s <= 0:
            raise ValueError(f"cancel_fraction must be in [0, 1] and max_cancel_delay_s > 0, got {self}")
        if not self.prompt_classes or any(c.min_tokens < 1 or c.max_tokens < c.min_tokens or c.weight <= 0
                                          for c in self.prompt_classes):
            raise ValueError(f"bad prompt classes: {self.prompt_classes}")


@dataclass(frozen=True)
class SoakSpec:
    """One request of the soak: ``sampling_json`` is the ``sampling_parameters`` input; at most one of
    ``cancel_after_responses`` / ``cancel_after_s`` is set (the client's cancel point)."""

    request_id: str
    kind: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    sampling_json: str
    cancel_after_responses: int | None = None
    cancel_after_s: float | None = None


def varied_prompt(num_tokens: int, rng: random.Random) -> str:
    """``num_tokens`` common words with about one in ten replaced by non-ASCII, code, numbers or
    punctuation."""
    words = make_prompt(num_tokens, rng.randrange(1 << 30)).split()
    return " ".join(rng.choice(_ODD_WORDS) if rng.random() < 0.1 else w for w in words)


def draw_spec(workload: SoakWorkload, index: int) -> SoakSpec:
    """Request ``index`` of the run (deterministic in ``workload.seed`` and ``index``)."""
    rng = random.Random(workload.seed * 1_000_003 + index)
    cls = rng.choices(workload.prompt_classes, weights=[c.weight for c in workload.prompt_classes])[0]
    num_tokens = rng.randint(cls.min_tokens, cls.max_tokens)
    max_tokens = rng.randint(workload.min_new_tokens, workload.max_new_tokens)
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        sampling.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
    else:
        sampling["temperature"] = 0.0
    after_responses = after_s = None
    if rng.random() < workload.cancel_fraction:
        if rng.random() < 0.5:
            after_responses = rng.randint(1, max_tokens)
        else:
            after_s = rng.uniform(0.0, workload.max_cancel_delay_s) or workload.max_cancel_delay_s
    return SoakSpec(f"soak-{index:06d}", cls.name, varied_prompt(num_tokens, rng), num_tokens, max_tokens,
                    json.dumps(sampling), after_responses, after_s)


def check_loopback(url: str) -> str:
    """The host of ``url`` (``host:port`` or ``scheme://host:port/...``); raises ValueError unless
    loopback."""
    host = urlsplit(url if "://" in url else f"//{url}").hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"only loopback targets are allowed, got {url!r}")
    return host


# ------------------------------------------------------------------------------------------- one request's
# end


@dataclass
class SoakRecord:
    """What the client saw of one request: the latency record, how it ended, the error text if any."""

    spec: SoakSpec
    record: RequestRecord
    outcome: Outcome
    error: str | None = None
    num_responses: int = 0
    ended_s: float = 0.0   # perf_counter when the client stopped waiting (FINAL, error, cancel or deadline)


def decide_outcome(final_seen: bool, error: str | None, cancelled: bool, stream_closed: bool,
                   wait_bound: str, silent_s: float | None = None) -> Outcome:
    """How a stream ended. ``wait_bound`` is what stopped the client's wait when nothing else did first:
    ``"cancel"`` (the delayed cancel), ``"deadline"`` (per-request) or ``"drain"`` (end of the drain);
    ``silent_s``: seconds from the stream's last response to the end of the wait (None: no response)."""
    if error is not None:
        return Outcome.ERROR
    if final_seen:
        return Outcome.OK
    if cancelled:
        return Outcome.CANCELLED
    if stream_closed:
        return Outcome.NO_FINAL
    if wait_bound == "deadline":
        still_streaming = silent_s is not None and silent_s <= STILL_STREAMING_S
        return Outcome.TIMED_OUT if still_streaming else Outcome.NO_FINAL
    return {"cancel": Outcome.CANCELLED, "drain": Outcome.CUT_AT_DRAIN}[wait_bound]


_ERROR_KINDS = (  # (kind, pattern over the lowercased message), first match wins
    ("stub not healthy", r"stub process.*not healthy|stub.*(unhealthy|died|crash)"),
    ("server busy", r"busy|resource_exhausted|too many|queue is full|exceeds? .*capacity"),
    ("no healthy instance", r"no healthy \w+ instance"),
    ("timeout", r"time(d)? ?out|deadline"),
    ("unavailable",
     r"unavailable|connection refused|socket closed|failed to connect|connection reset|broken pipe"),
    ("aborted", r"abort"),
    ("cancelled", r"cancel"),
    ("bad request", r"invalid input|unknown key"),
)


def classify_error(message: str) -> str:
    """The kind of an error message: one of ``_ERROR_KINDS``' names, else ``"other"``."""
    text = message.lower()
    for kind, pattern in _ERROR_KINDS:
        if re.search(pattern, text):
            return kind
    return "other"


def is_stub_unhealthy(message: str) -> bool:
    return classify_error(message) == "stub not healthy"


# ------------------------------------------------------------------------------------------------ KV pages


_SERIES = re.compile(r"^(pd_kv_total_pages|pd_kv_free_pages)\{([^}]*)\}\s+(\S+)", re.MULTILINE)


def pages_in_use(metrics_text: str) -> dict[InstanceName, int]:
    """``pd_kv_total_pages - pd_kv_free_pages`` per ``model/instance`` on a Prometheus text page. An instance
    with a total but no free series counts all its pages as in use (nothing proves they came back)."""
    total: dict[str, float] = {}
    free: dict[str, float] = {}
    for name, labels, value in _SERIES.findall(metrics_text):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{found.get('model', '?')}/{found.get('instance', '?')}"
        (total if name == "pd_kv_total_pages" else free)[key] = float(value)
    return {key: int(round(pages - free.get(key, 0.0))) for key, pages in total.items()}


# ------------------------------------------------------------------------------------------------ stub census


def stub_instance(argv: Sequence[str]) -> InstanceName | None:
    """The model instance a python-backend stub serves, from its argv (``stub model.py shm size size ppid
    backend_dir ipc_key instance runtime``); ``None`` when ``argv`` is not a stub's."""
    if not argv or not argv[0].endswith(STUB_BINARY):
        return None
    if len(argv) >= 9:
        return argv[8]
    return argv[1] if len(argv) > 1 else "?"


@dataclass(frozen=True)
class StubDeath:
    """A stub pid that went away (``new_pid`` None) or was replaced by ``new_pid`` between two snapshots."""

    instance: InstanceName
    old_pid: int
    new_pid: int | None


def stub_deaths(before: Mapping[InstanceName, int], after: Mapping[InstanceName, int]) -> list[StubDeath]:
    """Instances of ``before`` whose pid is missing or different in ``after``. New instances are not
    deaths."""
    return [StubDeath(name, pid, after.get(name)) for name,
            pid in sorted(before.items()) if after.get(name) != pid]


@dataclass
class StubWatch:
    """Snapshots of {instance: pid} taken during the run; ``deaths`` accumulates every change seen."""

    first: dict[InstanceName, int] | None = None
    last: dict[InstanceName, int] = field(default_factory=dict)
    deaths: list[StubDeath] = field(default_factory=list)

    def observe(self, snapshot: Mapping[InstanceName, int]) -> list[StubDeath]:
        """Fold a snapshot in; returns the deaths it revealed. The first snapshot is the baseline; an instance
        that vanished counts once (coming back later under a new pid is the restart of that death)."""
        if self.first is None:
            self.first, self.last = dict(snapshot), dict(snapshot)
            return []
        new = stub_deaths(self.last, snapshot)
        self.deaths.extend(new)
        self.last = dict(snapshot)
        return new


# ---------------------------------------------------------------------------------------------------- summary


def summarize(records: Sequence[SoakRecord], duration_s: float, pages_not_returned: int | None,
              deaths: Sequence[StubDeath]) -> dict[str, Any]:
    """The run's figures. ``pages_not_returned`` None: the metrics endpoint could not be read at the end."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    by_outcome = Counter(r.outcome for r in records)
    errors = [r.error or "" for r in records if r.outcome is Outcome.ERROR]
    kinds = Counter(classify_error(e) for e in errors)
    examples: dict[str, str] = {}
    for message in errors:
        examples.setdefault(classify_error(message), message[:300])
    unhealthy = sum(is_stub_unhealthy(e) for e in errors)
    ok = [r.record for r in records if r.outcome is Outcome.OK and r.record.token_times_s]
    ttfts = [r.ttft_ms for r in ok]
    itls = [gap for r in ok for gap in r.itls_ms]
    ok_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "requests_sent": len(records),
        "completed_ok": by_outcome[Outcome.OK],
        "cancelled": by_outcome[Outcome.CANCELLED],
        "errors": by_outcome[Outcome.ERROR],
        "errors_by_kind": dict(sorted(kinds.items())),
        "error_examples": examples,
        "cut_at_drain": by_outcome[Outcome.CUT_AT_DRAIN],
        "timed_out_streaming": by_outcome[Outcome.TIMED_OUT],
        "streams_without_final": by_outcome[Outcome.NO_FINAL],
        "pages_not_returned": pages_not_returned,
        "stub_deaths": max(len(deaths), 1 if unhealthy else 0),
        "stub_death_details": [vars(d) for d in deaths],
        "stub_unhealthy_errors": unhealthy,
        "duration_s": round(duration_s, 3),
        "ok_requests_per_s": round(by_outcome[Outcome.OK] / duration_s, 4),
        "ok_output_tokens_per_s": round(ok_tokens / duration_s, 3),
        "ttft_p50_ms": round(percentile(ttfts, 50), 2),
        "ttft_p99_ms": round(percentile(ttfts, 99), 2),
        "itl_p50_ms": round(percentile(itls, 50), 2),
        "itl_p99_ms": round(percentile(itls, 99), 2),
    }


def failures(summary: Mapping[str, Any]) -> list[str]:
    """Why the run fails: each must-be-zero figure that is not 0 (unknown pages count as a failure)."""
    reasons = []
    if summary["streams_without_final"]:
        reasons.append(f"{summary['streams_without_final']} streams without FINAL")
    if summary["pages_not_returned"] is None:
        reasons.append("KV pages unknown (metrics endpoint unreadable after the drain)")
    elif summary["pages_not_returned"]:
        reasons.append(f"{summary['pages_not_returned']} KV pages not returned")
    if summary["stub_deaths"]:
        reasons.append(f"{summary['stub_deaths']} stub deaths")
    return reasons
