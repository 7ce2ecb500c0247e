"""The OpenAI front's cost: TTFT and ITL of the same requests over the front (``POST /v1/completions``, SSE)
and over gRPC straight to ``pd_ensemble``, in one run, against one server.

One ``scripts/serve.sh`` (``SKIP_SETUP=1 MODELS=pd_ensemble,prefill,decode OPENAI=1``) on free loopback ports
serves both paths; they take turns (never concurrently, so they never share the CPU) every ``concurrency``
requests, the order flipping every turn, so that the machine's drifting load (it is shared) hits both alike.
Seeded prompts of the same length on both paths but never the same text (the prefill engine's prefix cache
would serve a prompt sent twice from cache); completions, no chat template,
greedy with ``ignore_eos`` (exactly ``max_tokens`` tokens each), a few warm-up requests per path (not
counted), the same closed-loop schedule (concurrency 1, then 4).

* **direct**: one tritonclient gRPC stream per request (``enable_empty_final_response``) with the asyncio
  client the front itself uses, on one open channel, asking for the outputs the front asks for
  (``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``,
  ``return_num_cached_tokens``, where the model declares them), each response stamped as it is read.
* **front**: one HTTP/1.1 streaming POST per request (httpx, the HTTP client the openai SDK uses) on a
  keep-alive connection each client slot keeps open, each SSE ``data:`` event carrying text stamped as its
  line arrives.

Both keep their connections, as real clients do (the SDK holds one ``httpx.Client``): a new connection per
request would measure TCP/TLS-context setup on the client instead of the front.

TTFT is send → first non-empty text, ITL the gaps between successive non-empty texts, from
``time.perf_counter()`` on the client side. The front's added latency is front − direct, per percentile.
Target: added TTFT and ITL p50 <= 5 ms.

Usage::

    .venv/bin/python scripts/bench_openai_front.py            # 2 rounds x 8 x (128-token prompt, 32 new),
    c=1,4 .venv/bin/python scripts/bench_openai_front.py --quick    # 1 round x 4 x (64, 16), c=1
    .venv/bin/python scripts/bench_openai_front.py --concurrency 1 --requests 16 --prompt-tokens 4
    --max-tokens 8
                                                              # a probe: little compute next to the per-hop
                                                              cost

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from perf.server import ServeScript, free_ports  # noqa: E402 - scripts/ is on sys.path (above)
from perf.stats import RequestRecord, percentile  # noqa: E402 - scripts/ is on sys.path (above)
from perf.workload import make_prompt  # noqa: E402 - scripts/ is on sys.path (above)

logger = logging.getLogger("bench_openai_front")
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 40.0
REQUEST_TIMEOUT_S = 60.0
MODEL = "pd_ensemble"
TARGET_MS = 5.0
PROMPT_SALT = {"direct": 0, "front": 500_000}   # prompt seed offset per path
FRONT_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
               "return_num_cached_tokens")


@dataclass(frozen=True)
class BenchConfig:
    """
    Attributes:
        num_requests: measured requests per (path, concurrency, round).
        rounds: passes per (path, concurrency); the path order flips every round.
        prompt_tokens: words per prompt (about one token each).
        max_tokens: new tokens per request (``ignore_eos``: exactly this many).
        num_warmup: requests per path before measuring.
        concurrencies: closed-loop concurrencies.
        seed: prompt seed.
        log_dir: where the server log goes.
    """

    num_requests: int = 8
    rounds: int = 2
    prompt_tokens: int = 128
    max_tokens: int = 32
    num_warmup: int = 2
    concurrencies: tuple[int, ...] = (1, 4)
    seed: int = 0
    log_dir: Path = REPO_ROOT / "artifacts" / "bench_openai_front"

    def __post_init__(self) -> None:
        if min(self.num_requests, self.rounds, self.prompt_tokens, self.max_tokens, *self.concurrencies) < 1:
            raise ValueError(f"counts must be >= 1: {self}")


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: str
    max_tokens: int


SendFn = Callable[[Spec], RequestRecord]


class Stack:
    """serve.sh with the PD models and the front on free loopback ports."""

    def __init__(self, cfg: BenchConfig) -> None:
        *ports, openai_port = free_ports(5)
        self._server = ServeScript("pd_ensemble,prefill,decode", cfg.log_dir / "server.log",
                                   env={"OPENAI": "1", "OPENAI_PORT": str(openai_port)}, ports=ports)
        self.grpc_url = self._server.grpc_url
        self.openai_url = f"http://127.0.0.1:{openai_port}/v1"

    def start(self) -> Stack:
        import httpx2 as httpx

        self._server.start(READY_TIMEOUT_S)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.openai_url.removesuffix("/v1") + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"front not healthy:\n{self._server.log_tail()}")

    def stop(self) -> float:
        return self._server.stop(STOP_TIMEOUT_S)[0]


class DirectGrpc:
    """The direct path: tritonclient's asyncio gRPC client (what the front itself uses) on one event loop
    thread, one channel, one bidirectional stream per request; ``send`` may be called from any thread."""

    def __init__(self, grpc_url: str) -> None:
        import asyncio

        self._url = grpc_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-direct-loop", daemon=True)
        self._thread.start()
        self._client: Any = None
        self._declared: set[str] | None = None

    def send(self, spec: Spec) -> RequestRecord:
        import asyncio

        return asyncio.run_coroutine_threadsafe(self._send(spec), self._loop).result(REQUEST_TIMEOUT_S * 4)

    async def _send(self, spec: Spec) -> RequestRecord:
        import asyncio

        import numpy as np
        from tritonclient.grpc import InferInput
        from tritonclient.grpc.aio import InferenceServerClient

        if self._client is None:
            self._client = InferenceServerClient(self._url)

        def tensor(name: str, value: Any) -> Any:
            t = InferInput(name, [1], "BOOL" if isinstance(value, bool) else "BYTES")
            t.set_data_from_numpy(np.array([value],
                                           dtype=np.bool_ if isinstance(value, bool) else np.object_))
            return t

        params = json.dumps({"max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True})
        inputs = [tensor("text_input", spec.prompt.encode()), tensor("stream", True),
                  tensor("exclude_input_in_output", True), tensor("sampling_parameters", params.encode())]
        if self._declared is None:
            config = await self._client.get_model_config(MODEL, as_json=True)
            self._declared = {i["name"] for i in config["config"]["input"]}
        # the outputs the front asks for (usage and finish reasons), so both paths make the server do the same
        inputs += [tensor(flag, True) for flag in FRONT_FLAGS if flag in self._declared]
        ended = asyncio.Event()

        async def requests() -> Any:
            yield {"model_name": MODEL, "inputs": inputs, "request_id": spec.request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            await ended.wait()

        record = RequestRecord(spec.request_id, "direct", 0, time.perf_counter())
        responses = self._client.stream_infer(requests())
        try:
            async for result, error in responses:
                arrived = time.perf_counter()
                if error is not None:
                    record.error, record.done_s = str(error), arrived
                    break
                text = result.as_numpy("text_output")
                if text is not None and b"".join(text.reshape(-1)):
                    record.token_times_s.append(arrived)
                    record.num_output_tokens += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    record.done_s = arrived
                    break
        finally:
            ended.set()
            if record.done_s is None:
                responses.cancel()
        return record

    def close(self) -> None:
        import asyncio

        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def send_front(openai_url: str) -> SendFn:
    import httpx2 as httpx

    slot = threading.local()   # one keep-alive client per closed-loop slot thread

    def send(spec: Spec) -> RequestRecord:
        if not hasattr(slot, "client"):
            slot.client = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        body = {"model": MODEL, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        record = RequestRecord(spec.request_id, "front", 0, time.perf_counter())
        try:
            with slot.client.stream("POST", f"{openai_url}/completions", json=body) as resp:
                for line in resp.iter_lines():
                    arrived = time.perf_counter()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        record.done_s = arrived
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        record.error, record.done_s = event["error"]["message"], arrived
                        break
                    if any(c.get("text") for c in event.get("choices", ())):
                        record.token_times_s.append(arrived)
                        record.num_output_tokens += 1
                if resp.status_code != 200:
                    record.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
        except httpx.HTTPError as e:
            record.error = f"{type(e).__name__}: {e}"
        return record

    return send


def run_batch(pool: ThreadPoolExecutor, send: SendFn, specs: Sequence[Spec]) -> list[RequestRecord]:
    """``specs`` all at once on ``pool``'s long-lived slot threads (each keeps its connection)."""
    return list(pool.map(send, specs))


def make_specs(cfg: BenchConfig, prefix: str, count: int, seed_offset: int) -> list[Spec]:
    return [Spec(f"{prefix}-{i:03d}", make_prompt(cfg.prompt_tokens, cfg.seed * 100_003 + seed_offset + i),
                 cfg.max_tokens) for i in range(count)]


@dataclass(frozen=True)
class PathFigures:
    """Client-side latencies of one (path, concurrency), in ms; failed requests left out."""

    num_requests: int
    num_failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def figures(records: Sequence[RequestRecord]) -> PathFigures:
    ok = [r for r in records if r.ok]
    ttfts, itls = [r.ttft_ms for r in ok], [gap for r in ok for gap in r.itls_ms]
    return PathFigures(len(records), len(records) - len(ok), percentile(ttfts, 50), percentile(ttfts, 99),
                       percentile(itls, 50), percentile(itls, 99))


def added(direct: PathFigures, front: PathFigures) -> dict[str, float]:
    """Front minus direct, ms."""
    return {f"added_{k}": round(getattr(front, k) - getattr(direct, k), 2)
            for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}


def paired(direct: Sequence[RequestRecord], front: Sequence[RequestRecord]) -> dict[str, float]:
    """Median over prompts of (front - direct) for the same prompt sent back to back, in ms: TTFT and the
    request's mean ITL. Less noisy than a difference of percentiles on a shared machine."""
    by_id = {r.request_id: r for r in direct if r.ok}
    pairs = [(by_id[r.request_id], r) for r in front if r.ok and r.request_id in by_id]

    def mean_itl(r: RequestRecord) -> float:
        gaps = r.itls_ms
        return sum(gaps) / len(gaps) if gaps else float("nan")

    return {"paired_ttft_p50_ms": round(percentile([f.ttft_ms - d.ttft_ms for d, f in pairs], 50), 2),
            "paired_itl_p50_ms": round(percentile([mean_itl(f) - mean_itl(d) for d, f in pairs], 50), 2),
            "pairs": len(pairs)}


def measure(cfg: BenchConfig) -> dict[tuple[str, int], list[RequestRecord]]:
    """Per round and concurrency c: batches of c requests, each batch sent on one path then on the other (the
    order flipping every batch); returns every record by (path, c)."""
    stack = Stack(cfg).start()
    width = max(cfg.concurrencies)
    pools = {name: ThreadPoolExecutor(width,
                                      thread_name_prefix=f"bench-{name}") for name in ("direct", "front")}
    try:
        direct = DirectGrpc(stack.grpc_url)
        paths = {"direct": direct.send, "front": send_front(stack.openai_url)}
        for name, send in paths.items():   # every slot thread opens its connection here, uncounted
            run_batch(pools[name], send, make_specs(cfg, f"{name}-warm", max(cfg.num_warmup, width),
                                                    90_000 + PROMPT_SALT[name]))
        records: dict[tuple[str, int],
                      list[RequestRecord]] = {(n, c): [] for n in paths for c in cfg.concurrencies}
        turn = 0
        for r in range(cfg.rounds):
            for conc in cfg.concurrencies:
                specs = {name: make_specs(cfg, f"c{conc}-r{r}", cfg.num_requests,
                                          conc * 10_000 + r * 1_000 + salt)
                         for name, salt in PROMPT_SALT.items()}   # same ids (pairs), different prompts
                for start in range(0, cfg.num_requests, conc):
                    order = ("direct", "front") if turn % 2 == 0 else ("front", "direct")
                    turn += 1
                    for name in order:
                        done = run_batch(pools[name], paths[name], specs[name][start:start + conc])
                        for rec in done:
                            if not rec.ok:
                                logger.warning("%s %s failed: %s", name, rec.request_id, rec.error)
                        records[(name, conc)].extend(done)
                for name in paths:
                    logger.info("round %d c=%d %s: %s (load %s)", r, conc, name,
                                figures(records[(name, conc)]),
                                os.getloadavg())
        direct.close()
        return records
    finally:
        for pool in pools.values():
            pool.shutdown()
        logger.info("server stopped in %.1f s", stack.stop())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round x 4 x (64, 16), c=1")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = (BenchConfig(num_requests=4, rounds=1, prompt_tokens=64, max_tokens=16, num_warmup=1,
                       concurrencies=(1,))
           if a.quick else BenchConfig(num_requests=a.requests, rounds=a.rounds,
                                       concurrencies=tuple(a.concurrency),
                             prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens))
    load_before = os.getloadavg()
    records = measure(cfg)
    figs = {key: figures(recs) for key, recs in records.items()}
    print(
        f"{'path':8} {'c':>2} {'n':>3} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'ITL p99':>8}  (ms)")
    for (name, conc), f in sorted(figs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name:8} {conc:>2} {f.num_requests:>3} {f.num_failed:>4} {f.ttft_p50_ms:>9.1f} "
              f"{f.ttft_p99_ms:>9.1f} {f.itl_p50_ms:>8.1f} {f.itl_p99_ms:>8.1f}")
    result: dict[str,
                 Any] = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                         "load_before": load_before, "load_after": os.getloadavg(), "by_concurrency": {}}
    for conc in cfg.concurrencies:
        diff = {**added(figs[("direct", conc)], figs[("front", conc)]),
                **paired(records[("direct", conc)], records[("front", conc)])}
        print(f"c={conc}: front - direct: " + ", ".join(f"{k} {v:+.2f}" for k, v in diff.items()))
        result["by_concurrency"][str(conc)] = {"direct": asdict(figs[("direct", conc)]),
                                               "front": asdict(figs[("front", conc)]), **diff}
    failed = sum(f.num_failed for f in figs.values())
    result["failed"] = failed
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
