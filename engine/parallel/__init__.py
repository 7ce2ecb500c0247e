"""Tensor parallelism inside one engine instance: rank processes, their group, the step broadcast, and the
Megatron-style slicing of a Llama-family model (docs/parallelism.md).

- ``layout``: which heads, MLP columns and vocabulary rows a rank holds (``RankShard``, ``KVHeadSlice``).
- ``communicator``: the collectives seam (``Communicator``); ``shm`` (CPU ranks of one host) and
  ``torch_comm`` (gloo / NCCL process groups) implement it.
- ``step``: the step broadcast's message.
- ``group``: rank 0's side (``TensorParallelGroup``, ``ParallelCausalLM``); ``rank_worker``: ranks 1..N-1.

``layout`` imports nothing (the model and its loader use it); nothing here is imported by ``engine`` until an
engine with ``tensor_parallel_size`` > 1 is built.
"""
