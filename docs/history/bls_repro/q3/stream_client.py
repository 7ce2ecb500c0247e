# one gRPC aio stream to MODEL; prints every response; runs until killed or done
import asyncio, sys, time, numpy as np
import tritonclient.grpc.aio as aio
from tritonclient.grpc import InferInput
_o = aio._get_inference_request
def _p(**kw):
    r = _o(**kw); r.parameters["triton_enable_empty_final_response"].bool_param = True; return r
aio._get_inference_request = _p
async def main(model, url):
    c = aio.InferenceServerClient(url)
    async def gen():
        i = InferInput("IN", [1], "INT32"); i.set_data_from_numpy(np.array([1], np.int32))
        yield dict(model_name=model, inputs=[i], request_id="victim")
        await asyncio.sleep(3600)
    n = 0
    async for res, err in c.stream_infer(inputs_iterator=gen()):
        n += 1
        print(f"{time.time():.3f} resp {n} err={err}", flush=True)
asyncio.run(main(sys.argv[1], sys.argv[2]))
