"""The PD router behind ``pd_ensemble``: admission, fleet discovery and health, pairing, child launch, merge.

One job per module:

* ``config``: ``RouterConfig`` (frozen), built once from the model's parameters;
* ``discovery``: who the fleet's members are (this server's PD models through Triton's repository index, or a
  membership registry);
* ``fleet``: the prefill/decode instances known to this router (optionally restricted by a static list), their
  load and health as each instance's own rendezvous reports them, freshness and circuit breakers;
* ``pairing``: policies that pick the (prefill, decode) pair of a request (load-aware, round robin, direct
  decode for short prompts);
* ``ranks``: the DP-attention rank of each paired instance that has ranks (the least loaded; cache-aware per
  rank);
* ``launch``: the ``Launcher`` seam that sends one child request and streams its responses (tritonclient gRPC
  streaming to any tritonserver; an in-process one for tests and benchmarks);
* ``admission``: at most ``max_inflight_requests`` orchestrated, a bounded queue behind them, "server busy"
  after;
* ``orchestrator``: one request's life: admit, pair, room, both children, merge, failover, cancellation;
* ``responder``: orchestrator chunks → the client's responses (Triton LLM convention);
* ``triton_model``: the python-backend adapter (own asyncio loop thread; ``execute`` only hands requests
  over).

Nothing here imports Triton except ``triton_model`` (lazily, through ``serving.triton.io``).
"""
