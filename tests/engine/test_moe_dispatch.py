"""The ``TokenDispatcher`` contract (engine/model/moe_dispatch.py): every local expert gets exactly its
tokens' rows, in token order (rank 0's first), an expert nobody chose gets none, ``combine`` returns each
token's weighted sum in token order; ``AllToAllDispatcher`` over 2 and over 4 gloo ranks (CPU processes,
loopback) equals ``LocalDispatcher`` bit for bit, also for a rank with no tokens and for ranks whose experts
lie in the middle of the expert order, and gives the same rows when the
counts are passed in (``counts_by_source``) instead of exchanged; an MoE block at expert-parallel size
2 equals the same block at 1; a rank that is gone fails the next dispatch with ``DispatchError`` instead of
a hang. ``SharedMemoryDispatcher`` (ranks as threads over one shared region) meets the same contract, bf16
included, and fails with ``DispatchError`` when a peer aborted (at once), never comes (after the timeout) or
an exchange exceeds the slot (at once on every rank).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import torch

from engine.model.moe_dispatch import AllToAllDispatcher, DispatchError, LocalDispatcher, counts_by_source

HIDDEN, EXPERTS, TOP_K = 6, 8, 2
SPAWN_TIMEOUT_S = 120.0


def expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """A stand-in expert whose output names it: ``rows * (expert + 1) + expert`` (exact in fp32)."""
    return rows * (expert + 1) + expert


def run_experts(sent, experts: range) -> torch.Tensor:
    """Each row of ``sent.hidden`` through its expert, in ``sent.hidden``'s row order (what combine takes)."""
    out = torch.empty_like(sent.hidden)
    for e, start, stop in sent.expert_blocks():
        out[start:stop] = expert_fn(sent.hidden[start:stop], experts[e])
    return out


def tokens_of(rank: int, count: int, seed: int, top_k: int = TOP_K
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``count`` tokens: hidden ``[count, H]``, top-``top_k`` ids among experts 0..6 (expert 7
    never chosen), float32 weights."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    hidden = torch.randn(count, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:top_k] for _ in range(count)]) if count \
        else torch.zeros(0, top_k, dtype=torch.int64)
    return hidden, ids, torch.rand(count, top_k, generator=gen)


def test_local_dispatch_gives_each_expert_its_tokens_in_order_and_combine_weights_them() -> None:
    hidden = torch.arange(4 * HIDDEN, dtype=torch.float32).view(4, HIDDEN)
    ids = torch.tensor([[3, 0], [0, 5], [5, 3], [1, 0]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.75, 0.125], [3.0, 4.0]])
    sent = LocalDispatcher(EXPERTS).dispatch(hidden, ids, weights)
    assert sent.counts == [3, 1, 0, 2, 0, 2, 0, 0]   # experts 2, 4, 6, 7: empty
    per = sent.per_expert()
    assert torch.equal(per[0], hidden[[0, 1, 3]]) and torch.equal(per[3], hidden[[0, 2]])
    assert torch.equal(per[5], hidden[[1, 2]]) and per[2].shape == (0, HIDDEN)
    out = LocalDispatcher(EXPERTS).combine(run_experts(sent, range(EXPERTS)), sent.handle)
    expected = torch.stack([sum(float(w) * expert_fn(hidden[t], int(e)) for e, w in zip(ids[t], weights[t]))
                            for t in range(4)])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_local_dispatch_of_no_tokens_is_empty() -> None:
    d = LocalDispatcher(EXPERTS)
    sent = d.dispatch(torch.zeros(0, HIDDEN), torch.zeros(0, TOP_K, dtype=torch.int64), torch.zeros(0, TOP_K))
    assert sent.counts == [0] * EXPERTS and d.combine(sent.hidden, sent.handle).shape == (0, HIDDEN)


def _check_all_to_all(rank: int, counts: tuple[int, ...], seed: int, dispatcher: AllToAllDispatcher,
                      top_k: int = TOP_K) -> None:
    mine = tokens_of(rank, counts[rank], seed, top_k)
    sent = dispatcher.dispatch(*mine)
    every = [tokens_of(r, counts[r], seed, top_k) for r in range(len(counts))]
    for rows, g in zip(sent.per_expert(), dispatcher.local_experts):   # rank 0's rows first, token order
        expected = torch.cat([h[(i == g).any(dim=1)] for h, i, _ in every])
        assert torch.equal(rows, expected), (rank, g)
    if EXPERTS - 1 in dispatcher.local_experts:
        assert sent.counts[-1] == 0 and sent.per_expert()[-1].shape == (0, HIDDEN)   # expert 7: never chosen
    out = dispatcher.combine(run_experts(sent, dispatcher.local_experts), sent.handle)
    # the counts known from every rank's routing: the same rows without their all-to-all
    known = counts_by_source(torch.cat([i for _, i, _ in every]), list(counts), EXPERTS, rank, len(counts))
    again = dispatcher.dispatch(*mine, recv_counts=known)
    assert again.counts == sent.counts and again.blocks == sent.blocks
    assert torch.equal(again.hidden, sent.hidden)
    assert torch.equal(dispatcher.combine(run_experts(again, dispatcher.local_experts), again.handle), out)
    local = LocalDispatcher(EXPERTS)
    ref_sent = local.dispatch(*mine)
    reference = local.combine(run_experts(ref_sent, range(EXPERTS)), ref_sent.handle)
    assert out.shape == (counts[rank], HIDDEN) and torch.equal(out, reference), rank


def _check_moe_block(rank: int, dispatcher: AllToAllDispatcher) -> None:
    from engine.model.moe import MoEBlock
    from engine.model.moe_config import MoEConfig

    cfg = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=4, scoring_func="sigmoid",
                    norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                    num_shared_experts=1, sparse_layers=(0,), correction_bias=True)
    gen = torch.Generator().manual_seed(42)
    shapes = {"gate.weight": (EXPERTS, HIDDEN), "gate.e_score_correction_bias": (EXPERTS,)}
    for p in [f"experts.{e}." for e in range(EXPERTS)] + ["shared_experts."]:
        shapes.update({p + "gate_proj.weight": (4, HIDDEN), p + "up_proj.weight": (4, HIDDEN),
                       p + "down_proj.weight": (HIDDEN, 4)})
    tensors = {n: torch.randn(*s, generator=gen) * 0.5 for n, s in sorted(shapes.items())}

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return tensors[name[len("mlp."):]]

    ep2 = MoEBlock(cfg, take, "mlp.", HIDDEN, torch.float32, torch.device("cpu"), dispatcher)
    ep1 = MoEBlock(cfg, take, "mlp.", HIDDEN, torch.float32, torch.device("cpu"))
    assert ep2.w13.shape[0] == EXPERTS // 2 and ep1.w13.shape[0] == EXPERTS
    x = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(7 + r)) for r, n in enumerate((9, 4))]
    with torch.inference_mode():
        whole = ep1(torch.cat(x))   # every token of both ranks through all 8 experts here
        torch.testing.assert_close(ep2(x[rank]), whole[:9] if rank == 0 else whole[9:], rtol=1e-6, atol=1e-6)


def _rank_main(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dispatcher = AllToAllDispatcher(EXPERTS, dist.group.WORLD, timeout_s=10.0)
    assert dispatcher.local_experts == range(4 * rank, 4 * rank + 4)
    _check_all_to_all(rank, (5, 3), seed=1, dispatcher=dispatcher)
    _check_all_to_all(rank, (6, 0), seed=2, dispatcher=dispatcher)   # rank 1: no tokens
    _check_all_to_all(rank, (0, 4), seed=3, dispatcher=dispatcher)   # rank 0: no tokens
    _check_moe_block(rank, dispatcher)
    dist.barrier()
    if rank == 1:
        os._exit(0)   # gone without a word: rank 0's next dispatch must fail, not hang
    start = time.monotonic()
    with pytest.raises(DispatchError):
        dispatcher.dispatch(*tokens_of(0, 3, seed=4))
    assert time.monotonic() - start < 15.0
    # the group is broken: gloo's threads abort the interpreter's shutdown ("terminate called without an
    # active exception"), so leave without it, as rank 1 did
    os._exit(0)


def _four_ranks_main(rank: int, port: int) -> None:
    """Ranks 1 and 2 hold experts in the middle of the expert order: their own rows are summed between the
    lower and the higher ranks' (what LocalDispatcher's bits need)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=30))
    dispatcher = AllToAllDispatcher(EXPERTS, dist.group.WORLD, timeout_s=10.0)
    assert dispatcher.local_experts == range(2 * rank, 2 * rank + 2)
    # top-5: a token's sum has terms of 3-4 ranks, so a rank that summed its own rows out of expert order
    # would give other bits than LocalDispatcher
    _check_all_to_all(rank, (5, 3, 7, 2), seed=5, dispatcher=dispatcher, top_k=5)
    _check_all_to_all(rank, (4, 0, 6, 0), seed=6, dispatcher=dispatcher, top_k=5)   # ranks 1, 3: no tokens
    dist.barrier()
    os._exit(0)   # gloo's threads abort the interpreter's shutdown (see _rank_main)


def _run_ranks(main, nprocs: int) -> None:  # noqa: ANN001 - a spawn target
    import torch.multiprocessing as mp

    context = mp.start_processes(main, args=(_free_port(),), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish in {SPAWN_TIMEOUT_S} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_all_to_all_over_two_gloo_ranks_equals_local_dispatch() -> None:
    """Two ranks of 4 experts each: token order, empty experts, a rank without tokens, combine == local,
    MoE block EP=2 == EP=1, and a departed rank fails the next dispatch within its timeout."""
    _run_ranks(_rank_main, 2)


def test_all_to_all_over_four_gloo_ranks_equals_local_dispatch() -> None:
    """Four ranks of 2 experts each: the ranks in the middle of the expert order too."""
    _run_ranks(_four_ranks_main, 4)


# ---- SharedMemoryDispatcher: ranks as threads of this process over one region ------------------------------
def _shm_ranks(n: int, body, slot_bytes: int = 16 << 10, timeout_s: float = 5.0) -> list[BaseException]:  # noqa: ANN001
    """Run ``body(rank, dispatcher)`` for ``n`` ranks, each a thread with its own ``ShmCommunicator`` over one
    region (as rank processes map it); returns what the ranks raised. A rank that raises aborts the group,
    as a rank process's failure does, so that no other waits for it."""
    import threading

    from engine.model.shm_dispatch import SharedMemoryDispatcher
    from engine.parallel.shm import ShmCommunicator, create_region

    fd = create_region(n, slot_bytes)
    comms = [ShmCommunicator(fd, r, n, slot_bytes, (1,) * n, timeout_s) for r in range(n)]
    os.close(fd)
    raised: list[BaseException] = []

    def run(r: int) -> None:
        try:
            body(r, SharedMemoryDispatcher(EXPERTS, comms[r]))
        except BaseException as e:   # noqa: BLE001 - handed to the test
            raised.append(e)
            comms[r].abort(f"rank {r} failed: {e!r}")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for c in comms:
        c.close()
    return raised


def test_shared_memory_dispatch_over_two_and_four_ranks_equals_local_dispatch() -> None:
    """The contract of the gloo tests above, through the shared region: token order, empty experts, ranks
    with no tokens, ranks in the middle of the expert order (top-5 over 4 ranks), the counts passed in or
    read from the slots' headers, combine == LocalDispatcher bit for bit, MoE block EP=2 == EP=1."""
    def two(rank: int, dispatcher) -> None:  # noqa: ANN001
        assert dispatcher.local_experts == range(4 * rank, 4 * rank + 4)
        _check_all_to_all(rank, (5, 3), seed=1, dispatcher=dispatcher)
        _check_all_to_all(rank, (6, 0), seed=2, dispatcher=dispatcher)
        _check_all_to_all(rank, (0, 4), seed=3, dispatcher=dispatcher)
        _check_moe_block(rank, dispatcher)

    def four(rank: int, dispatcher) -> None:  # noqa: ANN001
        _check_all_to_all(rank, (5, 3, 7, 2), seed=5, dispatcher=dispatcher, top_k=5)
        _check_all_to_all(rank, (4, 0, 6, 0), seed=6, dispatcher=dispatcher, top_k=5)

    assert _shm_ranks(2, two) == []
    assert _shm_ranks(4, four) == []


def test_shared_memory_dispatch_of_bf16_rows_weights_in_fp32_as_local_dispatch() -> None:
    def body(rank: int, dispatcher) -> None:  # noqa: ANN001
        hidden, ids, weights = tokens_of(rank, (7, 5)[rank], seed=8)
        hidden = hidden.to(torch.bfloat16)
        sent = dispatcher.dispatch(hidden, ids, weights)
        out = dispatcher.combine(run_experts(sent, dispatcher.local_experts), sent.handle)
        local = LocalDispatcher(EXPERTS)
        ref = local.dispatch(hidden, ids, weights)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, local.combine(run_experts(ref, range(EXPERTS)), ref.handle))

    assert _shm_ranks(2, body) == []


def test_shared_memory_dispatch_fails_with_dispatch_error_when_a_peer_is_gone_hangs_or_overflows() -> None:
    """A peer that aborted the group: the next dispatch fails at once; a peer that never comes: after the
    timeout; an exchange larger than the slot: that rank fails naming the slot and aborts the group, so its
    peer fails at once instead of waiting out the timeout."""
    def aborted(rank: int, dispatcher) -> None:  # noqa: ANN001
        if rank == 1:
            dispatcher.comm.abort("rank 1 went away")
            return
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(DispatchError, match="MoE dispatch: the group was aborted: rank 1 went away"):
            dispatcher.dispatch(*tokens_of(0, 3, seed=4))
        assert time.monotonic() - start < 1.0

    def hung(rank: int, dispatcher) -> None:  # noqa: ANN001
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(DispatchError, match=r"rank\(s\) \[1\] did not reach operation 1 within 1 s"):
                dispatcher.dispatch(*tokens_of(0, 3, seed=4))
            assert 0.9 < time.monotonic() - start < 5.0

    def overflow(rank: int, dispatcher) -> None:  # noqa: ANN001
        count = 2000 if rank == 0 else 2   # rank 0's rows for rank 1's experts: far over the 16 KiB slot
        start = time.monotonic()
        with pytest.raises(DispatchError, match="do not fit the shared slot" if rank == 0 else "aborted"):
            dispatcher.dispatch(*tokens_of(rank, count, seed=9))
        assert time.monotonic() - start < 2.0

    assert _shm_ranks(2, aborted) == []
    assert _shm_ranks(2, hung, timeout_s=1.0) == []
    assert _shm_ranks(2, overflow, timeout_s=30.0) == []


def test_a_transport_error_reaches_requests_without_gloos_source_location_and_advice() -> None:
    from engine.parallel.communicator import transport_reason

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:27572: Connection reset by peer. This may indicate a possible "
                        "application crash on rank 0 or a network set up issue.\nmore lines")
    assert transport_reason(gloo) == "Read error [127.0.0.1]:27572: Connection reset by peer"
    assert transport_reason(RuntimeError("Connection closed by peer")) == "Connection closed by peer"
    assert transport_reason(RuntimeError("")) == "RuntimeError"
