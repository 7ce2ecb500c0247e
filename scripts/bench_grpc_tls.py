#!/usr/bin/env python
"""What TLS on tritonserver's gRPC costs per request: two servers in one run, one plaintext and one with
``GRPC_SSL_*`` (``scripts/serve.sh``, a self-signed certificate made here with ``openssl``), the same models
on each, compute made nearly free (``perf/tiny_model.py``), requests interleaved between them.

Each server runs ``prefill``, ``decode`` (NIXL) and two routers over them: ``pd_ensemble`` (child requests to
the workers' own endpoints, the default: only the client's hop is gRPC) and ``pd_triton`` (a copy with
``worker_endpoints`` false: the client's hop and both children cross tritonserver's gRPC). In each of
``--rounds`` rounds, one greedy request of ``--tokens`` tokens (``ignore_eos``) goes to each router of each
server in turn, on one persistent channel per server; then ``--rounds`` new channels per server each make
one unary call (``ServerLive``): a connection's set-up, TLS handshake included. Printed: p50 TTFT and
whole-request time per path, plaintext and TLS, with the ratio TLS / plaintext and the difference in ms;
the CPU time each server's processes (tritonserver and its stubs) spent per request during the request rounds
(both routers' requests; less noisy than latency on a shared host); and the connection set-up. The last line
is one JSON object with every figure.

    PYTHONPATH=. .venv/bin/python scripts/bench_grpc_tls.py                # 40 rounds x 32 tokens
    PYTHONPATH=. .venv/bin/python scripts/bench_grpc_tls.py --mutual       # clients present a certificate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
for path in (SCRIPTS, SCRIPTS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from perf.server import Deployment, ServeScript, build_model_repository  # noqa: E402
from perf.stats import percentile  # noqa: E402
from perf.stream_client import COUNT_ONLY, grpcclient, send_request  # noqa: E402
from perf.tiny_model import build_tiny_llama  # noqa: E402
from perf.workload import RequestSpec  # noqa: E402

ROUTERS = ("pd_ensemble", "pd_triton")
REQUEST_TIMEOUT_S = 120.0
WARMUP_ROUNDS = 2
READY_S = 300.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--mutual", action="store_true", help="GRPC_SSL_MUTUAL=1: clients present a certificate")
    p.add_argument("--log-dir", type=Path, default=None)
    return p.parse_args()


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key): self-signed RSA-2048, naming 127.0.0.1 and localhost (its own CA)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def server(name: str, tmp: Path, model: str, tls_env: dict[str, str], log_dir: Path) -> ServeScript:
    workers = {"model": model}
    repository = build_model_repository(
        Deployment(name=name, entry_model="pd_ensemble", models=("prefill", "decode", *ROUTERS),
                   overrides={"prefill": workers, "decode": workers,
                              "pd_ensemble": {"worker_endpoints": "true"},
                              "pd_triton": {"worker_endpoints": "false"}},
                   copies={"pd_triton": "pd_ensemble"}), tmp / f"{name}-models")
    return ServeScript(",".join(("prefill", "decode", *ROUTERS)), log_dir / f"{name}.log", repository,
                       env=tls_env)


def client_kwargs(cert: Path, key: Path, mutual: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"ssl": True, "root_certificates": str(cert)}
    if mutual:
        kwargs.update(private_key=str(key), certificate_chain=str(cert))
    return kwargs


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes of group ``pgid`` (a server: serve.sh, tritonserver,
    its stubs), from ``/proc/<pid>/stat``."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:   # fields after the name: state, ppid, pgrp, ..., utime (11), stime (12)
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def requests_phase(urls: dict[str, str], tls: dict[str, Any], args: argparse.Namespace
                         ) -> dict[str, dict[str, list[float]]]:
    """{"<server>/<router>": {"ttft_ms": [...], "total_ms": [...]}} from interleaved rounds."""
    clients = {"plain": grpcclient.InferenceServerClient(urls["plain"]),
               "tls": grpcclient.InferenceServerClient(urls["tls"], **tls)}
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for i in range(-WARMUP_ROUNDS, args.rounds):   # warm-up rounds: not in the latencies
            for router in ROUTERS:
                for name, client in clients.items():
                    spec = RequestSpec(request_id=f"{name}-{router}-{i}", kind="decode", prompt="Hi",
                                       num_prompt_tokens=1, max_tokens=args.tokens)
                    record = await send_request(client, router, spec, REQUEST_TIMEOUT_S, COUNT_ONLY)
                    if not record.ok or record.done_s is None:
                        raise RuntimeError(f"{name} {router}: {record.error}")
                    if i >= 0:
                        figures = out.setdefault(f"{name}/{router}", {"ttft_ms": [], "total_ms": []})
                        figures["ttft_ms"].append(record.ttft_ms)
                        figures["total_ms"].append((record.done_s - record.sent_s) * 1e3)
    finally:
        for client in clients.values():
            await client.close()
    return out


async def connect_phase(urls: dict[str, str], tls: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Milliseconds from a new channel to the answer of its first ``ServerLive``, per server, interleaved."""
    out: dict[str, list[float]] = {"plain": [], "tls": []}
    for _ in range(rounds):
        for name in out:
            start = time.perf_counter()
            client = grpcclient.InferenceServerClient(urls[name], **(tls if name == "tls" else {}))
            try:
                assert await client.is_server_live()
            finally:
                await client.close()
            out[name].append((time.perf_counter() - start) * 1e3)
    return out


def report(requests: dict[str, dict[str, list[float]]], connects: dict[str, list[float]],
           cpu_ms: dict[str, float]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for router in ROUTERS:
        for metric in ("ttft_ms", "total_ms"):
            plain = percentile(requests[f"plain/{router}"][metric], 50)
            tls = percentile(requests[f"tls/{router}"][metric], 50)
            figures.update({f"{router}_{metric}_plain": plain, f"{router}_{metric}_tls": tls,
                            f"{router}_{metric}_ratio": tls / plain, f"{router}_{metric}_delta": tls - plain})
            print(f"{router:<12} {metric[:-3]:<6} p50 plaintext {plain:7.2f} ms  TLS {tls:7.2f} ms  "
                  f"ratio {tls / plain:5.3f}  {tls - plain:+6.2f} ms", flush=True)
    plain, tls = cpu_ms["plain"], cpu_ms["tls"]
    figures.update(server_cpu_ms_per_request_plain=plain, server_cpu_ms_per_request_tls=tls,
                   server_cpu_ratio=tls / plain)
    print(f"server CPU per request plaintext {plain:.2f} ms  TLS {tls:.2f} ms  ratio {tls / plain:.3f}  "
          f"{tls - plain:+.2f} ms", flush=True)
    plain, tls = percentile(connects["plain"], 50), percentile(connects["tls"], 50)
    figures.update(connect_ms_plain=plain, connect_ms_tls=tls, connect_ratio=tls / plain)
    print(f"new channel + first call p50 plaintext {plain:.2f} ms  TLS {tls:.2f} ms  ratio {tls / plain:.2f}",
          flush=True)
    return figures


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-grpc-tls-") as tmp_name:
        tmp = Path(tmp_name)
        log_dir = args.log_dir or tmp / "logs"
        cert, key = make_certificate(tmp)
        model = str(build_tiny_llama(tmp / "tiny"))
        tls_env = {"GRPC_SSL_CERT": str(cert), "GRPC_SSL_KEY": str(key), "GRPC_SSL_ROOT_CERT": str(cert),
                   "GRPC_SSL_MUTUAL": "1" if args.mutual else "0"}
        servers = {"plain": server("plain", tmp, model, {}, log_dir),
                   "tls": server("tls", tmp, model, tls_env, log_dir)}
        try:
            for s in servers.values():
                s.start(READY_S)
            urls = {name: s.grpc_url for name, s in servers.items()}
            tls = client_kwargs(cert, key, args.mutual)
            groups = {name: s._proc.pid for name, s in servers.items() if s._proc is not None}
            before = {name: group_cpu_s(pgid) for name, pgid in groups.items()}
            requests = asyncio.run(requests_phase(urls, tls, args))
            count = (args.rounds + WARMUP_ROUNDS) * len(ROUTERS)   # every request each server served
            cpu_ms = {name: (group_cpu_s(pgid) - before[name]) * 1e3 / count for name, pgid in groups.items()}
            connects = asyncio.run(connect_phase(urls, tls, args.rounds))
        finally:
            for s in servers.values():
                s.stop(60.0)
    figures = report(requests, connects, cpu_ms)
    out = {k: round(v, 3) for k, v in figures.items()}
    out.update(rounds=args.rounds, tokens=args.tokens, mutual=args.mutual,
               load_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
