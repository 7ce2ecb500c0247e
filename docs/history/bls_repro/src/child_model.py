import threading, time, os, json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = cfg.get("parameters", {})
        self.nresp = int(p.get("NRESP", {}).get("string_value", "3"))
        self.delay = float(p.get("DELAY", {}).get("string_value", "0.002"))
        self.name = args["model_name"]
        self.verbose = p.get("VERBOSE", {}).get("string_value", "0") == "1"
        self.log = open(f"/tmp/bls_repro/logs/{self.name}.log", "a", buffering=1)

    def _work(self, req_id, sender):
        try:
            # empty first response at once, so exec(decoupled=True) returns immediately
            sender.send(pb_utils.InferenceResponse(output_tensors=[]))
            for i in range(self.nresp):
                time.sleep(self.delay)
                if sender.is_cancelled():
                    self.log.write(f"{time.time():.3f} {req_id} cancelled at {i}\n")
                    break
                t0 = time.time()
                out = pb_utils.Tensor("OUT", np.array([i], dtype=np.int32))
                if self.verbose:
                    self.log.write(f"{t0:.3f} {req_id} i={i} sending...\n")
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                dt = time.time() - t0
                if self.verbose:
                    self.log.write(f"{time.time():.3f} {req_id} i={i} sent in {dt*1000:.1f} ms, is_cancelled={sender.is_cancelled()}\n")
                if dt > 1.0:
                    self.log.write(f"{time.time():.3f} {req_id} send took {dt:.1f}s\n")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if self.verbose:
                self.log.write(f"{time.time():.3f} {req_id} FINAL sent\n")
        except Exception as e:
            self.log.write(f"{time.time():.3f} {req_id} EXC {e!r}\n")

    def execute(self, requests):
        for r in requests:
            threading.Thread(target=self._work, args=(r.request_id(), r.get_response_sender()), daemon=True).start()
        return None
