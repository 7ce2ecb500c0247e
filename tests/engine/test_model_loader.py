"""Model loading: tiny Hugging Face folders (Llama, Qwen2 with q/k/v bias, Mistral; GQA; tied and untied
heads)
load and give transformers' logits; every malformed model raises one ``ModelLoadError`` that names the file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from engine.forward_batch import ForwardBatch
from engine.model import LlamaForCausalLM, ModelLoadError, load_model
from engine.model.gguf_convert import file_order_key
from engine.model.hf_folder import read_hf_config
from engine.model.safetensors_io import read_safetensors_file, write_safetensors

VOCAB = 64
_HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _tiny_config(model_type: str, tie: bool) -> dict:
    return {"model_type": model_type, "architectures": ["X"], "num_hidden_layers": 2, "hidden_size": 32,
            "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
            "rope_theta": 5000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": tie,
            "max_position_embeddings": 128,
            "bos_token_id": 0, "eos_token_id": 1}


def _tiny_tensors(cfg: dict, bias: bool, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (VOCAB, h)
    return [(name, torch.randn(*shape, generator=gen) * 0.2) for name, shape in sorted(shapes.items())]


def _write_folder(folder: Path, model_type: str = "llama", tie: bool = False,
                  drop: str | None = None, reshape: str | None = None) -> Path:
    cfg = _tiny_config(model_type, tie)
    tensors = _tiny_tensors(cfg, model_type == "qwen2", torch.Generator().manual_seed(1))
    tensors = [(n, t[:-1] if n == reshape else t) for n, t in tensors if n != drop]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_safetensors(folder / "model.safetensors", tensors)
    vocab = {f"t{k}": k for k in range(VOCAB)}
    HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return folder


def _logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    kv = torch.zeros(model.config.num_layers, 2, 8, 4, model.config.num_kv_heads, model.config.head_dim)
    pages = [5, 2, 7, 0, 3, 1, 6, 4]
    slots = [pages[t // 4] * 4 + t % 4 for t in range(n)]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor(slots), [n], [n], [pages],
                         torch.arange(n))
    return model(batch, kv)


@pytest.mark.reference
@pytest.mark.skipif(not _HAS_TRANSFORMERS, reason="transformers not installed")
@pytest.mark.parametrize("model_type,tie", [("llama", False), ("llama", True), ("qwen2", False), ("mistral",
                                                                                                  True)])
def test_hf_folder_matches_transformers(tmp_path: Path, model_type: str, tie: bool) -> None:
    """A random tiny HF folder gives transformers' logits at every position (within 1e-4, fp32)."""
    from transformers import AutoModelForCausalLM

    folder = _write_folder(tmp_path / model_type, model_type, tie)
    loaded = load_model(str(folder))
    assert loaded.config.architecture == model_type
    assert loaded.config.attention_bias == (model_type == "qwen2")
    ids = [3, 17, 60, 5, 9, 22, 41, 8, 13, 2, 33]
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(loaded.model, ids), expected, atol=1e-4, rtol=1e-4)


def test_loaded_weights_share_the_file_buffer(tmp_path: Path) -> None:
    """In a file written in the converter's order, q|k|v and gate|up become the fused parameters without a
    copy."""
    cfg = _tiny_config("llama", False)
    tensors = _tiny_tensors(cfg, False, torch.Generator().manual_seed(2))
    write_safetensors(tmp_path / "w.safetensors", sorted(tensors, key=lambda nt: file_order_key(nt[0])))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = read_safetensors_file(tmp_path / "w.safetensors")
    model = LlamaForCausalLM(read_hf_config(tmp_path / "config.json", "tiny"))
    model.load_weights(loaded)
    layer = model.layers[1]
    assert layer.qkv_proj.data_ptr() == loaded["model.layers.1.self_attn.q_proj.weight"].data_ptr()
    assert layer.gate_up_proj.data_ptr() == loaded["model.layers.1.mlp.gate_proj.weight"].data_ptr()
    assert torch.equal(layer.qkv_proj[-16:], loaded["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(layer.gate_up_proj[48:], loaded["model.layers.1.mlp.up_proj.weight"])


def _error(tmp_path: Path, **kwargs) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(_write_folder(tmp_path / "m", **kwargs)), cache_dir=tmp_path / "cache")
    return info.value


def test_missing_path_names_it(tmp_path: Path) -> None:
    """A path that does not exist names itself."""
    with pytest.raises(ModelLoadError, match="nope.gguf.*missing file"):
        load_model(str(tmp_path / "nope.gguf"), cache_dir=tmp_path / "cache")


def test_folder_without_config_names_config_json(tmp_path: Path) -> None:
    """A folder without config.json names the missing config.json."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"empty/config\.json: missing config\.json"):
        load_model(str(tmp_path / "empty"))


def test_unknown_architecture_names_config_json(tmp_path: Path) -> None:
    """An architecture other than llama/qwen2/mistral is refused, naming config.json and the architecture."""
    folder = _write_folder(tmp_path / "m")
    (folder / "config.json").write_text(json.dumps({**_tiny_config("gpt2", False),
                                                    "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown architecture \['GPT2LMHeadModel'\]"):
        load_model(str(folder))


def test_missing_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    """A safetensors file lacking a tensor names the file and the tensor."""
    err = _error(tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    assert err.path is not None and err.path.endswith("model.safetensors")
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in str(err)


def test_shape_mismatch_names_file_and_shapes(tmp_path: Path) -> None:
    """A tensor of the wrong shape names the file, the tensor and both shapes."""
    err = _error(tmp_path, reshape="model.layers.0.self_attn.k_proj.weight")
    assert err.path is not None and err.path.endswith("model.safetensors")
    assert ("shape mismatch for 'model.layers.0.self_attn.k_proj.weight': expected (16, 32), got (15, 32)"
            in str(err))


def test_unexpected_tensor_is_refused(tmp_path: Path) -> None:
    """Tensors the architecture does not have (e.g. Qwen2 biases in a Llama folder) are an error, not
    ignored."""
    folder = _write_folder(tmp_path / "m", "qwen2")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.k_proj.bias'"):
        load_model(str(folder))


def test_malformed_gguf_names_file(tmp_path: Path) -> None:
    """A .gguf file that is not GGUF names the file; no cache folder is left behind."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="broken.gguf: not a readable GGUF file"):
        load_model(str(bad), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_truncated_safetensors_names_file(tmp_path: Path) -> None:
    """A safetensors file cut short names the file."""
    folder = _write_folder(tmp_path / "m")
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: .*offsets"):
        load_model(str(folder))
