"""Tensor parallelism inside one engine instance: rank processes, their group, the step broadcast, and the
Megatron-style slicing of a Llama-family model (docs/parallelism.md).

- ``layout``: which heads, MLP columns and vocabulary rows a rank holds (``RankShard``, ``KVHeadSlice``).
- ``communicator``: the collectives seam (``Communicator``); ``shm`` (CPU ranks of one host) and
  ``torch_comm`` (gloo / NCCL process groups) implement it.
- ``step``: the step broadcast's message (a DP-attention step: every rank's own batch in one message).
- ``dp``: the token exchanges of DP attention (``enable_dp_attention``).
- ``group``: rank 0's side (``TensorParallelGroup``, ``ParallelCausalLM``); ``rank_worker``: ranks 1..N-1.

``layout`` imports nothing (the model and its loader use it); the models also import ``dp`` and
``communicator`` (torch only); ``group``, ``rank_worker`` and the collectives' implementations are imported
only when an engine with ranks is built.
"""
