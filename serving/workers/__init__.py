"""The workers: what serves one request on one engine, with no Triton in sight. ``engine_loop`` owns the
engine's thread; ``prefill`` and ``decode`` are the PD roles (built by ``pd_factory`` with their KV manager;
``intake`` hands their requests from Triton's execute thread to the loop), ``colocated`` the one-engine
baseline; ``parallel_sampling`` fans ``n`` samples into one client stream; ``endpoint`` is a PD worker's own
endpoint for child requests, and ``child_auth`` checks their fleet signatures on it and through
tritonserver."""
