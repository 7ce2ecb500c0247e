"""LLMEngine on a fake model: every way a request ends returns num_free_pages to its start value; outputs,
stop conditions, chunking, PD roles. No weights needed."""

import pytest
import torch
from engine_fakes import EOS, FakeLoaded, expected_tokens, run_all, tokens

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import EngineError, OutOfPages, RequestRejected

PS = 4


def make_engine(mode="colocated", num_pages=32, chunk=8, budget=16, **kw):
    cfg = EngineConfig(mode=mode, page_size=PS, num_pages=num_pages, chunk_size=chunk,
                       max_num_batched_tokens=budget, **kw)
    return LLMEngine(cfg, FakeLoaded())


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.mark.parametrize("prompt_len", [1, PS - 1, PS, PS + 1, 8 + 1, 30])
def test_finished_by_length_frees_all_pages(prompt_len):
    e = make_engine()
    prompt = [1 + i % 3 for i in range(prompt_len)]
    e.add_request("a", prompt, greedy(6))
    outs = run_all(e)["a"]
    assert tokens(outs) == expected_tokens(prompt, 6)
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 6
    assert e.num_free_pages == e.num_total_pages and not e.has_unfinished()


def test_eos_stops_and_frees():
    e = make_engine()
    e.add_request("a", [30, 20], greedy(10))  # 50, then 100 % 100 = EOS
    outs = run_all(e)["a"]
    assert tokens(outs) == [50, EOS] and outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == "<50>"
    assert e.num_free_pages == e.num_total_pages


def test_ignore_eos_runs_to_length():
    e = make_engine()
    e.add_request("a", [30, 20], greedy(4, ignore_eos=True))
    outs = run_all(e)["a"]
    assert tokens(outs) == [50, 0, 0, 0] and outs[-1].finish_reason == "length"


def test_stop_token_id_stops_and_frees():
    e = make_engine()
    prompt = [1, 2]
    want = expected_tokens(prompt, 8)
    e.add_request("a", prompt, greedy(8, stop_token_ids=[want[2]]))
    outs = run_all(e)["a"]
    assert tokens(outs) == want[:3] and outs[-1].finish_reason == "stop"
    assert e.num_free_pages == e.num_total_pages


def test_stop_string_is_cut_from_text_and_frees():
    e = make_engine()
    prompt = [1, 2]
    want = expected_tokens(prompt, 8)  # [3, 6, 12, 24, 48, 96, 92, 84]
    stop = f"{want[3]}><"  # spans the end of token 3 and the start of token 4
    e.add_request("a", prompt, greedy(8, stop=[stop]))
    outs = run_all(e)["a"]
    assert tokens(outs) == want[:5] and outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == "".join(f"<{t}>" for t in want[:3]) + "<"
    assert e.num_free_pages == e.num_total_pages


def test_text_streams_as_tokens_come():
    e = make_engine()
    e.add_request("a", [1], greedy(3))
    outs = run_all(e)["a"]
    assert [o.new_text for o in outs] == ["<1>", "<2>", "<4>"]
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in outs)


@pytest.mark.parametrize("prompt, max_tokens, why", [
    ([], 4, "empty"), ([1] * 100, 4, "pages"), ([1] * 10, 4090, "max_model_len"), ([100], 4, "outside"),
])
def test_rejected_requests_take_nothing(prompt, max_tokens, why):
    e = make_engine(num_pages=16)
    with pytest.raises(RequestRejected, match=why):
        e.add_request("a", prompt, greedy(max_tokens))
    assert e.num_free_pages == 16 and not e.has_unfinished()


def test_duplicate_live_id_is_rejected():
    e = make_engine()
    e.add_request("a", [1], greedy(2))
    with pytest.raises(RequestRejected):
        e.add_request("a", [1], greedy(2))


def test_abort_mid_prefill_between_chunks():
    e = make_engine(chunk=4, budget=4)
    e.add_request("a", list(range(1, 20)), greedy(4))
    e.step()
    assert e.num_free_pages < e.num_total_pages
    e.abort_request("a")
    e.abort_request("a")  # idempotent
    assert e.num_free_pages == e.num_total_pages and not e.has_unfinished() and e.step() == []


def test_abort_mid_decode():
    e = make_engine()
    e.add_request("a", [1, 2, 3], greedy(10))
    e.step()
    e.step()
    e.abort_request("a")
    assert e.num_free_pages == e.num_total_pages and not e.has_unfinished()


def test_abort_while_waiting_for_pages():
    e = make_engine(num_pages=4)
    e.add_request("a", [1] * 8, greedy(5))  # 3 pages
    e.add_request("b", [1] * 8, greedy(5))
    e.step()
    e.abort_request("b")
    run_all(e)
    assert e.num_free_pages == 4


def test_new_request_joins_running_batch_between_steps():
    e = make_engine()
    e.add_request("a", [1, 2], greedy(6))
    e.step()
    e.step()
    e.add_request("b", [5], greedy(3))
    outs = e.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    rest = run_all(e)
    assert tokens(rest["b"]) == expected_tokens([5], 3)[1:]
    assert e.num_free_pages == e.num_total_pages


def test_continuous_batch_matches_each_request_alone():
    prompts = {str(n): [1 + (i * 7) % 5 for i in range(n)] for n in [1, 3, 4, 5, 9, 17, 33]}
    e = make_engine(num_pages=64, chunk=8, budget=12)
    for rid, p in prompts.items():
        e.add_request(rid, p, greedy(5))
    outs = run_all(e)
    for rid, p in prompts.items():
        assert tokens(outs[rid]) == expected_tokens(p, 5)
    assert max(e.runner.model.num_tokens_seen) <= 12
    assert e.num_free_pages == 64


def test_seeded_sampling_is_batch_independent():
    def run(extra):
        e = make_engine()
        e.add_request("s", [1, 2, 3], SamplingParams(max_tokens=5, seed=9))
        for i in range(extra):
            e.add_request(f"x{i}", [4, 5], SamplingParams(max_tokens=5))
        return tokens(run_all(e)["s"])
    assert run(0) == run(3)


def test_prefill_mode_chunks_name_every_prompt_page_once_and_hold_until_release():
    e = make_engine(mode="prefill", chunk=6, budget=6)
    prompt = list(range(1, 15))  # 14 tokens = 4 pages (3 full + 1 partial)
    e.add_request("p", prompt, greedy(8))
    outs = run_all(e)["p"]
    chunks = [o.prefill_chunk for o in outs]
    assert [c.is_last for c in chunks] == [False, False, True]
    assert [len(c.page_ids) for c in chunks] == [1, 2, 1]  # 6 tokens: 1 full page; 12: 3; end: + partial
    all_pages = [p for c in chunks for p in c.page_ids]
    assert len(all_pages) == 4 == len(set(all_pages))
    assert chunks[-1].first_token_id == expected_tokens(prompt, 1)[0] and outs[-1].finished
    assert e.num_free_pages == e.num_total_pages - 4 and not e.has_unfinished()
    e.release_request("p")
    e.release_request("p")  # idempotent
    assert e.num_free_pages == e.num_total_pages


def test_prefill_mode_abort_after_last_chunk_releases():
    e = make_engine(mode="prefill")
    e.add_request("p", [1, 2, 3], greedy(4))
    run_all(e)
    e.abort_request("p")
    assert e.num_free_pages == e.num_total_pages


def test_release_while_prefilling_is_an_error():
    e = make_engine(mode="prefill", chunk=4, budget=4)
    e.add_request("p", list(range(1, 10)), greedy(4))
    e.step()
    with pytest.raises(EngineError):
        e.release_request("p")
    e.abort_request("p")
    assert e.num_free_pages == e.num_total_pages


def copy_kv(src, src_pages, dst, dst_pages):
    dst.kv_cache[:, :, torch.tensor(dst_pages)] = src.kv_cache[:, :, torch.tensor(src_pages)]


@pytest.mark.parametrize("prompt_len", [1, PS - 1, PS, PS + 1, 13])
def test_pd_in_one_process_matches_colocated(prompt_len):
    prompt = [1 + i % 4 for i in range(prompt_len)]
    pre, dec = make_engine(mode="prefill", chunk=4, budget=4), make_engine(mode="decode", num_pages=40)
    res = dec.reserve_request("r", prompt, greedy(6))
    dst = res.dst_page_ids
    assert len(dst) == -(-prompt_len // PS) and res.num_cached_tokens == 0
    pre.add_request("r", prompt, greedy(6))
    outs = run_all(pre)["r"]
    src = [p for o in outs for p in o.prefill_chunk.page_ids]
    copy_kv(pre, src, dec, dst)
    pre.release_request("r")
    last = outs[-1].prefill_chunk
    forwards = dec.runner.model.num_forwards
    dec.add_prebuilt_request("r", last.first_token_id, last.first_logprob)
    got = tokens(run_all(dec)["r"])
    assert got == expected_tokens(prompt, 6)
    assert dec.runner.model.num_forwards - forwards == 5  # no prefill forward
    assert pre.num_free_pages == pre.num_total_pages and dec.num_free_pages == dec.num_total_pages


def test_decode_reserve_then_abort_before_prebuilt():
    e = make_engine(mode="decode")
    # 12 KV tokens = 3 pages, 2 prompt
    pages = e.reserve_request("r", [1, 2, 3, 4, 5], greedy(8)).dst_page_ids
    assert len(pages) == 2 and e.num_free_pages == e.num_total_pages - 3
    e.abort_request("r")
    assert e.num_free_pages == e.num_total_pages
    with pytest.raises(EngineError):
        e.add_prebuilt_request("r", 1, 0.0)


def test_prebuilt_first_token_finishing_needs_no_forward():
    e = make_engine(mode="decode")
    e.reserve_request("r", [1, 2], greedy(1))
    e.add_prebuilt_request("r", 3, -0.5)
    assert e.has_unfinished()
    outs = e.step()
    assert e.runner.model.num_forwards == 0
    assert outs[0].new_token_ids == [3] and outs[0].new_logprobs == [-0.5]
    assert outs[0].finish_reason == "length"
    assert e.num_free_pages == e.num_total_pages and not e.has_unfinished()


def test_prebuilt_eos_first_token_stops():
    e = make_engine(mode="decode")
    e.reserve_request("r", [1, 2], greedy(5))
    e.add_prebuilt_request("r", EOS, -0.1)
    assert e.step()[0].finish_reason == "stop" and e.num_free_pages == e.num_total_pages


def test_reserve_when_short_raises_out_of_pages_and_takes_nothing():
    e = make_engine(mode="decode", num_pages=4)
    e.reserve_request("a", [1] * 8, greedy(5))  # 3 pages
    with pytest.raises(OutOfPages):
        e.reserve_request("b", [1] * 8, greedy(5))
    assert e.num_free_pages == 1


def test_mode_specific_calls_are_refused_in_other_modes():
    e = make_engine()
    with pytest.raises(EngineError):
        e.reserve_request("r", [1], greedy(2))
    assert e.num_free_pages == e.num_total_pages


def test_prebuilt_twice_is_refused_and_pages_still_return():
    e = make_engine(mode="decode")
    e.reserve_request("r", [1, 2], greedy(1))
    e.add_prebuilt_request("r", 3, -0.5)
    with pytest.raises(EngineError):
        e.add_prebuilt_request("r", 3, -0.5)
    run_all(e)
    assert e.num_free_pages == e.num_total_pages


@pytest.mark.parametrize("kwargs", [
    {"mode": "both"}, {"page_size": 0}, {"num_pages": 4, "kv_cache_bytes": 1 << 20}, {"num_threads": 0},
    {"dtype": "int8"}, {"chunk_size": -1},
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_pool_sized_from_bytes_in_whole_pages():
    page_bytes = 2 * 2 * PS * 1 * 2 * 4  # layers * (K, V) * page_size * kv_heads * head_dim * fp32
    e = LLMEngine(EngineConfig(page_size=PS, kv_cache_bytes=10 * page_bytes + 5), FakeLoaded())
    assert e.num_total_pages == 10 and e.kv_pool.nbytes == 10 * page_bytes
    assert tuple(e.kv_cache.shape) == (2, 2, 10, PS, 1, 2)


def test_prebuilt_first_token_already_sent_is_not_repeated():
    prompt = [1, 2]
    want = expected_tokens(prompt, 4)
    e = make_engine(mode="decode")
    e.reserve_request("r", prompt, greedy(4))
    e.kv_cache[0, 0, e.scheduler.reserved["r"].page_table[0], 0] = 2  # token 1 -> K = 2
    e.kv_cache[0, 0, e.scheduler.reserved["r"].page_table[0], 1] = 3  # token 2 -> K = 3
    e.add_prebuilt_request("r", want[0], -0.1, first_token_sent=True)
    outs = run_all(e)["r"]
    assert tokens(outs) == want[1:] and outs[-1].num_output_tokens == 4
    assert "".join(o.new_text for o in outs) == "".join(f"<{t}>" for t in want[1:])


def test_prebuilt_first_token_sent_and_final():
    e = make_engine(mode="decode")
    e.reserve_request("r", [1, 2], greedy(1))
    e.add_prebuilt_request("r", 3, -0.5, first_token_sent=True)
    (out,) = e.step()
    assert out.finished and out.new_token_ids == [] and out.new_text == "" and out.num_output_tokens == 1
    assert e.num_free_pages == e.num_total_pages


@pytest.mark.parametrize("stop", [(), ("<6><1",), ("6>",), ("3>",), ("<3",)])
def test_pd_text_with_first_token_sent_equals_colocated_text(stop):
    prompt = [1, 2]
    col = make_engine()
    col.add_request("r", prompt, greedy(6, stop=stop))
    col_outs = run_all(col)["r"]
    pre, dec = make_engine(mode="prefill"), make_engine(mode="decode")
    dst = dec.reserve_request("r", prompt, greedy(6, stop=stop)).dst_page_ids
    pre.add_request("r", prompt, greedy(6, stop=stop))
    (last,) = run_all(pre)["r"]
    copy_kv(pre, last.prefill_chunk.page_ids, dec, dst)
    dec.add_prebuilt_request("r", last.prefill_chunk.first_token_id, last.prefill_chunk.first_logprob,
                             first_token_sent=True)
    dec_outs = run_all(dec)["r"]
    assert last.new_text + "".join(o.new_text for o in dec_outs) == "".join(o.new_text for o in col_outs)
    assert last.new_token_ids + tokens(dec_outs) == tokens(col_outs)
    assert dec_outs[-1].finish_reason == col_outs[-1].finish_reason
