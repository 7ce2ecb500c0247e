"""What a child request's fleet signature costs: the router's ``sign_child`` and the worker's
``ChildAuth.check`` (``serving.workers.child_auth``) per child request, against the child hop's own time.

Both run once per child stream (a request's prefill and decode children: two each), never per token. For each
prompt length the script builds the router's decode child request (the prompt as text and as token ids, as the
router sends them) and times, in this process, what a fleet secret adds: the router's ``sign_child`` over the
arrays it builds the request from anyway (``inputs_digest`` + HMAC), and the worker's ``ChildAuth.check`` over
the arrays it parses the request into anyway (``inputs_digest`` + HMAC + the replay guard). The hop: one child
call over a real worker endpoint (``WorkerEndpoint`` on loopback, a worker that answers with one FINAL
response at once, ``EndpointLauncher``), open to FINAL, with a fleet secret and without, alternating rounds so
the host's load affects both. Printed: one line per prompt length, then JSON.

    PYTHONPATH=. .venv/bin/python scripts/bench_fleet_auth.py
    PYTHONPATH=. .venv/bin/python scripts/bench_fleet_auth.py --tokens 128 4096 --calls 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

from serving.delta import ResponseChunk
from serving.parsing.pd_request import PDRequest
from serving.router.fleet import Target
from serving.router.launch import ChildCall, EndpointLauncher, child_arrays, child_request, sign_child
from serving.stream import ResponseSink
from serving.workers.child_auth import NO_AUTH, ChildAuth
from serving.workers.endpoint import WorkerEndpoint, request_arrays

SECRET = b"bench-fleet-secret"
INSTANCE = "decode@127.0.0.1:8001"


class _AnswerAtOnce:
    """A worker that answers every request with one FINAL response on the calling thread."""

    def handle(self, pd: PDRequest, sink: ResponseSink) -> str:
        sink.send(ResponseChunk.single(text="x", finish_reason="stop", num_output_tokens=1), final=True)
        return str(pd.room)


def decode_call(num_tokens: int, address: str, room: int) -> ChildCall:
    """The decode child of a request whose prompt is ``num_tokens`` tokens (~4 characters each)."""
    target = Target(INSTANCE, "decode", address, "decode", worker_endpoint=True)
    prompt = ("lorem " * (num_tokens * 2 // 3 + 1)).encode()
    return ChildCall("decode", target, room, "prefill@127.0.0.1:8001", "http://127.0.0.1:9000",
                     inputs={"text_input": prompt, "sampling_parameters": b'{"max_tokens": 64}'},
                     prompt_token_ids=tuple(range(1000, 1000 + num_tokens)), tokenizer_id="tok")


def per_call_us(fn: Callable[[int], object], calls: int) -> float:
    """Median microseconds of ``fn(i)`` over ``calls`` calls (in 10 batches)."""
    batches = []
    per_batch = max(1, calls // 10)
    for b in range(10):
        start = time.perf_counter()
        for i in range(per_batch):
            fn(b * per_batch + i)
        batches.append((time.perf_counter() - start) / per_batch * 1e6)
    return statistics.median(batches)


def sign_and_verify_us(num_tokens: int, calls: int) -> tuple[float, float]:
    """(router's sign_child, worker's check) in microseconds per child request."""
    auth = ChildAuth(SECRET, INSTANCE)
    calls_made = [decode_call(num_tokens, "x:1", i) for i in range(calls + 10)]
    router_arrays = [child_arrays(c) for c in calls_made]
    sign = per_call_us(lambda i: sign_child(calls_made[i], SECRET, router_arrays[i]), calls)
    wires = [child_request(c) for c in calls_made]
    worker_arrays = [request_arrays(w) for w in wires]
    signatures = [sign_child(c, SECRET) for c in calls_made]
    verify = per_call_us(lambda i: auth.check(signatures[i], "decode", wires[i].id, worker_arrays[i]), calls)
    return sign, verify


async def _hop_ms(launcher: EndpointLauncher, call: ChildCall) -> float:
    start = time.perf_counter()
    async for delta in launcher.stream(call):
        if delta.final:
            break
    return (time.perf_counter() - start) * 1e3


def hop_ms(num_tokens: int, rounds: int, per_round: int) -> tuple[float, float]:
    """p50 ms of one child call open → FINAL over a worker endpoint, (with a fleet secret, without)."""
    secured = WorkerEndpoint("127.0.0.1", 0, "decode", ChildAuth(SECRET, INSTANCE)).bind()
    open_ = WorkerEndpoint("127.0.0.1", 0, "decode", NO_AUTH).bind()
    for endpoint in (secured, open_):
        endpoint.start(_AnswerAtOnce())

    async def run() -> tuple[list[float], list[float]]:
        with_auth, without = EndpointLauncher(SECRET), EndpointLauncher(None)
        timed: tuple[list[float], list[float]] = ([], [])
        room = 1
        for r in range(rounds + 1):   # round 0 warms both connections up, not counted
            for launcher, endpoint, out in ((with_auth, secured, timed[0]), (without, open_, timed[1])):
                for _ in range(per_round):
                    room += 1
                    ms = await _hop_ms(launcher, decode_call(num_tokens, endpoint.address, room))
                    if r:
                        out.append(ms)
        await with_auth.close()
        await without.close()
        return timed

    try:
        secured_ms, open_ms = asyncio.run(run())
    finally:
        secured.stop(1.0)
        open_.stop(1.0)
    return statistics.median(secured_ms), statistics.median(open_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 2048, 32768], help="prompt lengths")
    parser.add_argument("--calls", type=int, default=200, help="sign/verify calls timed per prompt length")
    parser.add_argument("--rounds", type=int, default=10, help="alternating hop rounds per prompt length")
    parser.add_argument("--per-round", type=int, default=20, help="child calls per transport per round")
    args = parser.parse_args()
    rows = []
    for num_tokens in args.tokens:
        sign_us, verify_us = sign_and_verify_us(num_tokens, args.calls)
        secured_ms, open_ms = hop_ms(num_tokens, args.rounds, args.per_round)
        row = {"prompt_tokens": num_tokens, "sign_us": round(sign_us, 1), "verify_us": round(verify_us, 1),
               "hop_p50_ms_secret": round(secured_ms, 3), "hop_p50_ms_no_secret": round(open_ms, 3),
               "auth_over_hop": round((sign_us + verify_us) / 1e3 / open_ms, 3)}
        rows.append(row)
        print(f"prompt {num_tokens:>6} tokens: sign {sign_us:7.1f} us + verify {verify_us:7.1f} us per child "
              f"request; hop p50 {open_ms:.3f} ms without a secret, {secured_ms:.3f} ms with one; "
              f"(sign + verify) / hop = {row['auth_over_hop']:.3f}")
    print(json.dumps({"load_average": os.getloadavg()[0], "runs": rows}))


if __name__ == "__main__":
    main()
