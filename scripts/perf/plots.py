"""PNG plots of the serving benchmark (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

Results = Mapping[str, Any]  # deployment → {"chat": {concurrency: summary}, "interference": {...}}


def plot_chat(results: Results, concurrencies: Sequence[int], path: Path) -> Path:
    """TTFT p50, ITL p99, output tokens/s and goodput against concurrency, one line per deployment."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = (("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"),
              ("output_tokens_per_s", "output tokens/s"), ("goodput_requests_per_s", "goodput (requests/s)"))
    for ax, (key, label) in zip(axes, panels):
        for name, res in results.items():
            chat = res.get("chat", {})
            xs = [c for c in concurrencies if str(c) in chat]
            ax.plot(xs, [chat[str(c)][key] for c in xs], marker="o", label=name)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_xticks(list(concurrencies))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Workload (i): chat-like requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_interference(itl_series: Mapping[str, Sequence[tuple[float, float]]],
                      long_windows: Mapping[str, Sequence[tuple[float, float]]], path: Path) -> Path:
    """Decode-stream ITL (ms) over time (s since phase start), long-prompt lifetimes shaded; one panel per
    deployment, same y scale."""
    names = list(itl_series)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.8 * max(1, len(names))), sharex=True, sharey=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for start, end in long_windows.get(name, ()):
            ax.axvspan(start, end, color="tab:orange", alpha=0.15)
        pts = itl_series[name]
        ax.plot([t for t, _ in pts], [v for _, v in pts], ".", markersize=2)
        ax.set_ylabel(f"{name}: ITL (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since phase start (s); shaded: a long prompt in flight")
    fig.suptitle("Workload (ii): decode ITL while long prompts arrive")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
