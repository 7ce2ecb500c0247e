"""A python-backend model whose initialize takes INIT_S seconds (default 6) while a thread sets a custom
metric and logs every millisecond, as the project's engine models do while they load. Used by run.sh."""
import os
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily(name="init_stall_ticks", description="ticks during initialize",
                                       kind=pb_utils.MetricFamily.GAUGE)
        self.family, self.metric = family, family.Metric(labels={"model": args["model_name"]})

        def tick() -> None:
            i = 0
            while True:
                self.metric.set(i)
                pb_utils.Logger.log_verbose(f"tick {i}")
                i += 1
                time.sleep(0.001)

        threading.Thread(target=tick, daemon=True).start()
        open(os.environ["INIT_STALL_MARK"], "w").close()   # tells run.sh that initialize is running
        time.sleep(float(os.environ.get("INIT_S", "6")))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
