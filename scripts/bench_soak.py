"""Soak test: thousands of mixed requests with random client cancels against a live server, for a set time.

``--concurrency`` client slots (default 32) each send one request after another, every request on its own gRPC
stream (``tritonclient.grpc.aio``, ``enable_empty_final_response`` so the FINAL flag is seen), until
``--duration-s`` has passed; then the run waits at most ``--drain-s`` for the open streams. Requests mix
short, medium and long prompts (8..1500 words of varied text) and random ``max_tokens``; ``--cancel-fraction``
of them are cancelled by the client (the gRPC call is cancelled, as ``stop_stream(cancel_requests=True)``
does) after a random number of responses or a random delay. A request still open after ``--request-timeout-s``
is a stream without FINAL when it had been silent for ``perf.soak.STILL_STREAMING_S`` (30 s) by then, else
"timed out while streaming" (slow under the load: counted apart, not a failure). After the drain the KV pages
in use on the metrics endpoint are polled (up to ``--pages-wait-s``) until 0, and the python-backend stubs of
the server are compared with those at the start (``perf/soak.py`` has the rules).

Usage::

    .venv/bin/python scripts/bench_soak.py --launch --model colocated --duration-s 120
    .venv/bin/python scripts/bench_soak.py --launch --duration-s 1800 --out artifacts/soak.json   #
    pd_ensemble .venv/bin/python scripts/bench_soak.py --url 127.0.0.1:8001 --metrics-url
    http://127.0.0.1:8002/metrics

Prints a progress line every ``--progress-s``, then the figures and one JSON line last. Exit 1 when streams
without FINAL, KV pages not returned or stub deaths are not all 0; 2 when the server could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from perf.server import ServeScript  # noqa: E402 - needs scripts/ on sys.path
from perf.soak import (  # noqa: E402
    InstanceName,
    Outcome,
    SoakRecord,
    SoakSpec,
    SoakWorkload,
    StubWatch,
    check_loopback,
    decide_outcome,
    draw_spec,
    failures,
    is_stub_unhealthy,
    pages_in_use,
    stub_instance,
    summarize,
)
from perf.stats import RequestRecord  # noqa: E402
from perf.stream_client import read_to_end  # noqa: E402

logger = logging.getLogger("bench_soak")

MODELS_OF = {"pd_ensemble": "pd_ensemble,prefill,decode", "colocated": "colocated"}
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 40.0
ERROR_BACKOFF_S = 0.1  # a slot pauses this long after an error, so a dead server is not hammered
GRPC_GRACE_S = 5.0  # the gRPC deadline sits this far behind the client's own, only as a backstop


@dataclass(frozen=True)
class SoakConfig:
    """One soak run. Times in s; ``url`` is gRPC ``host:port`` (ignored with ``launch``)."""

    model: str
    url: str
    metrics_url: str
    launch: bool
    models: str
    duration_s: float
    drain_s: float
    request_timeout_s: float
    pages_wait_s: float
    concurrency: int
    progress_s: float
    workload: SoakWorkload
    out: Path | None
    log_dir: Path

    def __post_init__(self) -> None:
        if self.concurrency < 1 or min(self.duration_s, self.request_timeout_s, self.progress_s) <= 0:
            raise ValueError(
                f"concurrency, duration, request timeout and progress interval must be > 0: {self}")
        if self.drain_s < 0 or self.pages_wait_s < 0:
            raise ValueError(f"drain_s and pages_wait_s must be >= 0: {self}")
        if not self.launch:
            check_loopback(self.url)
            check_loopback(self.metrics_url)


# ---------------------------------------------------------------------------------------------------- server


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def server_pid(grpc_port: int) -> int | None:
    """The tritonserver serving gRPC on ``grpc_port`` (its command line names the port; 8001 when none
    does)."""
    for pid in _pids():
        argv = _cmdline(pid)
        if not argv or not argv[0].endswith("tritonserver"):
            continue
        ports = [a.split("=", 1)[1] for a in argv if a.startswith("--grpc-port=")]
        if ports == [str(grpc_port)] or (not ports and grpc_port == 8001):
            return pid
    return None


def stub_snapshot(server: int | None) -> dict[InstanceName, int]:
    """{model instance: pid} of the python-backend stubs whose parent is ``server`` ({} when it is gone)."""
    if server is None:
        return {}
    snapshot = {}
    for pid in _pids():
        instance = stub_instance(_cmdline(pid))
        if instance is not None and _ppid(pid) == server:
            snapshot[instance] = pid
    return snapshot


def read_pages(metrics_url: str) -> dict[InstanceName, int] | None:
    """KV pages in use per instance; None when the endpoint cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            return pages_in_use(resp.read().decode())
    except OSError:
        return None


def wait_pages_returned(metrics_url: str, wait_s: float) -> tuple[int | None, dict[InstanceName, int] | None]:
    """Poll until no page is in use or ``wait_s`` passed; (sum of pages in use, per instance) of the last
    read."""
    deadline = time.monotonic() + wait_s
    while True:
        pages = read_pages(metrics_url)
        if (pages is not None and sum(pages.values()) == 0) or time.monotonic() >= deadline:
            return (None if pages is None else sum(pages.values())), pages
        time.sleep(1.0)


# ---------------------------------------------------------------------------------------------------- client


@dataclass
class _Stream:
    """What the reader task saw of one stream."""

    record: RequestRecord
    final_seen: bool = False
    error: str | None = None
    cancelled: bool = False
    closed: bool = False
    num_responses: int = 0
    last_response_s: float | None = None   # perf_counter of the last response


def _int_output(result: Any, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None or array.size == 0 else int(array.reshape(-1)[0])


async def _read(responses: Any, st: _Stream, cancel_after: int | None) -> None:
    """Fold responses into ``st`` until FINAL or an error (either way the stream is then read to its end),
    the client's k-th-response cancel, or the stream's end."""
    try:
        async for result, error in responses:
            now = time.perf_counter()
            if error is not None:
                st.error = str(error)
                await read_to_end(responses)   # not dropped half-read: see read_to_end
                return
            st.num_responses += 1
            st.last_response_s = now
            delta = _int_output(result, "num_output_tokens")   # tokens of this response
            if delta:
                st.record.token_times_s.append(now)
                st.record.num_output_tokens += delta
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                st.final_seen, st.record.done_s = True, now
                # read on to the call's end (the server closes it right after FINAL: our half is closed):
                # a call dropped here is cancelled when grpc.aio collects it, and a cancel that races the
                # end of a stream whose FINAL went out makes tritonserver 2.51 keep the model loaded until
                # its exit timeout (docs/healing.md section 4; the chaos smoke's router stop took 40 s so)
                await read_to_end(responses)
                return
            if cancel_after is not None and st.num_responses >= cancel_after:
                st.cancelled = True
                return
        st.closed = True
    except Exception as exc:  # noqa: BLE001 - a grpc error ends this request only
        st.error = _grpc_error_text(exc)


def _grpc_error_text(exc: Exception) -> str:
    """``CODE: details`` of a grpc error (``StatusCode.UNAVAILABLE: Socket closed``), else ``Type:
    message``."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code()}: {details()}"
    return f"{type(exc).__name__}: {exc}"


async def send_one(client: Any, model: str, spec: SoakSpec, timeout_s: float,
                   drain_end_s: float) -> SoakRecord:
    """Run ``spec`` on its own stream; never waits past the request's deadline, its cancel delay or the
    drain."""
    from perf.stream_client import stream_inputs

    async def one_request() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": stream_inputs(spec.prompt, spec.sampling_json),
               "request_id": spec.request_id, "parameters": {"triton_enable_empty_final_response": True}}

    st = _Stream(RequestRecord(spec.request_id, spec.kind, spec.num_prompt_tokens, time.perf_counter()))
    bounds = {"deadline": timeout_s, "drain": drain_end_s - st.record.sent_s,
              "cancel": spec.cancel_after_s if spec.cancel_after_s is not None else math.inf}
    bound = min(bounds, key=lambda k: bounds[k])
    try:
        responses = client.stream_infer(one_request(), stream_timeout=timeout_s + GRPC_GRACE_S)
    except Exception as exc:  # noqa: BLE001 - a stream that cannot even open fails this request only
        st.error = _grpc_error_text(exc)
        return SoakRecord(spec, st.record, Outcome.ERROR, st.error, ended_s=time.perf_counter())
    reader = asyncio.create_task(_read(responses, st, spec.cancel_after_responses))
    try:
        await asyncio.wait({reader}, timeout=max(0.0, bounds[bound]))
    finally:
        if not (st.final_seen or st.closed or st.error is not None):
            # the aio form of stop_stream(cancel_requests=True), only for a stream still open: tritonserver
            # 2.51 keeps the model of a stream cancelled after its FINAL loaded until its exit timeout
            # (docs/healing.md)
            responses.cancel()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    ended_s = time.perf_counter()
    silent_s = None if st.last_response_s is None else ended_s - st.last_response_s
    outcome = decide_outcome(st.final_seen, st.error, st.cancelled, st.closed, bound, silent_s)
    if outcome in (Outcome.NO_FINAL, Outcome.TIMED_OUT):
        logger.log(logging.ERROR if outcome is Outcome.NO_FINAL else logging.WARNING,
                   "%s: %s (%d responses, %s, %s)", spec.request_id,
                   "no FINAL" if outcome is Outcome.NO_FINAL else "still streaming at its deadline",
                   st.num_responses, "stream closed" if st.closed else f"{timeout_s:.0f} s deadline",
                   "no response" if silent_s is None else f"last response {silent_s:.1f} s before")
    elif outcome is Outcome.ERROR and is_stub_unhealthy(st.error or ""):
        logger.error("%s: %s", spec.request_id, st.error)
    return SoakRecord(spec, st.record, outcome, st.error, st.num_responses, ended_s)


class SoakRun:
    """The client side of one run: slots, progress, the records."""

    def __init__(self, cfg: SoakConfig, grpc_url: str, metrics_url: str, server: int | None) -> None:
        self.cfg, self.grpc_url, self.metrics_url, self.server = cfg, grpc_url, metrics_url, server
        self.records: list[SoakRecord] = []
        self.watch = StubWatch()
        self._next_index = 0
        self._open = 0
        self._start_s = 0.0

    async def run(self) -> float:
        """Issue until ``duration_s``, drain; returns the wall time (s) from the first send to the last
        end."""
        import tritonclient.grpc.aio as grpcclient

        self.watch.observe(stub_snapshot(self.server))
        self._start_s = time.perf_counter()
        issue_end_s = self._start_s + self.cfg.duration_s
        drain_end_s = issue_end_s + self.cfg.drain_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        progress = asyncio.create_task(self._progress())
        try:
            await asyncio.gather(*(self._slot(client, issue_end_s, drain_end_s)
                                   for _ in range(self.cfg.concurrency)))
        finally:
            progress.cancel()
            await asyncio.gather(progress, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), timeout=10)
        return time.perf_counter() - self._start_s

    async def _slot(self, client: Any, issue_end_s: float, drain_end_s: float) -> None:
        while time.perf_counter() < issue_end_s:
            spec = draw_spec(self.cfg.workload, self._next_index)
            self._next_index += 1
            self._open += 1
            try:
                record = await send_one(client, self.cfg.model, spec, self.cfg.request_timeout_s, drain_end_s)
            finally:
                self._open -= 1
            self.records.append(record)
            if record.outcome is Outcome.ERROR:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_s)
            self.watch.observe(await asyncio.to_thread(stub_snapshot, self.server))
            pages = await asyncio.to_thread(read_pages, self.metrics_url)
            print(self.progress_line(pages), flush=True)

    def progress_line(self, pages: dict[InstanceName, int] | None) -> str:
        counts = {o: 0 for o in Outcome}
        for r in self.records:
            counts[r.outcome] += 1
        tokens = sum(r.record.num_output_tokens for r in self.records if r.outcome is Outcome.OK)
        elapsed_s = time.perf_counter() - self._start_s
        return (f"[soak {elapsed_s:6.0f} s] sent {len(self.records) + self._open} ok {counts[Outcome.OK]} "
                f"cancelled {counts[Outcome.CANCELLED]} errors {counts[Outcome.ERROR]} "
                f"no_final {counts[Outcome.NO_FINAL]} timed_out {counts[Outcome.TIMED_OUT]} open "
                f"{self._open} pages_in_use {'?' if pages is None else sum(pages.values())} "
                f"stub_deaths {len(self.watch.deaths)} ok_tok/s {tokens / max(elapsed_s, 1e-9):.1f}")


# ---------------------------------------------------------------------------------------------------- driving


def soak(cfg: SoakConfig, grpc_url: str, metrics_url: str) -> dict[str, Any]:
    """Run the soak against a live server; the summary (``perf.soak.summarize``) plus where and how."""
    server = server_pid(int(grpc_url.rsplit(":", 1)[1]))
    if server is None:
        logger.warning(
            "no tritonserver process found for %s: stub deaths come from error texts only", grpc_url)
    run = SoakRun(cfg, grpc_url, metrics_url, server)
    duration_s = asyncio.run(run.run())
    logger.info("drained; waiting up to %.0f s for KV pages to come back", cfg.pages_wait_s)
    pages, per_instance = wait_pages_returned(metrics_url, cfg.pages_wait_s)
    run.watch.observe(stub_snapshot(server))
    summary = summarize(run.records, duration_s, pages, run.watch.deaths)
    summary.update(pages_by_instance=per_instance, stubs_at_start=run.watch.first,
                   stubs_at_end=run.watch.last,
                   server_pid=server, server_alive_at_end=server is not None and bool(_cmdline(server)))
    return summary


def report(cfg: SoakConfig, summary: dict[str, Any]) -> str:
    s = summary
    lines = [f"soak {cfg.model}: {s['duration_s']:.0f} s, concurrency {cfg.concurrency}",
             f"  requests sent          {s['requests_sent']}",
             f"  completed ok           {s['completed_ok']}",
             f"  cancelled              {s['cancelled']}",
             f"  errors                 {s['errors']}  {s['errors_by_kind']}",
             f"  cut at drain           {s['cut_at_drain']}",
             f"  timed out, streaming   {s['timed_out_streaming']}",
             f"  streams without FINAL  {s['streams_without_final']}   (must be 0)",
             f"  pages not returned     {s['pages_not_returned']}   (must be 0) {s['pages_by_instance']}",
             f"  stub deaths            {s['stub_deaths']}   (must be 0) {s['stub_death_details']}",
             f"  throughput             {s['ok_requests_per_s']:.3f} ok req/s, "
             f"{s['ok_output_tokens_per_s']:.1f} "
             "ok output tok/s",
             f"  TTFT p50/p99           {s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f} ms",
             f"  ITL p50/p99            {s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} ms"]
    for kind, message in s["error_examples"].items():
        lines.append(f"  e.g. {kind}: {message[:200]}")
    return "\n".join(lines)


def parse_config(argv: list[str] | None = None) -> SoakConfig:
    """The one place the CLI becomes a ``SoakConfig``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pd_ensemble", help="entry model (pd_ensemble, colocated)")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server (loopback)")
    p.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    p.add_argument("--launch", action="store_true",
                   help="start scripts/serve.sh on free ports, stop it at the end")
    p.add_argument("--models", default=None,
                   help="models to load with --launch (default: what --model needs)")
    p.add_argument("--duration-s", type=float, default=1800.0, help="issue new requests for this long")
    p.add_argument("--drain-s", type=float, default=None, help="then wait this long for open streams "
                   "(default: the request timeout, so every open stream ends or hits its deadline)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="a stream still open after this "
                   "(no FINAL, no error) counts as a stream without FINAL")
    p.add_argument("--pages-wait-s", type=float, default=30.0,
                   help="poll KV pages in use this long after the drain")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-cancel-delay-s", type=float, default=5.0)
    p.add_argument("--min-new-tokens", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--progress-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    p.add_argument("--log-dir", type=Path, default=REPO_ROOT / "artifacts" / "bench_soak")
    a = p.parse_args(argv)
    if a.model not in MODELS_OF and a.launch and a.models is None:
        p.error(f"--launch with --model {a.model} needs --models")
    workload = SoakWorkload(min_new_tokens=a.min_new_tokens, max_new_tokens=a.max_new_tokens,
                            cancel_fraction=a.cancel_fraction, max_cancel_delay_s=a.max_cancel_delay_s,
                            seed=a.seed)
    return SoakConfig(model=a.model, url=a.url, metrics_url=a.metrics_url, launch=a.launch,
                      models=a.models or MODELS_OF.get(a.model, a.model), duration_s=a.duration_s,
                      drain_s=a.request_timeout_s if a.drain_s is None else a.drain_s,
                      request_timeout_s=a.request_timeout_s, pages_wait_s=a.pages_wait_s,
                      concurrency=a.concurrency, progress_s=a.progress_s, workload=workload, out=a.out,
                      log_dir=a.log_dir)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    cfg = parse_config(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server this run started is stopped
    server = None
    grpc_url, metrics_url = cfg.url, cfg.metrics_url
    if cfg.launch:
        server = ServeScript(cfg.models, cfg.log_dir / f"server-{cfg.model}.log")
        try:
            server.start(READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            logger.error("server did not start: %s", exc)
            server.stop(STOP_TIMEOUT_S)
            return 2
        grpc_url, metrics_url = server.grpc_url, server.metrics_url
        logger.info("launched %s on %s (log %s)", cfg.models, grpc_url, server.log_path)
    try:
        summary = soak(cfg, grpc_url, metrics_url)
    finally:
        if server is not None:
            server.stop(STOP_TIMEOUT_S)
    summary["failures"] = failures(summary)
    summary["config"] = {**asdict(cfg), "out": str(cfg.out), "log_dir": str(cfg.log_dir),
                         "grpc_url": grpc_url, "metrics_url": metrics_url}
    summary["load_avg"] = [round(v, 2) for v in os.getloadavg()]
    print(report(cfg, summary), flush=True)
    if summary["requests_sent"] and not summary["completed_ok"]:
        print("WARNING: no request completed ok (the must-be-0 figures say little about such a run)",
              flush=True)
    print("FAIL: " + "; ".join(summary["failures"]) if summary["failures"] else "PASS", flush=True)
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, default=str), flush=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
