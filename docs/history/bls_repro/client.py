"""Drive N concurrent gRPC streams against a decoupled model; bounded by --total and --deadline."""
import argparse, asyncio, time, sys
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput
import tritonclient.grpc.aio as _aio
_orig = _aio._get_inference_request
def _patched(**kw):
    r = _orig(**kw)
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    return r
_aio._get_inference_request = _patched

ap = argparse.ArgumentParser()
ap.add_argument("--url", default="127.0.0.1:19101")
ap.add_argument("--model", default="parent")
ap.add_argument("--streams", type=int, default=16)
ap.add_argument("--total", type=int, default=500)
ap.add_argument("--req-timeout", type=float, default=10.0)
ap.add_argument("--deadline", type=float, default=120.0)
ap.add_argument("--expect", type=int, default=6)   # non-final responses expected per request
a = ap.parse_args()

stats = dict(ok=0, err=0, timeout=0, bad=0, sent=0)
errs = []

async def worker(wid, client, t_end):
    q = asyncio.Queue()
    async def gen():
        while True:
            item = await q.get()
            if item is None:
                return
            yield item
    it = client.stream_infer(inputs_iterator=gen())
    ait = it.__aiter__()
    try:
        while stats["sent"] < a.total and time.time() < t_end:
            stats["sent"] += 1
            rid = f"{wid}-{stats['sent']}"
            inp = InferInput("IN", [1], "INT32"); inp.set_data_from_numpy(np.array([1], dtype=np.int32))
            await q.put(dict(model_name=a.model, inputs=[inp], request_id=rid))
            n = 0
            while True:
                try:
                    res, err = await asyncio.wait_for(ait.__anext__(), a.req_timeout)
                except asyncio.TimeoutError:
                    stats["timeout"] += 1; errs.append(f"{rid} timeout"); return
                except StopAsyncIteration:
                    stats["err"] += 1; errs.append(f"{rid} stream ended"); return
                if err is not None:
                    stats["err"] += 1; errs.append(f"{rid} {err}"); return
                final = res.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
                n += 1
            if n == a.expect: stats["ok"] += 1
            else: stats["bad"] += 1; errs.append(f"{rid} got {n} responses")
    finally:
        await q.put(None)
        try: it.cancel()
        except Exception: pass

async def main():
    client = grpcclient.InferenceServerClient(a.url)
    t0 = time.time()
    await asyncio.gather(*[worker(i, client, t0 + a.deadline) for i in range(a.streams)], return_exceptions=True)
    dt = time.time() - t0
    await client.close()
    print(f"RESULT streams={a.streams} ok={stats['ok']} bad={stats['bad']} err={stats['err']} timeout={stats['timeout']} secs={dt:.1f}")
    for e in errs[:5]: print("  ", e[:300])

asyncio.run(main())
