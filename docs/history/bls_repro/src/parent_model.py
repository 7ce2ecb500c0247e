import asyncio, threading, time, json, traceback
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import triton_python_backend_utils as pb_utils

CHILDREN = ["child_a", "child_b"]

def _child_req(name):
    return pb_utils.InferenceRequest(
        model_name=name,
        inputs=[pb_utils.Tensor("IN", np.array([1], dtype=np.int32))],
        requested_output_names=["OUT"])

def _drain_and_send(it, sender, use_numpy=True):
    n = 0
    for resp in it:
        if resp.has_error():
            raise RuntimeError(resp.error().message())
        t = pb_utils.get_output_tensor_by_name(resp, "OUT")
        if t is not None:
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", t.as_numpy().copy())]))
            n += 1
    return n

class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.mode = cfg["parameters"]["MODE"]["string_value"]
        global CHILDREN
        CHILDREN = cfg["parameters"].get("CHILDREN", {}).get("string_value", "child_a,child_b").split(",")
        self.pool = ThreadPoolExecutor(max_workers=32)
        self.log = open("/tmp/bls_repro/logs/parent.log", "a", buffering=1)
        self.log.write(f"{time.time():.3f} init mode={self.mode}\n")
        self.grpc_url = cfg["parameters"].get("GRPC_URL", {}).get("string_value", "127.0.0.1:19101")
        import collections
        self.grave = collections.deque()
        self.grave_lock = threading.Lock()
        self.keep = self.mode.endswith("_keep")
        self.base = self.mode[:-5] if self.keep else self.mode
        if self.mode.startswith("async"):
            # executor pinned explicitly so we know its size
            self.aexec = ThreadPoolExecutor(max_workers=32)

    def _bury(self, it):
        # keep the BLS response iterator alive for 5 s so that the stub's
        # stub->parent thread (SendCleanupId: response_iterator_map_.erase) never
        # drops the LAST reference without the GIL
        now = time.time()
        with self.grave_lock:
            self.grave.append((now, it))
            old = []
            while self.grave and now - self.grave[0][0] > 5.0:
                old.append(self.grave.popleft())
        del old   # released here, GIL held

    # ---------- synchronous worker (modes thread / inline) ----------
    def _work_sync(self, sender):
        try:
            for c in CHILDREN:
                it = _child_req(c).exec(decoupled=True)
                _drain_and_send(it, sender)
                if self.keep: self._bury(it)
                del it
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:
            self.log.write(f"EXC {e!r}\n")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ---------- coroutine paths ----------
    async def _work_async(self, sender):
        loop = asyncio.get_running_loop()
        try:
            for c in CHILDREN:
                it = await _child_req(c).async_exec(decoupled=True)
                if self.base == "async_exec":       # drain + send in an executor thread
                    await loop.run_in_executor(self.aexec, _drain_and_send, it, sender)
                elif self.base == "async_loop":     # drain + send on the loop thread
                    _drain_and_send(it, sender)
                if self.keep: self._bury(it)
                del it
            if self.base == "async_exec":
                await loop.run_in_executor(self.aexec, lambda: sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:
            self.log.write(f"EXC {e!r}\n{traceback.format_exc()}\n")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ---------- no BLS at all: children reached through the server's own gRPC port ----------
    async def _work_grpc(self, sender):
        import tritonclient.grpc.aio as aio
        from tritonclient.grpc import InferInput
        if getattr(self, "_gc", None) is None:
            _o = aio._get_inference_request
            def _p(**kw):
                r = _o(**kw); r.parameters["triton_enable_empty_final_response"].bool_param = True; return r
            aio._get_inference_request = _p
            self._gc = aio.InferenceServerClient(self.grpc_url)
        try:
            for c in CHILDREN:
                done = asyncio.Event()
                async def gen():
                    i = InferInput("IN", [1], "INT32"); i.set_data_from_numpy(np.array([1], np.int32))
                    yield dict(model_name=c, inputs=[i])
                    await done.wait()
                async for res, err in self._gc.stream_infer(inputs_iterator=gen()):
                    if err is not None:
                        raise RuntimeError(str(err))
                    out = res.as_numpy("OUT")
                    if out is not None:
                        sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", out.copy())]))
                    if res.get_response().parameters["triton_final_response"].bool_param:
                        break
                done.set()
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:
            self.log.write(f"EXC {e!r}\n{traceback.format_exc()}\n")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def _execute_async(self, requests):
        work = self._work_grpc if self.base == "grpc" else self._work_async
        await asyncio.gather(*[work(r.get_response_sender()) for r in requests])
        return None

    def execute(self, requests):
        if self.base == "thread":
            for r in requests:
                self.pool.submit(self._work_sync, r.get_response_sender())
            return None
        if self.base == "inline":
            for r in requests:
                self._work_sync(r.get_response_sender())
            return None
        return self._execute_async(requests)   # coroutine -> stub event loop (background)

    def finalize(self):
        self.log.write(f"{time.time():.3f} finalize\n")

