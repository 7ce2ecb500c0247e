"""Weight formats (``engine/model/linear.py``, ``engine/model/kernels/``): the AVX2 kernels compute the same
products as torch, int8 quantization stays within half a step, a tiny seeded Llama gives logits close to
fp32's in every (dtype, weight_quant) mode, and prefill + decode engines equal a colocated engine exactly in
every mode (same kernels on both sides)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.forward_batch import ForwardBatch
from engine.model import LlamaForCausalLM, ModelConfig
from engine.model.kernels import gemv_kernels
from engine.model.linear import (
    AMX_ONEDNN_ROWS,
    SMALL_BATCH_ROWS,
    Int8Weight,
    PackedBF16Weight,
    _cpu_has_amx,
    _pack_bf16_here,
    linear,
    weight_bytes,
)
from engine.model.perplexity import perplexity
from tests.engine.engine_fakes import VOCAB, FakeTokenizer

MODES = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8")]
_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, an engine's default (with more, a bf16 model's small batches leave the kernels;
    ``test_more_threads_take_torchs_products`` sets its own); an engine created earlier in this process may
    have set any count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kernels():
    kernels = gemv_kernels()
    if kernels is None:
        pytest.skip("no AVX2 CPU or no C compiler: the kernels are not built here")
    return kernels


def test_kernels_build_where_the_cpu_has_avx2():
    """On an AVX2 CPU with a C compiler the kernels must build (a silent fallback would hide a slow path)."""
    if not _AVX2:
        pytest.skip("not an AVX2 CPU with cc")
    assert gemv_kernels() is not None


@pytest.mark.parametrize("m", [1, 3, SMALL_BATCH_ROWS])
def test_bf16_kernel_equals_the_fp32_product_of_the_same_weights(m):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, 77, generator=gen)
    w = torch.randn(37, 77, generator=gen).bfloat16()  # 37 x 77: tails in N and K
    y = _kernels().bf16(x, w)
    torch.testing.assert_close(y, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


def _has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return "avx512_bf16" in flags and "avx512bw" in flags


def test_the_native_bf16_kernel_is_on_exactly_where_the_cpu_has_avx512_bf16():
    """The kernels' own CPU check agrees with the kernel's flags in /proc/cpuinfo (a silent fallback to the
    AVX2 loop would double the time of a 16-row decode step in bf16)."""
    assert _kernels().native_bf16 == _has_avx512_bf16()


@pytest.mark.parametrize("m", [1, 2, 3, SMALL_BATCH_ROWS])
@pytest.mark.parametrize("k", [77, 64, 576, 31])
def test_native_bf16_kernel_equals_the_exact_product(m, k):
    """bf16 x bf16 on AVX512_BF16: each product of two bf16 is exact in float32, so the only error is the
    float32 sum's, at most one rounding per step of the k sum (bound: k roundings of the sum of |terms|); N =
    37 and odd k leave tails in both."""
    kernels = _kernels()
    if not kernels.native_bf16:
        pytest.skip("this CPU has no AVX512_BF16")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(37, k, generator=gen).bfloat16()
    exact = F.linear(x.double(), w.double())
    bound = k * 2 ** -24 * F.linear(x.double().abs(), w.double().abs())
    got = kernels.bf16_native(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, 37)
    assert torch.all((got.double() - exact).abs() <= bound)
    for i in range(m):   # a row alone gives the same bits as in its batch (paired or not)
        assert torch.equal(kernels.bf16_native(x[i:i + 1].contiguous(), w), got[i:i + 1])


@pytest.mark.parametrize("m", [1, 5, SMALL_BATCH_ROWS])
def test_int8_kernel_equals_the_dequantized_product(m):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, 83, generator=gen)
    q = torch.randint(-127, 128, (41, 83), dtype=torch.int8, generator=gen)
    scale = torch.rand(41, generator=gen)
    expected = F.linear(x.double(), q.double()) * scale.double()
    # float32 sums in another order than torch's: the bound is relative to the sum of |terms| (the result
    # itself may cancel to near zero), 83 additions of at most one rounding each
    bound = 83 * 2 ** -24 * F.linear(x.abs().double(), q.abs().double()) * scale.double()
    assert torch.all((_kernels().int8(x, q, scale).double() - expected).abs() <= bound)


def test_int8_quantization_error_is_at_most_half_a_step_and_zero_rows_survive():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    w[3] = 0
    q = Int8Weight.quantize(w)
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (16,)
    assert torch.all((q.dequantize(torch.float32) - w).abs() <= q.scale[:, None] / 2 + 1e-7)
    assert torch.equal(q.dequantize(torch.float32)[3], torch.zeros(64))


@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, False), (torch.float32, True),
                                         (torch.bfloat16, True)])
def test_a_decode_row_does_not_depend_on_its_batch(dtype, quant):
    """On the kernels, row i of a small batch equals the product of row i alone, bit for bit (fp32 dense
    products stay on torch's BLAS, which gives no such promise; on AMX CPUs plain bf16 batches of
    ``AMX_ONEDNN_ROWS`` rows or more go to oneDNN, so there the batch stays below that)."""
    _kernels()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen).to(dtype)
    weight = Int8Weight.quantize(w) if quant else w
    amx_split = dtype == torch.bfloat16 and not quant and _cpu_has_amx()
    rows = AMX_ONEDNN_ROWS - 1 if amx_split else SMALL_BATCH_ROWS
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    batched = linear(x, weight)
    assert batched.dtype == dtype and batched.shape == (rows, 48)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(linear(x[i:i + 1], weight), batched[i:i + 1])


def _packed(w: torch.Tensor) -> PackedBF16Weight:
    if not _pack_bf16_here():
        pytest.skip("bf16 weights are packed only on AVX512_BF16 CPUs without AMX: nothing is packed here")
    packed = PackedBF16Weight.pack(w)
    assert packed is not None, "oneDNN's bf16 rows depend on their batch here (the pack-time check failed)"
    return packed


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 77), (576, 1536), (960, 576)])
def test_a_packed_bf16_row_does_not_depend_on_its_batch_and_equals_torch(n, k, threads):
    """Where oneDNN multiplies bf16 natively the products go through prepacked weights: every row of a batch
    (1 to 16 rows, and a prefill chunk of 40) equals that row alone, bit for bit, and the product is torch's
    bf16 ``F.linear`` up to bf16 rounding of the result. The rows are what a decode step feeds the products
    (``silu(a) * b``, heavy-tailed): with Gaussian rows a one-row kernel summing in another order (SmolLM2's
    ``576 x 1536`` here) rounds to the batch's bf16 result in nearly every row, and such a check passed it."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    packed = _packed(w)
    assert packed.shape == (n, k) and weight_bytes(packed) == n * k * 2
    for _ in range(4):
        x = (F.silu(torch.randn(40, k, generator=gen)) * torch.randn(40, k, generator=gen)).bfloat16()
        batched = linear(x[:SMALL_BATCH_ROWS], packed)
        assert batched.dtype == torch.bfloat16 and batched.shape == (SMALL_BATCH_ROWS, n)
        for i in range(SMALL_BATCH_ROWS):
            assert torch.equal(linear(x[i:i + 1], packed), batched[i:i + 1]), i
        for m in (2, 5, 13):
            assert torch.equal(linear(x[:m], packed), batched[:m])
        assert torch.equal(linear(x, packed)[:SMALL_BATCH_ROWS], batched)
        torch.testing.assert_close(batched.float(), F.linear(x[:SMALL_BATCH_ROWS].float(), w.float()),
                                   rtol=2e-2, atol=2e-2 * k ** 0.5 * 0.05)


def test_bf16_weights_are_packed_exactly_on_avx512_bf16_without_amx():
    """Where the CPU's flags say AVX512_BF16 and no AMX the weights must be packed (a silent fallback would
    cost 0.6x at 16 rows); on AMX they must not (a packed weight decodes one row slower there)."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert _pack_bf16_here() == (_has_avx512_bf16() and "amx_tile" not in flags)


def test_more_threads_take_torchs_products_for_bf16_activations(monkeypatch):
    """With 2 torch threads on an AVX-512 CPU a bf16 model's small batches run on torch's multi-threaded
    products (int8: ``_weight_int8pack_mm``), which equal the dequantized product up to bf16 rounding; float32
    activations keep the kernel (torch's int8 product runs a scalar loop for them)."""
    _kernels()
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("not an AVX-512 CPU: the kernels serve every thread count")
    calls = []
    inner = Int8Weight.int8pack_mm
    monkeypatch.setattr(Int8Weight, "int8pack_mm", lambda self, x: calls.append(x.dtype) or inner(self, x))
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(40, 96, generator=gen)
    int8 = Int8Weight.quantize(w)
    x = torch.randn(SMALL_BATCH_ROWS, 96, generator=gen)
    torch.set_num_threads(2)
    y = linear(x.bfloat16(), int8)
    assert y.dtype == torch.bfloat16 and calls == [torch.bfloat16]
    torch.testing.assert_close(y.float(), F.linear(x.bfloat16().float(), int8.dequantize(torch.float32)),
                               rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(linear(x, int8), F.linear(x, int8.dequantize(torch.float32)), rtol=1e-5,
                               atol=1e-4)
    assert calls == [torch.bfloat16]  # float32 activations: the kernel
    y = linear(x.bfloat16(), w.bfloat16())
    torch.testing.assert_close(y.float(), F.linear(x.bfloat16().float(), w.bfloat16().float()), rtol=2e-2,
                               atol=5e-2)
    torch.set_num_threads(1)
    linear(x.bfloat16(), int8)
    assert calls == [torch.bfloat16]  # one thread: the kernel again


def test_packing_is_refused_for_other_dtypes_and_devices():
    assert PackedBF16Weight.pack(torch.randn(8, 16)) is None
    if torch.cuda.is_available():
        assert PackedBF16Weight.pack(torch.randn(8, 16, device="cuda").bfloat16()) is None


@pytest.mark.parametrize("rows", [1, SMALL_BATCH_ROWS + 1])
def test_linear_with_bias_matches_torch_on_both_paths(rows):
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(rows, 32, generator=gen), torch.randn(24, 32, generator=gen)
    b = torch.randn(24, generator=gen)
    int8 = Int8Weight.quantize(w)
    torch.testing.assert_close(linear(x, int8, b), F.linear(x, int8.dequantize(torch.float32), b),
                               rtol=1e-5, atol=1e-4)
    y = linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, w, b), rtol=0.05, atol=0.1)


def _tiny_model(dtype: str, weight_quant: str, tie: bool = True) -> LlamaForCausalLM:
    cfg = ModelConfig(architecture="llama", num_layers=2, hidden_size=64, intermediate_size=96,
                      num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=VOCAB, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=tie, attention_bias=False,
                      max_position_embeddings=256, bos_token_id=None, eos_token_ids=(0,), model_id="tiny")
    gen = torch.Generator().manual_seed(5)
    h, i, q, kv = 64, 96, 64, 32
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    for n in range(2):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    if not tie:
        shapes["lm_head.weight"] = (VOCAB, h)
    model = LlamaForCausalLM(cfg, dtype=getattr(torch, dtype), weight_quant=weight_quant)
    model.load_weights({k: torch.randn(*s, generator=gen) * 0.3 for k, s in sorted(shapes.items())})
    return model.eval()


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    n, cfg = len(ids), model.config
    kv = torch.zeros(cfg.num_layers, 2, 4, 8, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    pos = torch.arange(n)
    return model(ForwardBatch(torch.tensor(ids), pos, pos, [n], [n], [[0, 1, 2, 3]], pos), kv)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype,weight_quant", MODES)
def test_tiny_model_logits_stay_close_to_fp32(dtype, weight_quant, tie):
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8, 41]  # 20 rows: torch
    model = _tiny_model(dtype, weight_quant, tie)
    ref = _logits(_tiny_model("float32", "none", tie), ids)
    got = _logits(model, ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), VOCAB)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    last = _logits(model, ids[:1])  # one row: the decode kernels
    assert (last - ref[:1]).abs().max() < 0.05 * ref.abs().max()
    layer = model.layers[0]
    if weight_quant == "int8":
        assert isinstance(layer.gate_up_proj, Int8Weight) and isinstance(model.lm_head, Int8Weight)
        assert (model.lm_head is model.embed_tokens) == tie
    elif dtype == "bfloat16" and _pack_bf16_here():
        assert isinstance(layer.gate_up_proj, PackedBF16Weight)
        assert isinstance(model.lm_head, PackedBF16Weight)
        assert model.embed_tokens.dtype == torch.bfloat16  # lookups read the plain rows
    else:
        assert layer.gate_up_proj.dtype == model.lm_head.dtype == getattr(torch, dtype)


@pytest.mark.parametrize("dtype,weight_quant", MODES)
def test_perplexity_is_exp_of_the_mean_next_token_loss(dtype, weight_quant):
    model, ids = _tiny_model(dtype, weight_quant), [5, 9, 2, 77, 31, 4, 60, 18, 12]
    logits = _logits(model, ids)[:-1]
    expected = torch.exp(F.cross_entropy(logits, torch.tensor(ids[1:]))).item()
    assert perplexity(model, ids, page_size=4) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="tokens"):
        perplexity(model, [1])


def _engine(dtype: str, weight_quant: str, mode: str, model: LlamaForCausalLM) -> LLMEngine:
    loaded = SimpleNamespace(model=model, config=model.config, tokenizer=FakeTokenizer())
    cfg = EngineConfig(mode=mode, page_size=4, num_pages=64, chunk_size=8, max_num_batched_tokens=32,
                       dtype=dtype, weight_quant=weight_quant)
    return LLMEngine(cfg, loaded)


def _run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.mark.parametrize("dtype,weight_quant", MODES)
def test_prefill_then_decode_engines_equal_colocated_exactly(dtype, weight_quant):
    """Same tokens in every mode; logprobs equal up to the activations' rounding: the two runs batch different
    rows together, and attention's sums depend on the batch; so do the matmul kernels' blockings where the CPU
    has native bf16 dot products (AVX512-BF16: oneDNN picks them by the batch's row count), where bf16's 8
    significant bits put ~1e-2 on a logprob near -3 (measured here: up to 8e-3 with int8 weights, 1.1e-4
    without); fp32 stays within 1e-4."""
    model = _tiny_model(dtype, weight_quant)
    prompts = {"a": [7, 3, 9], "b": list(range(10, 23)), "c": [42] * 9}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    colo = _engine(dtype, weight_quant, "colocated", model)
    for rid, p in prompts.items():
        colo.add_request(rid, p, greedy)
    expected = {rid: ([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.new_logprobs])
                for rid, outs in _run(colo).items()}
    pre, dec = _engine(dtype, weight_quant, "prefill", model), _engine(dtype, weight_quant, "decode", model)
    assert pre.kv_cache.dtype == getattr(torch, dtype)
    dst = {rid: dec.reserve_request(rid, p, greedy).dst_page_ids for rid, p in prompts.items()}
    for rid, p in prompts.items():
        pre.add_request(rid, p, greedy)
    for rid, outs in _run(pre).items():
        src = [page for o in outs for page in o.prefill_chunk.page_ids]
        dec.kv_cache[:, :, torch.tensor(dst[rid])] = pre.kv_cache[:, :, torch.tensor(src)]
        pre.release_request(rid)
        last = outs[-1].prefill_chunk
        dec.add_prebuilt_request(rid, last.first_token_id, last.first_logprob)
    got = {rid: ([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.new_logprobs])
           for rid, outs in _run(dec).items()}
    assert {rid: t for rid, (t, _) in got.items()} == {rid: t for rid, (t, _) in expected.items()}
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for rid, (_, logprobs) in got.items():  # attention batches rows differently in the two runs
        assert logprobs == pytest.approx(expected[rid][1], abs=tolerance)


def test_unknown_weight_quant_is_refused_by_name():
    with pytest.raises(ValueError, match="weight_quant"):
        EngineConfig(weight_quant="int3")
    with pytest.raises(ValueError, match="weight_quant"):
        _tiny_model("float32", "fp4")
