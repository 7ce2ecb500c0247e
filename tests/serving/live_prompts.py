"""Prompts of mixed lengths for the live tests (one over ``chunk_size`` = 512 tokens: chunked prefill)."""

_PARAGRAPH = ("The river wound through the valley, past orchards and stone bridges, carrying the spring melt "
              "from the mountains down to the sea. Farmers along its banks measured the seasons by its "
              "height. ")

PROMPTS: list[str] = [
    "The capital of France is",
    "Once upon a time",
    "Write a short list of three fruits:\n1.",
    _PARAGRAPH * 4 + "Summarize the paragraph above in one sentence:",
    _PARAGRAPH * 16 + "In one word, what flows through the valley?",
    "def fibonacci(n):\n    ",
]

_GREEDY = {"max_tokens": "16", "temperature": "0"}
#: Requests every served model must answer with one error and FINAL: name → (prompt, sampling_parameters,
#: flags).
BAD_INPUTS: dict[str, tuple[str, dict[str, object] | str, dict[str, bool]]] = {
    "empty prompt": ("", _GREEDY, {}),
    "longer than the context": ("hello " * 9000, _GREEDY, {}),
    "more than the KV pool": ("hello", {"max_tokens": 100_000}, {}),
    "max_tokens 0": ("hello", {"max_tokens": 0}, {}),
    "malformed JSON": ("hello", '{"max_tokens": 4', {}),
    "unknown parameter": ("hello", {"max_tokens": 4, "beam_width": 2}, {}),
    "wrong type": ("hello", {"max_tokens": "many"}, {}),
    "stream without exclude": ("hello", _GREEDY, {"exclude_input_in_output": False}),
}


def colocated_greedy_texts(prompts: list[str], sampling: dict[str, str], sequential: bool = False,
                           **worker: str) -> dict[str, str]:
    """Text of every prompt from one colocated engine run in-process, all prompts in one continuous batch, or
    with ``sequential`` one after the other (each to its end first: the reference of a server sent one request
    at a time, for formats whose numbers depend on the batch, see ``engine.model.linear``); the reference the
    live tests compare a server's streams with. ``worker``: WorkerConfig fields of the served models
    (``dtype``, ``weight_quant``)."""
    return {prompt: text for prompt, (text, _) in colocated_greedy_runs(prompts, sampling, sequential,
                                                                        **worker).items()}


def colocated_greedy_runs(prompts: list[str], sampling: dict[str, str], sequential: bool = False,
                          **worker: str) -> dict[str, tuple[str, list[tuple[int, float]]]]:
    """``colocated_greedy_texts``, with each prompt's (token id, logprob) of every sampled token beside its
    text (empty unless ``sampling`` has ``logprobs``)."""
    import json
    import time

    from engine import LLMEngine
    from serving.config import WorkerConfig
    from serving.parsing.prompt import prompt_token_ids
    from serving.parsing.request import parse_request

    config = WorkerConfig(num_pages=256, **worker)  # type: ignore[arg-type]
    engine = LLMEngine(config.engine_config("colocated"))
    texts: dict[str, str] = {}
    tokens: dict[str, list[tuple[int, float]]] = {}
    deadline = time.monotonic() + 300

    def run() -> None:
        while engine.has_unfinished() and time.monotonic() < deadline:
            for out in engine.step():
                texts[out.request_id] += out.new_text
                tokens[out.request_id] += [(t.token_id, t.logprob) for t in out.new_token_logprobs]
        assert not engine.has_unfinished(), "the reference run did not finish in 300 s"

    for i, prompt in enumerate(prompts):
        req = parse_request({"text_input": prompt.encode(), "sampling_parameters": json.dumps(sampling)})
        engine.add_request(str(i), prompt_token_ids(engine.tokenizer, req), req.params)
        texts[str(i)], tokens[str(i)] = "", []
        if sequential:
            run()
    run()
    return {prompts[int(k)]: (v, tokens[k]) for k, v in texts.items()}
