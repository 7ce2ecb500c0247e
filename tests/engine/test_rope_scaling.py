"""RoPE scaling (``linear``, ``llama3``, ``yarn``) gives transformers' tokens and logits.

Tiny random models made with transformers' own configs (``from_config``, saved with ``save_pretrained``) whose
scaling has ``original_max_position_embeddings`` 32, run on a 60-token prompt, so the 20 greedy tokens come
from positions 60..79, far past the pre-training context: Llama with ``llama3`` and with ``linear`` (the newer
``rope_parameters`` form transformers writes), Qwen3-MoE with ``yarn`` (attention factor 1.21 on cos/sin)
and DeepSeek-V3 with ``yarn`` as its own ``config.json`` writes it (the older ``rope_scaling`` dict with
``type``; ``mscale`` 0.707 and ``mscale_all_dim`` 1: a cos/sin factor and MLA's softmax scale multiplied by
``mscale(40, 1) ** 2``). Greedy tokens equal transformers' ``generate`` (fp32); next-token logits at every
position are within 1e-4 of transformers' (measured: equal for Llama, 2.4e-6 for YaRN), and more than 100
times that from the same weights without the scaling (measured: 2.2 to 2.9), so the scaling is what is
checked. ``dynamic`` and ``longrope`` are refused by name; a ``yarn`` dict without ``factor`` names the field.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_moe_models import (
    VOCAB,
    deepseek_config,
    greedy,
    make_engine,
    qwen3_moe_config,
    reference_tokens,
    run,
    save_model,
    tokens,
)

from engine.forward_batch import ForwardBatch
from engine.model import ModelLoadError, load_model
from engine.model.rope_scaling import LinearScaling, Llama3Scaling, YarnScaling, rope_fields

pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed")]

PROMPT = [(7 * i + 3) % VOCAB for i in range(60)]
TOLERANCE = 1e-4
ORIGINAL = 32
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek-V3's config.json: the older dict, "type", factor 40 (here over a context of 32, not 4096)
    "deepseek_yarn": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIGINAL},
}


def llama_config(**overrides):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    return LlamaConfig(**{**fields, **overrides})


def _config(case: str, scaled: bool = True):
    scaling = {"rope_theta": 10000.0, **SCALINGS[case]} if scaled else None
    if case == "deepseek_yarn":
        return deepseek_config(rope_parameters=scaling, max_position_embeddings=40 * ORIGINAL)
    if case == "yarn":
        return qwen3_moe_config(rope_parameters=scaling)
    return llama_config(rope_parameters=scaling)


def _as_older_rope_scaling(folder: Path) -> None:
    """Rewrite ``config.json`` as DeepSeek-V3's own is: ``rope_theta`` beside a ``rope_scaling`` dict."""
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling=SCALINGS["deepseek_yarn"])
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module", params=["llama3", "linear", "yarn", "deepseek_yarn"])
def scaled(request, tmp_path_factory):  # -> (case, folder, transformers model)
    folder = tmp_path_factory.mktemp(request.param)
    model = save_model(folder, _config(request.param))
    if request.param == "deepseek_yarn":
        _as_older_rope_scaling(folder)
    return request.param, folder, model


def _engine_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """Next-token logits ``[len(ids), vocab]`` at every position of one forward over the paged KV."""
    model = load_model(str(folder)).model
    c, page, n = model.config, 4, len(ids)
    pages = torch.randperm(-(-n // page), generator=torch.Generator().manual_seed(0)).tolist()
    kv = torch.zeros(c.num_layers, 1 if c.mla else 2, len(pages), page, c.num_kv_heads, c.head_dim)
    slots = [pages[t // page] * page + t % page for t in range(n)]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor(slots), [n], [n], [pages],
                         torch.arange(n))
    return model(batch, kv)


def test_greedy_tokens_past_the_original_context_equal_transformers(scaled) -> None:
    case, folder, model = scaled
    engine = make_engine(folder, chunk_size=16)
    engine.add_request("p60", PROMPT, greedy())
    assert tokens(run(engine)["p60"]) == reference_tokens(model, {"p60": PROMPT})["p60"]


def test_logits_equal_transformers_and_differ_without_the_scaling(scaled) -> None:
    from transformers import AutoModelForCausalLM

    case, folder, model = scaled
    plain = AutoModelForCausalLM.from_config(_config(case, scaled=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPT])).logits[0]
        unscaled = plain(torch.tensor([PROMPT])).logits[0]
    ours = _engine_logits(folder, PROMPT)
    torch.testing.assert_close(ours, expected, atol=TOLERANCE, rtol=0)
    assert (unscaled - expected).abs().max() > 100 * TOLERANCE


def test_both_dict_forms_read_the_same_scaling() -> None:
    """transformers' ``rope_parameters`` (``rope_theta`` inside) and the older ``rope_scaling`` (``type``,
    ``rope_theta`` beside it) give one ``RopeScaling``; ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings``."""
    older = {"rope_theta": 500.0, "max_position_embeddings": 64,
             "rope_scaling": {"type": "yarn", "factor": 4, "mscale": 1, "mscale_all_dim": 1}}
    newer = {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                 "rope_theta": 500.0, "mscale": 1.0,
                                                                 "mscale_all_dim": 1.0}}
    want = YarnScaling(4.0, 64, mscale=1.0, mscale_all_dim=1.0)
    assert rope_fields(older) == rope_fields(newer) == {"rope_theta": 500.0, "rope_scaling": want}
    assert rope_fields(llama_config(rope_parameters=dict(SCALINGS["llama3"])).to_dict())["rope_scaling"] == \
        Llama3Scaling(8.0, 1.0, 4.0, ORIGINAL)
    assert rope_fields({"rope_scaling": {"rope_type": "linear", "factor": 2}})["rope_scaling"] == \
        LinearScaling(2.0)


def test_the_scaling_goes_back_into_the_hf_dict(scaled) -> None:
    case, folder, _ = scaled
    config = load_model(str(folder)).config
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == SCALINGS[case].get(
        "rope_type", "yarn")
    assert rope_fields(config.to_hf_dict()) == {"rope_theta": 10000.0, "rope_scaling": config.rope_scaling}


def _folder_with(tmp_path: Path, rope_scaling: dict) -> Path:
    raw = llama_config().to_dict()
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = rope_scaling
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("rope_scaling,named", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_type 'longrope'"),
    ({"type": "yarn", "original_max_position_embeddings": 32}, "missing field 'rope_scaling.factor'"),
    ({"rope_type": "yarn", "factor": "big"}, "rope_scaling.factor must be a number"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1},
     "high_freq_factor=1.0 must exceed low_freq_factor=4.0"),
])
def test_an_unserved_or_malformed_scaling_fails_the_load_naming_it(tmp_path: Path, rope_scaling: dict,
                                                                   named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(_folder_with(tmp_path, rope_scaling)))
