"""Next-token logits of our Llama forward on the real SmolLM2 weights equal transformers' (same dequantized
cache folder, fp32) within 1e-3 max abs diff: prompts of 1, 15, 16, 17, 513 and 600 tokens in one forward,
the same prompts fed as several chunks (KV written, then continued), and several prompts in one batch.
"""

from __future__ import annotations

import pytest
import torch

from engine.forward_batch import ForwardBatch
from engine.model import LoadedModel

pytestmark = [pytest.mark.model, pytest.mark.reference]

PAGE_SIZE = 16
NUM_PAGES = 80
LENGTHS = [1, 15, 16, 17, 513, 600]
TOLERANCE = 1e-3


def _prompt(model: LoadedModel, length: int) -> list[int]:
    text = "Lighthouses guided ships with fire, then oil lamps, then Fresnel lenses and electric light. " * 60
    ids = model.tokenizer.encode(text)
    assert len(ids) >= length
    return ids[:length]


class _Pool:
    """A KV cache plus a bump allocator of shuffled page ids (non-contiguous page tables)."""

    _kv: torch.Tensor | None = None  # one buffer for the module: page faults of a fresh 60 MB cost ~0.5 s

    def __init__(self, model: LoadedModel) -> None:
        c = model.config
        if _Pool._kv is None:
            _Pool._kv = torch.zeros(c.num_layers, 2, NUM_PAGES, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        self.kv = _Pool._kv
        self.free = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0)).tolist()

    def pages(self, length: int) -> list[int]:
        count = -(-length // PAGE_SIZE)
        out, self.free = self.free[:count], self.free[count:]
        return out


def _batch(work: list[tuple[list[int], int, int, list[int]]]) -> ForwardBatch:
    """``work``: (token ids, start, end, pages) per sequence; logits for every sequence's last new token."""
    ids, pos, slots, last = [], [], [], []
    for toks, a, b, pages in work:
        ids += toks[a:b]
        pos += list(range(a, b))
        slots += [pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(a, b)]
        last.append(len(ids) - 1)
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), [b - a for _, a, b,
                                                                                    _ in work],
                        [b for _, _, b, _ in work], [p for *_, p in work], torch.tensor(last))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Pin torch to one thread for this module, then restore: on a busy 2-core machine two OpenMP threads
    spin-wait on each other (measured: 84 s for this file with 2 threads under load, 23 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference_logits(smollm2: LoadedModel, smollm2_reference) -> dict[int, torch.Tensor]:
    """transformers' last-position logits ``[vocab]`` per prompt length, computed once."""
    out = {}
    with torch.inference_mode():
        for n in LENGTHS:
            out[n] = smollm2_reference(torch.tensor([_prompt(smollm2, n)])).logits[0, -1].float()
    return out


def test_one_forward_matches_transformers(smollm2: LoadedModel, reference_logits: dict) -> None:
    """Each prompt alone in one forward: logits within 1e-3 of transformers."""
    for n in LENGTHS:
        pool = _Pool(smollm2)
        toks = _prompt(smollm2, n)
        logits = smollm2.model(_batch([(toks, 0, n, pool.pages(n))]), pool.kv)
        assert logits.shape == (1, smollm2.config.vocab_size) and logits.dtype == torch.float32
        assert (logits[0] - reference_logits[n]).abs().max().item() < TOLERANCE, n


@pytest.mark.parametrize("chunk", [7, 256])
def test_chunked_prefill_matches_transformers(smollm2: LoadedModel, reference_logits: dict,
                                              chunk: int) -> None:
    """A prompt fed as chunks of ``chunk`` tokens (KV written, then continued) gives the one-shot logits."""
    for n in [600] if chunk > 16 else [15, 16, 17]:
        pool = _Pool(smollm2)
        toks, pages = _prompt(smollm2, n), pool.pages(n)
        for a in range(0, n, chunk):
            logits = smollm2.model(_batch([(toks, a, min(a + chunk, n), pages)]), pool.kv)
        assert (logits[0] - reference_logits[n]).abs().max().item() < TOLERANCE, (n, chunk)


def test_mixed_batch_matches_transformers(smollm2: LoadedModel, reference_logits: dict) -> None:
    """A step mixing decodes (last token of 16 and 17 after their prefill) with fresh prompts 1 and 15."""
    pool = _Pool(smollm2)
    t16, t17, t1, t15 = (_prompt(smollm2, n) for n in (16, 17, 1, 15))
    p16, p17 = pool.pages(16), pool.pages(17)
    smollm2.model(_batch([(t16, 0, 15, p16), (t17, 0, 16, p17)]), pool.kv)
    logits = smollm2.model(_batch([(t16, 15, 16, p16), (t1, 0, 1, pool.pages(1)), (t17, 16, 17, p17),
                                   (t15, 0, 15, pool.pages(15))]), pool.kv)
    for row, n in enumerate([16, 1, 17, 15]):
        assert (logits[row] - reference_logits[n]).abs().max().item() < TOLERANCE, n
