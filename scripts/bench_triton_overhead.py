"""Triton overhead: TTFT and ITL of the same requests through ``pd_ensemble`` over gRPC and through the Python
packages directly (no Triton), in one run.

Two paths, run one after the other (never concurrently, so they never share the CPU):

1. **direct**: in this process, what ``tests/serving/test_pd_workers.py``'s ``Cluster`` builds: a bootstrap
   server on port 0, ``create_pd_worker("prefill"|"decode")`` on the NIXL backend, ``PDOrchestrator`` +
   ``EnsembleResponder``; the client is a sink whose ``send`` stamps each text response.
2. **triton**: ``scripts/serve.sh`` (``SKIP_SETUP=1 MODELS=pd_ensemble,prefill,decode``) on free loopback
   ports; one tritonclient gRPC stream per request (``enable_empty_final_response``), each response stamped in
   the stream callback.

Both paths get the same engine knobs as the model repository's ``config.pbtxt`` (page_size 16, chunk 512,
prefill 512 pages, decode 1024 pages, one torch thread per engine), the same seeded prompts and greedy
sampling (``temperature 0``, ``ignore_eos``: exactly ``max_tokens`` tokens each), a few warm-up requests each
(not counted), and the same closed-loop schedule (concurrency 1, then optionally 4). TTFT is send → first
non-empty text, ITL the gaps between successive non-empty text responses, all from ``time.perf_counter()`` on
the client side. Targets: added TTFT p50 <= 10 ms, added ITL p50 <= 10 %.

Usage::

    .venv/bin/python scripts/bench_triton_overhead.py          # 2 rounds x 8 x (128-token prompt, 32 new), c=1,4
    .venv/bin/python scripts/bench_triton_overhead.py --quick  # < 2 min: 1 round x 4 x (128, 16), c=1

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from perf.server import ServeScript  # noqa: E402 - needs scripts/ on sys.path
from perf.stats import RequestRecord, percentile  # noqa: E402
from perf.workload import make_prompt  # noqa: E402

logger = logging.getLogger("bench_triton_overhead")

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 40.0
REQUEST_TIMEOUT_S = 30.0  # longest gap between two responses of one request
ENTRY_MODEL = "pd_ensemble"
TTFT_TARGET_MS = 10.0
ITL_TARGET_PCT = 10.0


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures. Engine knobs mirror ``model_repository/{prefill,decode}/config.pbtxt``.

    Attributes:
        num_requests: measured requests per (path, concurrency, round).
        rounds: passes per (path, concurrency); the path order flips every round.
        prompt_tokens: words per prompt (about one token each).
        max_tokens: new tokens per request (``ignore_eos``: exactly this many).
        num_warmup: requests per path before measuring (not counted).
        concurrencies: closed-loop concurrencies, measured in this order on both paths.
        prefill_pages / decode_pages: KV pool sizes in pages of ``page_size`` tokens.
        page_size, chunk_size, num_threads: engine knobs of both engines (tokens, tokens, torch threads).
        seed: prompt seed.
        log_dir: where the server log goes.
    """

    num_requests: int = 8
    rounds: int = 2
    prompt_tokens: int = 128
    max_tokens: int = 32
    num_warmup: int = 2
    concurrencies: tuple[int, ...] = (1, 4)
    prefill_pages: int = 512
    decode_pages: int = 1024
    page_size: int = 16
    chunk_size: int = 512
    num_threads: int = 1
    seed: int = 0
    log_dir: Path = REPO_ROOT / "artifacts" / "bench_triton_overhead"

    def __post_init__(self) -> None:
        if min(self.num_requests, self.rounds, self.prompt_tokens, self.max_tokens, *self.concurrencies) < 1:
            raise ValueError(f"counts must be >= 1: {self}")


@dataclass(frozen=True)
class Spec:
    """One request: its id, prompt and new-token count."""

    request_id: str
    prompt: str
    max_tokens: int

    @property
    def sampling_json(self) -> str:
        return json.dumps({"max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True})


#: ``send(spec) -> record``: runs one request to its end on one path, stamping client-side arrivals.
SendFn = Callable[[Spec], RequestRecord]


def make_specs(cfg: BenchConfig, prefix: str, count: int, seed_offset: int) -> list[Spec]:
    """``count`` seeded requests; the same (prefix-independent) prompts for the same seeds on both paths."""
    return [Spec(f"{prefix}-{i:03d}", make_prompt(cfg.prompt_tokens, cfg.seed * 100_003 + seed_offset + i),
                 cfg.max_tokens) for i in range(count)]


def load_avg() -> list[float]:
    """1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(v, 2) for v in os.getloadavg()]


# ---------------------------------------------------------------------------------------------------- direct


class _StampingSink:
    """The direct path's client: a ``ResponseSink`` stamping each non-empty text (perf_counter, s)."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.done = threading.Event()

    def send(self, chunk: Any, final: bool) -> None:
        now = time.perf_counter()
        if chunk.text:
            self.record.token_times_s.append(now)
        self.record.num_output_tokens = max(self.record.num_output_tokens, chunk.num_output_tokens)
        if final:
            self._end(now)

    def send_error(self, message: str) -> None:
        self.record.error = message
        self._end(time.perf_counter())

    def close(self) -> None:
        self._end(time.perf_counter())

    def is_cancelled(self) -> bool:
        return False

    def _end(self, now: float) -> None:
        self.record.done_s = now
        self.done.set()


class _ChildQueueSink:
    """A worker's ``ResponseSink`` for one child request: responses become ``ChildResponse``s in a queue
    (what pd_ensemble's BLS iterator would yield); iterate to read them up to FINAL."""

    def __init__(self) -> None:
        self._responses: queue.Queue[Any] = queue.Queue()

    def send(self, chunk: Any, final: bool) -> None:
        from serving.orchestrator import ChildResponse

        self._responses.put(ChildResponse(chunk.text, chunk.num_input_tokens, chunk.num_output_tokens,
                                          chunk.finish_reason, None, final))

    def send_error(self, message: str) -> None:
        from serving.orchestrator import ChildResponse

        self._responses.put(ChildResponse(error=message, final=True))

    def close(self) -> None:
        from serving.orchestrator import ChildResponse

        self._responses.put(ChildResponse(final=True))

    def is_cancelled(self) -> bool:
        return False

    def __iter__(self) -> Iterator[Any]:
        while True:
            response = self._responses.get(timeout=REQUEST_TIMEOUT_S)
            yield response
            if response.final:
                return


class DirectPD:
    """1P1D in this process on the NIXL backend, driven by ``PDOrchestrator`` as pd_ensemble drives it."""

    def __init__(self, cfg: BenchConfig) -> None:
        self._cfg = cfg
        self._server: Any = None
        self._handles: list[Any] = []

    def start(self) -> DirectPD:
        """Bootstrap server (port 0), prefill and decode workers (models loaded), orchestrator."""
        from bootstrap import BootstrapServer, RegistryConfig, ServerConfig
        from bootstrap.client import BootstrapClient
        from serving.config import WorkerConfig
        from serving.orchestrator import PDOrchestrator, RoomAllocator, RoundRobinPairing
        from serving.pd_factory import create_pd_worker

        self._server = BootstrapServer(ServerConfig(port=0, registry=RegistryConfig()))
        self._server.start()
        cfg = self._cfg
        base = WorkerConfig(page_size=cfg.page_size, chunk_size=cfg.chunk_size,
                            max_num_batched_tokens=cfg.chunk_size, num_threads=cfg.num_threads,
                            kv_backend="nixl", bootstrap_url=self._server.url)
        self.prefill = create_pd_worker("prefill", replace(base, num_pages=cfg.prefill_pages), "prefill")
        self.decode = create_pd_worker("decode", replace(base, num_pages=cfg.decode_pages), "decode_0")
        self._handles = [self.prefill, self.decode]
        for handle in self._handles:
            handle.start()
        self._client = BootstrapClient(self._server.url)
        self._readers = ThreadPoolExecutor(16, thread_name_prefix="direct-child")
        self._orchestrator = PDOrchestrator(RoundRobinPairing(["prefill"], ["decode"]), RoomAllocator(),
                                            self._client.abort_room, self._readers)
        return self

    def send(self, spec: Spec) -> RequestRecord:
        """Run ``spec`` through the orchestrator on this thread; stamps come from the client sink."""
        from serving.orchestrator import EnsembleResponder
        from serving.request import parse_request

        request = parse_request({"text_input": spec.prompt, "stream": True, "exclude_input_in_output": True,
                                 "sampling_parameters": spec.sampling_json})
        record = RequestRecord(spec.request_id, "chat", 0, time.perf_counter())
        sink = _StampingSink(record)
        self._orchestrator.generate(lambda call: iter(self._launch(call, request)),
                                    EnsembleResponder(request, sink).emit, sink.is_cancelled)
        return record

    def _launch(self, call: Any, request: Any) -> _ChildQueueSink:
        from serving.pd_request import PDRequest

        child = _ChildQueueSink()
        handle = self.prefill if call.role == "prefill" else self.decode
        handle.worker.handle(PDRequest(request, call.room, call.prefill_model), child)
        return child

    def stop(self) -> None:
        """Decode, prefill, then the bootstrap server (the reverse of start)."""
        for handle in reversed(self._handles):
            handle.stop()
        if hasattr(self, "_readers"):
            self._readers.shutdown(wait=True)
            self._client.close()
        if self._server is not None:
            self._server.stop()


# ---------------------------------------------------------------------------------------------------- triton


class TritonPD:
    """``scripts/serve.sh`` with the PD models on free loopback ports, in its own process group."""

    def __init__(self, cfg: BenchConfig) -> None:
        self._server = ServeScript("pd_ensemble,prefill,decode", cfg.log_dir / "server.log")
        self.http_url, self.grpc_url = self._server.http_url, self._server.grpc_url
        self.log_path = self._server.log_path

    def start(self) -> TritonPD:
        """Start serve.sh and wait for ``/v2/health/ready``. Raises RuntimeError/TimeoutError (log tail)."""
        self._server.start(READY_TIMEOUT_S)
        return self

    def send(self, spec: Spec) -> RequestRecord:
        """Send ``spec`` on its own gRPC stream; stamp each response in the stream callback until FINAL."""
        import tritonclient.grpc as grpcclient

        events: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
        record = RequestRecord(spec.request_id, "chat", 0, time.perf_counter())
        cancel = False
        try:
            client.async_stream_infer(ENTRY_MODEL, _grpc_inputs(spec), request_id=spec.request_id,
                                      enable_empty_final_response=True)
            while record.done_s is None:
                _record_response(record, *events.get(timeout=REQUEST_TIMEOUT_S))
        except queue.Empty:  # the server never ended the stream: fail this request, cancel it, go on
            cancel = True
            record.error = (f"no response for {REQUEST_TIMEOUT_S:.0f} s "
                            f"({len(record.token_times_s)} texts so far)")
            logger.error("triton %s: %s", spec.request_id, record.error)
        finally:
            client.stop_stream(cancel_requests=cancel)
            client.close()
        return record

    def stop(self) -> float:
        """Stops serve.sh's group (``ServeScript.stop``); returns the seconds the stop took."""
        return self._server.stop(STOP_TIMEOUT_S)[0]


def _grpc_inputs(spec: Spec) -> list[Any]:
    from perf.stream_client import stream_inputs  # tritonclient only where the Triton path runs

    return stream_inputs(spec.prompt, spec.sampling_json)


def _record_response(record: RequestRecord, arrived_s: float, result: Any, error: Any) -> None:
    """Fold one stream callback (its arrival time in s) into ``record``; sets ``done_s`` at FINAL or error."""
    if error is not None:
        record.error, record.done_s = str(error), arrived_s
        return
    text = result.as_numpy("text_output")
    if text is not None and b"".join(text.reshape(-1)):
        record.token_times_s.append(arrived_s)
    count = result.as_numpy("num_output_tokens")   # tokens of this response (the vLLM convention)
    if count is not None:
        record.num_output_tokens += int(count.reshape(-1)[0])
    params = result.get_response().parameters
    if "triton_final_response" in params and params["triton_final_response"].bool_param:
        record.done_s = arrived_s


# ---------------------------------------------------------------------------------------------------- driving


def run_closed_loop(send: SendFn, specs: Sequence[Spec], concurrency: int) -> list[RequestRecord]:
    """Send ``specs`` from ``concurrency`` slots, each slot waiting for its previous request to end."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="bench-slot") as pool:
        return list(pool.map(send, specs))


@dataclass(frozen=True)
class PathFigures:
    """Client-side latencies of one (path, concurrency) pass, in ms; ``num_failed`` requests are left out."""

    num_requests: int
    num_failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_mean_ms: float


def figures(records: Sequence[RequestRecord]) -> PathFigures:
    """TTFT and ITL percentiles over the successful records (ITL gaps of all requests pooled)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_ms for r in ok]
    itls = [gap for r in ok for gap in r.itls_ms]
    return PathFigures(num_requests=len(records), num_failed=len(records) - len(ok),
                       ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
                       itl_p50_ms=percentile(itls, 50), itl_p99_ms=percentile(itls, 99),
                       itl_mean_ms=float(np.mean(itls)) if itls else float("nan"))


def overhead(direct: PathFigures, triton: PathFigures) -> dict[str, float]:
    """Triton minus direct: TTFT in ms, ITL in ms and in % of the direct ITL."""
    def pct(t: float, d: float) -> float:
        return (t - d) / d * 100.0 if d > 0 else float("nan")

    return {"added_ttft_p50_ms": triton.ttft_p50_ms - direct.ttft_p50_ms,
            "added_ttft_p99_ms": triton.ttft_p99_ms - direct.ttft_p99_ms,
            "added_itl_p50_ms": triton.itl_p50_ms - direct.itl_p50_ms,
            "added_itl_pct": pct(triton.itl_p50_ms, direct.itl_p50_ms),
            "added_itl_p99_pct": pct(triton.itl_p99_ms, direct.itl_p99_ms),
            "added_itl_mean_pct": pct(triton.itl_mean_ms, direct.itl_mean_ms)}


def warm_up(name: str, send: SendFn, cfg: BenchConfig) -> None:
    """``cfg.num_warmup`` requests, not counted (a failure is logged: the measured passes count theirs)."""
    warm = run_closed_loop(send, make_specs(cfg, f"{name}-warm", cfg.num_warmup, 90_000), 1)
    for r in warm:
        if not r.ok:
            logger.error("%s warm-up %s failed: %s", name, r.request_id, r.error)


#: (path name, concurrency) → records of every round, pooled.
Records = dict[tuple[str, int], list[RequestRecord]]


def run_rounds(paths: dict[str, SendFn], cfg: BenchConfig) -> Records:
    """Per round and concurrency, one pass per path, one path after the other (their requests never overlap);
    the order flips every round, so a drift of the machine's load hits both paths alike. Every path gets
    the same specs in a (round, concurrency) pass."""
    records: Records = {(name, conc): [] for name in paths for conc in cfg.concurrencies}
    for r in range(cfg.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for conc in cfg.concurrencies:
            specs = make_specs(cfg, f"c{conc}-r{r}", cfg.num_requests, conc * 10_000 + r * 1_000)
            for name in order:
                done = run_closed_loop(paths[name], specs, conc)
                _check_outputs(name, done, cfg.max_tokens)
                records[(name, conc)].extend(done)
                logger.info("round %d c=%d %s: %s (load %s)", r, conc, name, figures(done), load_avg())
    return records


def _check_outputs(name: str, records: Sequence[RequestRecord], max_tokens: int) -> None:
    for r in records:
        if not r.ok or r.num_output_tokens != max_tokens:
            logger.warning("%s %s: error=%s, %d/%d tokens", name, r.request_id, r.error, r.num_output_tokens,
                           max_tokens)


def measure(cfg: BenchConfig, loads: dict[str, list[float]]) -> Records:
    """Start the direct stack, then the Triton one (both idle but for the pass being measured), warm both
    up, run the rounds, stop Triton, then the direct stack."""
    # the UCX settings serve.sh gives the PD models (shared-memory notifications, loopback only)
    from kv_transfer.nixl_transport import ucx_defaults

    for key, value in ucx_defaults().items():
        os.environ.setdefault(key, value)
    direct = DirectPD(cfg)
    server = TritonPD(cfg)
    try:
        direct.start()
        server.start()
        paths: dict[str, SendFn] = {"direct": direct.send, "triton": server.send}
        for name, send in paths.items():
            warm_up(name, send, cfg)
        loads["measure_start"] = load_avg()
        return run_rounds(paths, cfg)
    finally:
        logger.info("server stopped in %.1f s (log: %s)", server.stop(), server.log_path)
        direct.stop()


# ---------------------------------------------------------------------------------------------------- report


def table(figs: dict[tuple[str, int], PathFigures], concurrencies: Sequence[int]) -> str:
    """One row per (concurrency, path) plus the overhead row (ms; the ITL overhead in %)."""
    lines = [f"{'conc':>4} {'path':>7} {'n':>3} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'ITL p99':>8} {'ITL mean':>8}"]
    for conc in concurrencies:
        for name in ("direct", "triton"):
            f = figs[(name, conc)]
            lines.append(f"{conc:>4} {name:>7} {f.num_requests:>3} {f.num_failed:>4} {f.ttft_p50_ms:>9.1f} "
                         f"{f.ttft_p99_ms:>9.1f} {f.itl_p50_ms:>8.2f} {f.itl_p99_ms:>8.2f} "
                         f"{f.itl_mean_ms:>8.2f}")
        o = overhead(figs[("direct", conc)], figs[("triton", conc)])
        lines.append(f"{conc:>4} {'added':>7} {'':>3} {'':>4} {o['added_ttft_p50_ms']:>+9.1f} "
                     f"{o['added_ttft_p99_ms']:>+9.1f} {o['added_itl_pct']:>+7.1f}% "
                     f"{o['added_itl_p99_pct']:>+7.1f}% {o['added_itl_mean_pct']:>+7.1f}%")
    return "\n".join(lines)


def summary_line(cfg: BenchConfig, figs: dict[tuple[str, int], PathFigures],
                 loads: dict[str, list[float]]) -> dict[str, Any]:
    """The JSON last line: the first concurrency at the top level, every concurrency under ``passes``."""
    first = cfg.concurrencies[0]
    d, t = figs[("direct", first)], figs[("triton", first)]
    o = overhead(d, t)
    line: dict[str, Any] = {
        "concurrency": first, "num_requests": cfg.num_requests * cfg.rounds, "rounds": cfg.rounds,
        "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
        "direct_ttft_p50_ms": d.ttft_p50_ms, "triton_ttft_p50_ms": t.ttft_p50_ms,
        "direct_ttft_p99_ms": d.ttft_p99_ms, "triton_ttft_p99_ms": t.ttft_p99_ms,
        "direct_itl_p50_ms": d.itl_p50_ms, "triton_itl_p50_ms": t.itl_p50_ms,
        "direct_itl_p99_ms": d.itl_p99_ms, "triton_itl_p99_ms": t.itl_p99_ms, **o,
        "ttft_target_met": o["added_ttft_p50_ms"] <= TTFT_TARGET_MS,
        "itl_target_met": o["added_itl_pct"] <= ITL_TARGET_PCT,
        "num_failed": d.num_failed + t.num_failed,
        "passes": {str(c): _pass_summary(figs[("direct", c)], figs[("triton", c)])
                   for c in cfg.concurrencies},
        "load_avg": loads, "cpus": os.cpu_count(),
    }
    return _rounded(line)


def _pass_summary(direct: PathFigures, triton: PathFigures) -> dict[str, Any]:
    return {"direct": _rounded(vars(direct)), "triton": _rounded(vars(triton)),
            **_rounded(overhead(direct, triton))}


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """The one place the CLI becomes a ``BenchConfig``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round, 4 requests x 16 new tokens, c=1")
    p.add_argument("--num-requests", type=int, default=None, help="requests per path, concurrency and round")
    p.add_argument("--rounds", type=int, default=None, help="rounds (the path order flips each round)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--concurrency", default=None, help="e.g. 1,4 (the first is the headline)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    conc = tuple(int(c) for c in a.concurrency.split(",")) if a.concurrency else ((1,) if a.quick else (1, 4))
    return BenchConfig(num_requests=a.num_requests or (4 if a.quick else 8),
                       rounds=a.rounds or (1 if a.quick else 2),
                       prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens or (16 if a.quick else 32),
                       num_warmup=1 if a.quick else 2, concurrencies=conc, seed=a.seed)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    cfg = parse_config(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server this run started is stopped
    loads = {"start": load_avg()}
    records = measure(cfg, loads)
    loads["end"] = load_avg()
    figs = {key: figures(recs) for key, recs in records.items()}
    print(table(figs, cfg.concurrencies), flush=True)
    print(json.dumps(summary_line(cfg, figs, loads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
