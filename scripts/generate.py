#!/usr/bin/env python3
"""Stream a completion from the server over gRPC and print it as it arrives.

    python scripts/generate.py "What is the capital of France?" --chat
    python scripts/generate.py "Once upon a time" --model colocated --max-tokens 64 --temperature 0.8 --seed 1

Exits 1 with the server's message on an error response, 2 when no response came within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompt")
    p.add_argument("--model", default="pd_ensemble", help="pd_ensemble (default) or colocated")
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text (prompt first)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response")
    return p.parse_args(argv)


def build_inputs(args: argparse.Namespace) -> list[grpcclient.InferInput]:
    """The Triton LLM-convention inputs of the request."""
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.seed is not None:
        params["seed"] = args.seed
    values = {"text_input": args.prompt.encode(), "sampling_parameters": json.dumps(params).encode(),
              "stream": not args.no_stream, "apply_chat_template": args.chat}
    inputs = []
    for name, value in values.items():
        dtype = "BOOL" if isinstance(value, bool) else "BYTES"
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.array([value], dtype=np.bool_ if dtype == "BOOL" else np.object_))
        inputs.append(tensor)
    return inputs


def is_final(result: Any) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(args.model, build_inputs(args), enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=args.timeout)
            except queue.Empty:
                print(f"\nerror: no response within {args.timeout:.0f} s", file=sys.stderr)
                return 2
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None:
                sys.stdout.write(b"".join(text.reshape(-1)).decode("utf-8", errors="replace"))
                sys.stdout.flush()
            if is_final(result):
                sys.stdout.write("\n")
                return 0
    except KeyboardInterrupt:
        client.stop_stream(cancel_requests=True)
        return 130
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
