"""The request streams of the serving benchmark: deterministic prompts, closed-loop and open-loop phases.

A prompt of ``n`` tokens is ``n`` words drawn (seeded) from a list of common English words: each word with its
leading space is one token in SmolLM2's byte-level BPE, so the length is close to ``n``; the server's
``num_input_tokens`` output gives the exact count. Every deployment gets the identical specs in the same
order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our used me man too any day "
    "same right look think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number great tell men "
    "say small every found still between name should home big give air line set own under read last never us "
    "left end along while might next sound below saw something thought both few those always looked show "
    "large often together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began almost live "
    "page got earth need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        request_id: unique within a run, e.g. ``"chat-c4-007"``.
        kind: ``"chat"``, ``"decode"`` (decode-heavy stream) or ``"long"`` (long prompt).
        prompt: the text sent as ``text_input``.
        num_prompt_tokens: the intended prompt length, in tokens.
        max_tokens: tokens to generate (``ignore_eos`` is set, so exactly this many unless an error).
        arrival_s: open loop: send time after the phase start, in s; ``None`` for closed-loop requests.
        slot: closed loop: the client slot that sends it (requests of one slot go one after another).
    """

    request_id: str
    kind: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float | None = None
    slot: int = 0


@dataclass(frozen=True)
class Phase:
    """A set of requests measured together.

    Attributes:
        name: e.g. ``"chat_c4"`` or ``"interference"``.
        requests: closed-loop requests (``arrival_s is None``) are sent slot by slot, each slot waiting for
        its
            previous request to end; open-loop requests are sent at ``arrival_s``.
        stop_closed_loop_after_open: closed-loop slots stop issuing new requests once every open-loop request
            has ended (the interference phase: decode streams run as long as long prompts arrive).
    """

    name: str
    requests: tuple[RequestSpec, ...]
    stop_closed_loop_after_open: bool = False


def make_prompt(num_tokens: int, seed: int) -> str:
    """``num_tokens`` seeded words (about one token each); distinct seeds give distinct prompts."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))


def chat_phase(concurrency: int, num_requests: int, prompt_tokens: int, max_tokens: int, seed: int) -> Phase:
    """Workload (i): ``num_requests`` chat-like requests spread round-robin over ``concurrency`` slots."""
    requests = tuple(
        RequestSpec(request_id=f"chat-c{concurrency}-{i:03d}", kind="chat",
                    prompt=make_prompt(prompt_tokens, seed * 100_003 + i), num_prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens, slot=i % concurrency)
        for i in range(num_requests))
    return Phase(name=f"chat_c{concurrency}", requests=requests)


@dataclass(frozen=True)
class InterferenceConfig:
    """Workload (ii): steady decode-heavy streams while long prompts arrive at a fixed rate.

    Attributes:
        num_decode_streams: closed-loop slots sending decode-heavy requests back to back.
        decode_prompt_tokens: prompt length of a decode-heavy request, in tokens.
        decode_max_tokens: tokens each decode-heavy request generates.
        long_prompt_tokens: prompt length of a long request, in tokens.
        long_max_tokens: tokens each long request generates.
        num_long: long requests in the phase.
        long_interval_s: fixed gap between long arrivals, in s.
        first_long_s: arrival of the first long request after the phase start, in s (decode streams warm up).
    """

    num_decode_streams: int = 4
    decode_prompt_tokens: int = 32
    decode_max_tokens: int = 128
    long_prompt_tokens: int = 2048
    long_max_tokens: int = 8
    num_long: int = 4
    long_interval_s: float = 15.0
    first_long_s: float = 3.0


def interference_phase(cfg: InterferenceConfig, max_decode_requests_per_stream: int, seed: int) -> Phase:
    """Decode slots get ``max_decode_requests_per_stream`` requests each (they stop early when the long
    requests are done); long requests arrive at ``first_long_s + k * long_interval_s``."""
    decode = tuple(
        RequestSpec(request_id=f"decode-s{slot}-{i:03d}", kind="decode",
                    prompt=make_prompt(cfg.decode_prompt_tokens, seed * 7_919 + slot * 1_000 + i),
                    num_prompt_tokens=cfg.decode_prompt_tokens, max_tokens=cfg.decode_max_tokens, slot=slot)
        for i in range(max_decode_requests_per_stream) for slot in range(cfg.num_decode_streams))
    long = tuple(
        RequestSpec(request_id=f"long-{k:03d}", kind="long",
                    prompt=make_prompt(cfg.long_prompt_tokens, seed * 104_729 + k),
                    num_prompt_tokens=cfg.long_prompt_tokens, max_tokens=cfg.long_max_tokens,
                    arrival_s=cfg.first_long_s + k * cfg.long_interval_s)
        for k in range(cfg.num_long))
    return Phase(name="interference", requests=decode + long, stop_closed_loop_after_open=True)
