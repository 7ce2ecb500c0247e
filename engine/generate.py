"""Offline generation from the command line: ``python -m engine.generate --prompt "..." --max-tokens 32``.

Streams the generated text to stdout as it is produced; ``--chat`` wraps the prompt in the model's chat
template first. Exit status 2 on invalid arguments or a rejected request.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens to generate")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                                ignore_eos=args.ignore_eos)
        engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.num_threads, device=args.device))
        text = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        engine.add_request("cli-0", engine.tokenizer.encode(text), params)
    except (EngineError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
