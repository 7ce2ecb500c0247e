"""The model half of the engine: config, loader (GGUF / HF folder), tokenizer, Llama-family forward."""

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "LlamaForCausalLM", "LoadedModel", "ModelConfig", "ModelLoadError",
           "Tokenizer", "load_model"]
