"""``LLMEngine``: the synchronous engine API of docs/architecture.md (one caller thread, no threads inside).

A step schedules work (decode tokens first, then prefill chunks), runs one forward over it, samples, applies
stop conditions and returns one ``RequestOutput`` per request that progressed. Roles (``EngineConfig.mode``):

- colocated: prefill then decode in one engine.
- prefill: prompt only; each chunk's output names the pages it completed (``PrefillChunk``); after the last
  chunk the pages stay held until ``release_request`` (their KV is being sent).
- decode: ``reserve_request`` takes pages for a request whose prompt KV a prefill engine writes;
  ``add_prebuilt_request`` then continues it from the first token with no prefill forward.

With ``tensor_parallel_size`` N > 1 this engine is rank 0 of N (``engine/parallel``): scheduling, sampling and
the page allocator stay here, the model and the KV pool are split over N rank processes, and each step's
forward runs on all of them (``ParallelCausalLM``). ``close`` stops them.

With ``enable_dp_attention`` (DP attention over those N ranks, docs/parallelism.md) each rank has its own
requests, KV pool and page ids: this engine keeps one scheduler per rank (``engine.dp_scheduler``), assigns
each new request to the least-loaded rank, and each step sends every rank its own batch (a rank with none
runs an empty one, so every collective meets).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.dp_scheduler import DataParallelScheduler, DPRankLoad
from engine.errors import EngineError, InvalidSamplingParams, OutOfPages, RequestRejected
from engine.kv_pool import KVPool, KVShape
from engine.model_runner import ModelRunner, SampledToken
from engine.output_processor import OutputProcessor
from engine.outputs import FinishReason, PrefillChunk, RequestOutput, Reservation
from engine.page_allocator import PageAllocator
from engine.parallel.layout import KVHeadSlice
from engine.prefix_cache import PrefixCache, PrefixCacheStats
from engine.resume import check_resumed, replay_outputs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import RequestId, Sequence, pages_for_tokens
from engine.structured import GrammarCompiler, GrammarState

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV pool.

    Args:
        config: the engine's configuration.
        loaded: an already loaded model (``engine.model.LoadedModel``: ``.model``, ``.config``,
            ``.tokenizer``); None loads ``config.model`` with ``engine.model.load_model``. Must be None with
            ``tensor_parallel_size`` > 1 (every rank loads its own slice).
    Attributes:
        tokenizer: the model's tokenizer.
        model_config: the model's ``ModelConfig``.
        kv_pool: the ``KVPool``; ``kv_cache`` is its tensor
            ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (``num_kv_heads``: this rank's).
        kv_heads: the model's KV heads this engine's pool holds (all of them unless tensor-parallel).
        parallel: the ``engine.parallel.group.TensorParallelGroup`` of a tensor-parallel engine, else None.
    Raises:
        ValueError: a bad ``tensor_parallel_size`` for the model (named), or ``loaded`` given with it.
        TensorParallelError: a rank process failed to start.
    """

    def __init__(self, config: EngineConfig, loaded: Any | None = None) -> None:
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.parallel: TensorParallelGroup | None = None
        if config.num_ranks > 1:
            if loaded is not None:
                raise ValueError("tensor_parallel_size or expert_parallel_size > 1 loads each rank's slice "
                                 "itself: pass no loaded model")
            from engine.parallel.group import TensorParallelGroup

            self.parallel = TensorParallelGroup.start(config)
            loaded = self.parallel.loaded
        try:
            self._build(config, loaded if loaded is not None else _load_model(config))
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, loaded: Any) -> None:
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        mc = self.model_config
        dtype = getattr(torch, config.dtype)
        self.kv_heads = self.parallel.kv_heads if self.parallel else KVHeadSlice.whole(mc.num_kv_heads)
        shape = KVShape(mc.num_layers, self.kv_heads.num_heads, mc.head_dim, config.page_size,
                        mc.kv_layout_kind)
        num_pages = self.parallel.num_pages if self.parallel else \
            config.num_pages or shape.pages_for_bytes(config.pool_bytes, dtype)
        region_fd = self.parallel.dp_region_fd if self.parallel else -1
        # DP attention on the CPU: every rank's pool in one region, rank 0's first; the whole region is what
        # the KV transfer registers (a page id r * num_pages + p is page p of rank r's pool)
        self._dp_region: KVPool | None = None
        if region_fd >= 0:
            total = config.dp_size * num_pages
            self.kv_pool = KVPool(shape, num_pages, dtype, config.device, shared_fd=region_fd,
                                  fd_num_pages=total)
            self._dp_region = KVPool(shape, total, dtype, config.device, shared_fd=region_fd)
        else:
            self.kv_pool = KVPool(shape, num_pages, dtype, config.device)
        self.kv_cache = self.kv_pool.kv_cache
        context = mc.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        ranks = [Scheduler(PrefixCache(PageAllocator(num_pages), enabled=config.prefix_caching_active),
                           config.page_size, config.chunk_size, config.max_num_batched_tokens,
                           config.max_running_requests) for _ in range(config.dp_size)]
        self.scheduler: Scheduler | DataParallelScheduler = \
            ranks[0] if config.dp_size == 1 else DataParallelScheduler(ranks)
        eos = frozenset(getattr(self.tokenizer, "eos_token_ids", None) or mc.eos_token_ids)
        self._eos_token_ids = eos
        model = self.parallel.model if self.parallel else loaded.model
        assert model is not None   # TensorParallelGroup.start made the group's model
        self.runner = ModelRunner(model, self.kv_cache, config.device, eos, config.dp_size)
        self.output_processor = OutputProcessor(eos, lambda: _make_detokenizer(self.tokenizer),
                                                lambda token_id: self.tokenizer.decode([token_id], False))
        self._generator = torch.Generator(device=config.device).manual_seed(config.seed)
        self._requests: dict[RequestId, Sequence] = {}
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._finish_next: list[tuple[Sequence, FinishReason]] = []
        logger.info("engine ready: mode=%s pages=%d page_size=%d kv_bytes=%d prefix_caching=%s "
                    "tensor_parallel_size=%d expert_parallel_size=%d dp_attention_ranks=%d", config.mode,
                    num_pages, config.page_size, self.kv_pool.nbytes, config.prefix_caching_active,
                    config.tensor_parallel_size, config.expert_parallel_size, config.dp_size)

    def close(self) -> None:
        """Stop the rank processes of a tensor-parallel engine (nothing otherwise); idempotent. Call it once
        no thread steps the engine any more (the engine loop stopped)."""
        if self.parallel is not None:
            self.parallel.stop()

    @property
    def num_free_pages(self) -> int:
        """Pages a new request can take: free ones plus cached pages no live request holds (evicted on
        demand). DP attention: summed over the ranks, while one request's pages lie in one rank's pool
        (``rank_free_pages``)."""
        return self.scheduler.num_allocatable_pages

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters since start (tokens, pages); all zero when the cache is off."""
        return self.scheduler.cache_stats()

    @property
    def rank_free_pages(self) -> list[int]:
        """A DP-attention engine: pages a new request can take in each rank's pool, rank 0 first (a request's
        pages all lie in one); [] otherwise (``num_free_pages`` is the one pool's)."""
        if not isinstance(self.scheduler, DataParallelScheduler):
            return []
        return [rank.num_allocatable_pages for rank in self.scheduler.ranks]

    def dp_rank_of(self, request_id: RequestId) -> int | None:
        """The DP-attention rank a live request runs on; None for an unknown or finished one, or an engine
        without DP attention."""
        if not isinstance(self.scheduler, DataParallelScheduler):
            return None
        return self.scheduler.rank_of(request_id)

    @property
    def dp_loads(self) -> list[DPRankLoad]:
        """Per DP-attention rank counters (requests assigned, tokens computed, busy steps), rank 0 first; one
        entry (all zero) without DP attention."""
        return self.scheduler.loads if isinstance(self.scheduler, DataParallelScheduler) else [DPRankLoad()]

    @property
    def kv_pools(self) -> list[tuple[KVHeadSlice, KVPool]]:
        """Every rank's KV pool with the model KV heads it holds, rank 0 (this process's ``kv_pool``) first;
        one entry unless tensor-parallel. Every pool has ``num_total_pages`` pages under the same page ids and
        lives in this process's address space (ranks 1..N-1's as shared mappings), which is what one KV
        transfer agent registers. Raises ``ValueError`` for a tensor-parallel engine on GPUs (each rank's pool
        is on its own device, out of this process's reach).

        A DP-attention engine (on the CPU) gives one pool: every rank's, back to back, its page ids
        ``rank * num_pages + p`` (``num_total_pages`` of them; the ids ``reserve_request`` and prefill chunks
        report), with every KV head."""
        if self._dp_region is not None:
            return [(KVHeadSlice.whole(self.kv_heads.num_model_kv_heads), self._dp_region)]
        if self.config.dp_size > 1:
            raise ValueError("the KV pools of a DP-attention engine on GPUs are each on their rank's device")
        if self.parallel is None:
            return [(self.kv_heads, self.kv_pool)]
        if self.parallel.world_size > 1 and not self.parallel.rank_pools:
            raise ValueError("the KV pools of a tensor-parallel engine on GPUs are each on their rank's "
                             "device")
        return [(self.kv_heads, self.kv_pool),
                *((shard.kv_heads, pool) for shard, pool in zip(self.parallel.shards[1:],
                                                                self.parallel.rank_pools))]

    @property
    def num_total_pages(self) -> int:
        """Pages of the KV pool (DP attention: of every rank's pool, ``dp_size`` x ``kv_pool.num_pages``)."""
        return self.scheduler.num_pages

    def has_unfinished(self) -> bool:
        """True while a step has work: queued, running, or a prebuilt request about to finish."""
        return self.scheduler.has_work() or bool(self._finish_next)

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-outputs compiler for this model's vocabulary (built on first use; any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(),
                                                 self.model_config.vocab_size, sorted(self._eos_token_ids))
            return self._grammars

    def prepare_request(self, params: SamplingParams) -> None:
        """Compile ``params.structured`` now (any thread, e.g. the one admitting the request), so that
        ``add_request`` / ``reserve_request`` on the engine thread find it compiled; no-op without one.

        Raises:
            InvalidSamplingParams: the spec cannot be compiled for this vocabulary (naming its field).
        """
        if params.structured is not None:
            self.grammars.compile(params.structured)

    def add_request(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams,
                    resumed_output_ids: Iterable[int] = (), dp_rank: int | None = None) -> None:
        """Queue a request; it starts when its pages (prompt + max_tokens) are free.

        ``resumed_output_ids`` (not in prefill mode): tokens this request already generated elsewhere and sent
        to the client (a migrated request, ``engine.resume``): they count as outputs (``num_output_tokens``,
        stop rules, penalties) but are neither sampled nor reported again; their logprobs count as 0.0 in
        ``cumulative_logprob``. The prompt and these tokens are prefilled together.

        ``dp_rank``: the DP-attention rank that runs the request (its KV in that rank's pool); None: the
        engine places it (``DataParallelScheduler.assign``). An engine without DP attention has rank 0 only.

        Raises:
            RequestRejected: duplicate id, empty prompt, token out of vocabulary, longer than
                ``max_model_len``, more pages than the whole pool, or ``params.structured`` cannot be compiled
                (compiled here, on the engine thread, unless ``prepare_request`` compiled it before); resumed
                tokens in prefill mode, out of vocabulary, not fewer than ``max_tokens``, outside the grammar,
                or already ending the request; ``dp_rank`` not a rank of this engine.
            TensorParallelError: the engine's rank group has failed (it takes no request any more).
        """
        self._check_dp_rank(request_id, dp_rank)
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        resumed = [int(t) for t in resumed_output_ids]
        if resumed:
            if self.config.mode == "prefill":
                raise RequestRejected(request_id, "a prefill-mode engine does not resume requests")
            check_resumed(seq, resumed, self.model_config.vocab_size)
        self._track(seq)
        if resumed:
            try:
                replay_outputs(seq, resumed, self.output_processor, self.model_config.vocab_size,
                               self.config.device)
            except RequestRejected:
                self._untrack(request_id)
                raise
        if isinstance(self.scheduler, DataParallelScheduler):
            self.scheduler.add(seq, dp_rank)
        else:
            self.scheduler.add(seq)

    def reserve_request(self, request_id: RequestId, prompt_token_ids: list[int],
                        params: SamplingParams, dp_rank: int | None = None) -> Reservation:
        """Decode mode: take the pages for prompt + max_tokens now, in ``dp_rank``'s pool (as ``add_request``;
        a DP-attention engine's page ids say the rank: ``kv_pools``).

        With the prefix cache on, the prompt's longest cached page-aligned prefix (never its last token) is
        shared from the cache instead: those pages already hold the right KV and the peer must not write them.

        Returns:
            A ``Reservation``: ``num_cached_tokens`` (the shared prefix) and ``dst_page_ids``, the request's
            pages from there to the end of the prompt, in order: where the prefill side writes the rest of the
            prompt's KV.
        Raises:
            EngineError: not in decode mode.
            OutOfPages: the pool (``dp_rank``'s) is short now (retry later); nothing is taken.
            RequestRejected, TensorParallelError: as ``add_request``.
        """
        self._require_mode("decode", "reserve_request")
        self._check_dp_rank(request_id, dp_rank)
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if isinstance(self.scheduler, DataParallelScheduler):
            if not self.scheduler.reserve(seq, dp_rank):
                rank = seq.dp_rank
                raise OutOfPages(request_id, f"needs {self.scheduler.pages_needed(seq)} pages, "
                                             f"{self.rank_free_pages[rank]} free on DP rank {rank}")
        elif not self.scheduler.reserve(seq):
            raise OutOfPages(request_id, f"needs {self.scheduler.pages_needed(seq)} pages, "
                                         f"{self.num_free_pages} free")
        self._track(seq)
        cached_pages = seq.num_cached_tokens // self.config.page_size
        pages = seq.page_table[cached_pages:pages_for_tokens(seq.num_prompt_tokens, self.config.page_size)]
        return Reservation(self._instance_pages(seq, pages), seq.num_cached_tokens)

    def add_prebuilt_request(self, request_id: RequestId, first_token_id: int, first_logprob: float,
                             first_token_sent: bool = False) -> None:
        """Decode mode: the prompt KV is in the reserved pages; continue from ``first_token_id``.

        A seeded sampling request continues its seed's random stream past the first token's draw, so its
        tokens are the colocated engine's for the same seed. The first token is reported in the request's next
        output, unless ``first_token_sent``: then the prefill side already sent it (its id and the text a
        prefill-mode engine emits for it) and the outputs here carry only what follows; ``num_output_tokens``
        still counts it. If the first token already finishes the request (EOS, a stop token or string,
        ``max_tokens == 1``) the request finishes at the next step, no forward.

        Raises:
            EngineError: not in decode mode, ``request_id`` is not reserved, or it was added already.
        """
        self._require_mode("decode", "add_prebuilt_request")
        seq = self.scheduler.reserved.get(request_id)
        if seq is None or seq.num_output_tokens > 0:
            raise EngineError(f"request {request_id!r} is not reserved (or was already added)")
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.scheduler.register_computed(seq)   # the received prompt pages are now cacheable here too
        if seq.params.seed is not None and not seq.params.greedy:
            # the prefill engine drew the first token from this seed's generator; draw what that sample took
            # (one exponential per vocabulary entry: engine.sampler._sample_row) so the tokens after it are
            # the ones a colocated engine draws from the same seed
            torch.empty(self.model_config.vocab_size, dtype=torch.float32,
                        device=self.config.device).exponential_(generator=seq.generator)
        if seq.grammar is not None:
            # the prefill engine sampled the first token under the same grammar: move this fresh state past it
            seq.grammar.accept(int(first_token_id))
        reason = self.output_processor.append_token(seq, int(first_token_id), float(first_logprob))
        if first_token_sent:
            self.output_processor.mark_emitted(seq)
        if reason is not None:
            self._finish_next.append((seq, reason))
        else:
            self.scheduler.start_reserved(request_id)

    def abort_request(self, request_id: RequestId) -> None:
        """Drop a request wherever it is and free its pages now; unknown or finished ids are ignored."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            logger.debug("aborted request %s", request_id)
        self._untrack(request_id)

    def release_request(self, request_id: RequestId) -> None:
        """Prefill mode: free the pages of a request whose prefill finished (its KV was sent).

        Unknown or already released ids are ignored.

        Raises:
            EngineError: the request is still prefilling (abort it instead).
        """
        if self.scheduler.release(request_id):
            self._untrack(request_id)
        elif request_id in self._requests:
            raise EngineError(f"request {request_id!r} is still prefilling; use abort_request")

    def step(self) -> list[RequestOutput]:
        """Run one forward over the continuous batch; [] when there is nothing to do."""
        outputs = self._finish_prebuilt()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return outputs
        sampled = {id(s.seq): s for s in self.runner.run(scheduled)}
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.scheduler.register_computed(item.seq)
            out = self._postprocess(item, sampled.get(id(item.seq)))
            if out is not None:
                outputs.append(out)
        return outputs

    def _postprocess(self, item: ScheduledSeq, sampled: SampledToken | None) -> RequestOutput | None:
        seq = item.seq
        reason = None
        if sampled is not None:
            if seq.grammar is not None:
                seq.grammar.accept(sampled.token_id)
            reason = self.output_processor.append_sampled(seq, sampled)
        if self.config.mode == "prefill":
            return self._prefill_output(seq, sampled, reason)
        if sampled is None:
            return None
        out = self.output_processor.make_output(seq, reason)
        if reason is not None:
            self.scheduler.finish(seq)
            self._untrack(seq.request_id)
        return out

    def _prefill_output(self, seq: Sequence, sampled: SampledToken | None,
                        reason: FinishReason | None) -> RequestOutput:
        ps = self.config.page_size
        is_last = sampled is not None
        done_pages = pages_for_tokens(seq.num_prompt_tokens, ps) if is_last else seq.num_computed_tokens // ps
        chunk = PrefillChunk(self._instance_pages(seq, seq.page_table[seq.num_sent_pages:done_pages]),
                             is_last, sampled.token_id if sampled else None,
                             sampled.logprob if sampled else None, reason)
        seq.num_sent_pages = done_pages
        if is_last:
            reason = reason or "length"
            self.scheduler.finish(seq, hold=True)
        # the text of the first token is emitted as a decode-mode engine would, holding back a possible stop
        # string's start, so that the decode side (first_token_sent=True) continues exactly where it ends
        return self.output_processor.make_output(seq, reason if is_last else None, chunk, hold_text=True)

    def _instance_pages(self, seq: Sequence, pages: list[int]) -> list[int]:
        """``seq``'s page ids (its rank's pool) as the instance's: ``rank * num_pages + p`` under DP attention
        (``kv_pools``), unchanged otherwise."""
        if seq.dp_rank == 0:
            return pages
        first = seq.dp_rank * self.kv_pool.num_pages
        return [first + p for p in pages]

    def _finish_prebuilt(self) -> list[RequestOutput]:
        outputs = []
        for seq, reason in self._finish_next:
            if self.scheduler.abort(seq.request_id) is not None:  # None: aborted meanwhile
                outputs.append(self.output_processor.make_output(seq, reason))
                self._untrack(seq.request_id)
        self._finish_next.clear()
        return outputs

    def _new_sequence(self, request_id: RequestId, prompt_token_ids: list[int],
                      params: SamplingParams) -> Sequence:
        if self.parallel is not None:
            self.parallel.check()   # a failed rank group takes no request (TensorParallelError)
        self._check_request(request_id, prompt_token_ids, params)
        prompt_len = len(prompt_token_ids)
        # the last sampled token's KV is never written; prefill mode keeps only the prompt's KV
        reserved = prompt_len if self.config.mode == "prefill" else prompt_len + params.max_tokens - 1
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed)
        seq = Sequence(request_id, [int(t) for t in prompt_token_ids], params, reserved, generator)
        if params.structured is not None:
            try:
                compiled = self.grammars.compile(params.structured)
            except InvalidSamplingParams as e:  # RequestRejected: every caller fails just this request
                raise RequestRejected(request_id, str(e)) from None
            seq.grammar = GrammarState(compiled, request_id)
        if self.scheduler.pages_needed(seq) > self.kv_pool.num_pages:   # one pool (one DP rank's) holds it
            raise RequestRejected(request_id, f"needs {self.scheduler.pages_needed(seq)} pages, "
                                              f"the pool has {self.kv_pool.num_pages}")
        return seq

    def _check_request(self, request_id: RequestId, prompt_token_ids: list[int],
                       params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestRejected(request_id, f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise RequestRejected(request_id, "a request with this id is already live")
        if not prompt_token_ids:
            raise RequestRejected(request_id, "empty prompt")
        if params.n != 1:
            raise RequestRejected(request_id, f"n={params.n}: the engine runs one sample per request "
                                              "(expand with SamplingParams.for_sample)")
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise RequestRejected(request_id, f"logit_bias names token ids outside [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestRejected(request_id,
                                  f"stop_token_ids names token ids outside [0, {vocab}): {bad[:5]}")
        if any(not 0 <= int(t) < vocab for t in prompt_token_ids):
            raise RequestRejected(request_id, f"prompt has token ids outside [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejected(request_id, f"prompt ({len(prompt_token_ids)}) + max_tokens "
                                              f"({params.max_tokens}) exceeds max_model_len "
                                              f"{self.max_model_len}")

    def _check_dp_rank(self, request_id: RequestId, dp_rank: int | None) -> None:
        ranks = self.config.dp_size
        if dp_rank is not None and not 0 <= dp_rank < ranks:
            raise RequestRejected(request_id, f"dp_rank {dp_rank} is not a DP-attention rank of this "
                                              f"instance (it has {ranks}: 0..{ranks - 1})")

    def _require_mode(self, mode: str, method: str) -> None:
        if self.config.mode != mode:
            raise EngineError(f"{method} needs mode={mode!r}, engine runs mode={self.config.mode!r}")

    def _track(self, seq: Sequence) -> None:
        self._requests[seq.request_id] = seq
        self.output_processor.start(seq)

    def _untrack(self, request_id: RequestId) -> None:
        self._requests.pop(request_id, None)
        self.output_processor.drop(request_id)


def _load_model(config: EngineConfig) -> Any:
    from engine.model import load_model

    return load_model(config.model, dtype=getattr(torch, config.dtype), device=config.device,
                      cache_dir=config.cache_dir, weight_quant=config.weight_quant)


def _make_detokenizer(tokenizer: Any) -> Any:
    from engine.model.tokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer)
