"""Prompts of mixed lengths for the live tests (one over ``chunk_size`` = 512 tokens: chunked prefill)."""

_PARAGRAPH = ("The river wound through the valley, past orchards and stone bridges, carrying the spring melt "
              "from the mountains down to the sea. Farmers along its banks measured the seasons by its height. ")

PROMPTS: list[str] = [
    "The capital of France is",
    "Once upon a time",
    "Write a short list of three fruits:\n1.",
    _PARAGRAPH * 4 + "Summarize the paragraph above in one sentence:",
    _PARAGRAPH * 16 + "In one word, what flows through the valley?",
    "def fibonacci(n):\n    ",
]
