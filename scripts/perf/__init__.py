"""Serving benchmark helpers for ``scripts/bench_serving.py`` and the perf_analyzer / genai-perf wrappers.

Importable with ``scripts/`` on ``sys.path`` (``import perf.stats``); Triton-free except ``stream_client``
(tritonclient) and ``server`` (starts tritonserver processes).
"""
