"""LLMEngine.add_request with ``resumed_output_ids`` (a migrated request) on the fake model: resuming after
any k tokens gives exactly the rest of an uninterrupted run (tokens, text, finish reason, logprobs of the new
tokens), greedy and seeded, with stop strings straddling the resume point; bad resumes fail that request only
and take no pages."""

import pytest
from engine_fakes import EOS, FakeLoaded, run_all, tokens

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import RequestRejected

PROMPT = [1, 2, 3]


def make_engine(mode="colocated", chunk=8, budget=16):
    return LLMEngine(EngineConfig(mode=mode, page_size=4, num_pages=32, chunk_size=chunk,
                                  max_num_batched_tokens=budget), FakeLoaded())


def uninterrupted(params, mode="colocated"):
    e = make_engine(mode=mode)
    e.add_request("r", PROMPT, params)
    return run_all(e)["r"]


def resumed(params, k, mode="colocated"):
    full = uninterrupted(params)
    assert len(tokens(full)) > k, "the uninterrupted run must go past the resume point"
    ids = tokens(full)[:k]
    e = make_engine(mode=mode)
    e.add_request("r", PROMPT, params, resumed_output_ids=ids)
    outs = run_all(e)["r"]
    assert e.num_free_pages == e.num_total_pages
    return full, ids, outs


def sent_text(outs, ids_sent):
    """The text a client received of an uninterrupted run once ``ids_sent`` tokens reached the router: every
    output up to the one that carried token ``ids_sent`` (outputs here carry one token each)."""
    text, count = "", 0
    for o in outs:
        if count >= ids_sent:
            break
        text += o.new_text
        count += len(o.new_token_ids)
    return text


@pytest.mark.parametrize("mode", ["colocated", "decode"])
@pytest.mark.parametrize("k", [1, 2, 4])
# tokens 6 12 24 48 96 92 84 ...: the stop strings end the run at token 5 or 7; those of token 5 start within
# the text of tokens <= 4, held back when the run is resumed after token 4
@pytest.mark.parametrize("stop", [(), ("8><9",), ("<48><96",), ("<84",)])
def test_greedy_resume_continues_the_uninterrupted_run(mode, k, stop):
    params = SamplingParams(max_tokens=9, temperature=0.0, stop=stop, logprobs=2)
    full, ids, outs = resumed(params, k, mode)
    assert ids + tokens(outs) == tokens(full)
    assert sent_text(full, k) + "".join(o.new_text for o in outs) == "".join(o.new_text for o in full)
    assert outs[-1].finish_reason == full[-1].finish_reason
    assert outs[-1].num_output_tokens == full[-1].num_output_tokens
    new_logprobs = [lp for o in outs for lp in o.new_token_logprobs]
    assert new_logprobs == [lp for o in full for lp in o.new_token_logprobs][k:]
    first_k = [lp for o in full for lp in o.new_logprobs][:k]
    assert abs(outs[-1].cumulative_logprob - (full[-1].cumulative_logprob - sum(first_k))) < 1e-5


@pytest.mark.parametrize("k", [1, 3, 6])
def test_seeded_resume_draws_what_the_original_drew(k):
    params = SamplingParams(max_tokens=10, temperature=5.0, seed=1234, ignore_eos=True)
    full, ids, outs = resumed(params, k)
    assert ids + tokens(outs) == tokens(full)
    other = uninterrupted(SamplingParams(max_tokens=10, temperature=5.0, seed=99, ignore_eos=True))
    assert tokens(other) != tokens(full), "the seed must matter for this test to say anything"


def test_resumed_tokens_are_prefilled_in_chunks_not_one_step_each():
    e = make_engine(chunk=8, budget=16)
    ids = tokens(uninterrupted(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))[:9]
    e.add_request("r", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                  resumed_output_ids=ids)
    first = e.step()   # 12 known tokens, chunk 8: no output yet
    second = e.step()  # the last 4 known tokens, then the 10th token is sampled
    assert first == [] and [len(o.new_token_ids) for o in second] == [1]


@pytest.mark.parametrize("ids, why", [([5] * 9, "leave none"), ([500], "outside"), ([EOS], "already ends")])
def test_bad_resumes_are_rejected_and_take_nothing(ids, why):
    e = make_engine()
    with pytest.raises(RequestRejected, match=why):
        e.add_request("r", PROMPT, SamplingParams(max_tokens=9, temperature=0.0), resumed_output_ids=ids)
    assert e.num_free_pages == e.num_total_pages and not e.has_unfinished()
    e.add_request("r", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))   # the id is free again
    assert len(tokens(run_all(e)["r"])) == 2


def test_prefill_mode_does_not_resume():
    e = make_engine(mode="prefill")
    with pytest.raises(RequestRejected, match="prefill-mode"):
        e.add_request("r", PROMPT, SamplingParams(max_tokens=4), resumed_output_ids=[5])
