"""The engine on a CUDA device against the same engine on the CPU (a check for a machine with a GPU; not a
test: CI has none).

Loads one model folder twice (``--model``; a random SmolLM2-135M from ``scripts/perf/tiny_model.py --full``
where the bundled GGUF cannot travel), runs the same greedy requests (``--prompts`` prompts of 8 to 300 tokens
cut from the shipped perplexity text, ``--new-tokens`` each, logprobs on, all added at once: continuous
batching, chunked prefill) through ``LLMEngine`` on ``cpu`` and on ``--device``, per dtype of ``--dtypes``,
and prints per dtype: how many requests produced the same tokens, the first differing position of the others,
the largest logprob difference before it, and the device's batch-1 inter-token latency and batched tokens/s.
The attention backend is whatever ``engine.attention.select_backend`` picks there (flashinfer when installed,
torch's otherwise: printed). Exit status 1 when any stage raised (the traceback is printed and the next stage
still runs).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.model.loader import load_tokenizer  # noqa: E402
from engine.model.perplexity import reference_text  # noqa: E402


def run(model: str, device: str, dtype: str, prompts: list[list[int]], new_tokens: int
        ) -> tuple[dict[str, tuple[list[int], list[float]]], float, float, str]:
    """(request id -> (tokens, logprobs), batch-1 ITL ms, batched tokens/s, attention backend name)."""
    loaded = load_model(model, dtype=getattr(torch, dtype), device=device)
    backend = type(loaded.model.attention_backend).__name__
    cfg = EngineConfig(model=model, device=device, dtype=dtype, num_pages=512, chunk_size=128,
                       max_num_batched_tokens=256)
    engine = LLMEngine(cfg, loaded)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.add_request("b1", prompts[0], greedy)
    engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    itl_ms = (time.perf_counter() - start) / max(steps, 1) * 1e3
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    out: dict[str, tuple[list[int], list[float]]] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
    tok_s = sum(len(t) for t, _ in out.values()) / (time.perf_counter() - start)
    return out, itl_ms, tok_s, backend


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()} "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}", flush=True)
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer.encode(reference_text())
    lengths = [8 + (300 - 8) * i // max(1, args.prompts - 1) for i in range(args.prompts)]
    prompts = [ids[i * 7:i * 7 + n] for i, n in enumerate(lengths)]
    failed = False
    for dtype in args.dtypes.split(","):
        try:
            cpu, cpu_itl, cpu_tok_s, _ = run(args.model, "cpu", dtype, prompts, args.new_tokens)
            dev, itl, tok_s, backend = run(args.model, args.device, dtype, prompts, args.new_tokens)
        except Exception:  # noqa: BLE001 - report the stage and go on with the next one
            traceback.print_exc()
            failed = True
            continue
        same, diffs = 0, []
        for rid, (tokens, logprobs) in cpu.items():
            got_tokens, got_logprobs = dev[rid]
            if got_tokens == tokens:
                same += 1
                upto = len(tokens)
            else:
                upto = next(i for i, (a, b) in enumerate(zip(tokens, got_tokens)) if a != b)
                diffs.append(f"{rid}@{upto}")
            if upto:
                gap = max(abs(a - b) for a, b in zip(logprobs[:upto], got_logprobs[:upto]))
                diffs.append(f"{rid} max|dlogprob| {gap:.2e}")
        print(f"{dtype}: {same}/{len(cpu)} requests token-identical to the CPU; {'; '.join(diffs)}",
              flush=True)
        print(f"{dtype}: {args.device} ({backend}) b1 ITL {itl:.2f} ms, {tok_s:.0f} tok/s batched; "
              f"cpu b1 ITL "
              f"{cpu_itl:.2f} ms, {cpu_tok_s:.0f} tok/s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
