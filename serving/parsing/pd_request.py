"""The extra inputs of the prefill and decode models: the bootstrap room and the paired prefill instance.

``pd_ensemble`` sends each child request the client's LLM-convention inputs (``text_input``,
``sampling_parameters``, ``apply_chat_template``) plus:

=====================  =======  ==============================================================================
``bootstrap_room``     INT64    the room both halves of the request meet in, ``0 <= room < 2**63``
``prefill_instance``   STRING   decode only: the instance id of the prefill instance that computes the KV;
                                empty or absent: **direct decode**, the decode instance prefills the prompt
                                itself and streams every token
``prefill_rendezvous`` STRING   decode only, with ``prefill_instance``: that instance's own rendezvous
                                (``http://host:port``), where decode posts the room's destination
``resume_token_ids``   INT32    decode only, ``[k]``, ``1 <= k < max_tokens``, no ``prefill_instance``: a
                                **migrated** request: the tokens it already generated (on a decode instance
                                that failed) and sent to the client; a direct decode that prefills the prompt
                                and these tokens and streams only what follows them
``prompt_token_ids``   INT32    ``[k]``, with ``tokenizer_id``: the prompt's token ids as the router's
                                tokenizer made them (chat template applied); the child uses them instead of
                                tokenizing ``text_input`` again when ``tokenizer_id`` is its own tokenizer's
                                (``engine.model.tokenizer.Tokenizer.fingerprint``), else it tokenizes
``tokenizer_id``       STRING   the fingerprint of the tokenizer that made ``prompt_token_ids``
``dp_rank``            INT32    ``[1]``, ``>= 0``: the DP-attention rank of this instance that runs the
                                request (a decode's: whose KV pool receives the prompt's KV), as the router
                                chose it; absent: the instance places the request itself. A rank the
                                instance does not have is a request error
``child_schema``       STRING   the router's ``serving.child.codec.SCHEMA_HASH``: a child of another build
                                answers with an error naming both (absent: not checked)
``pd_control``         STRING   ``"describe"``: no generation; one response whose ``text_output`` is this
                                instance's ``InstanceCard`` JSON (how a router of the same server finds it)
=====================  =======  ==============================================================================

A router that dies or cancels a child stream needs no message of its own: Triton cancels the child request
(also when the router's connection drops), and the worker aborts the room and tells its peer.

Children always stream: prefill answers with the first token, then FINAL once its KV has been sent; decode
answers with one response per text delta of the tokens after the first one (direct decode: from the first).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from serving.child.codec import SCHEMA_INPUT, check_schema
from serving.parsing.request import GenerateRequest, RequestError, parse_request

Room = int
MAX_ROOM = 2**63 - 1
PD_INPUT_NAMES: tuple[str, ...] = ("bootstrap_room", "prefill_instance", "prefill_rendezvous",
                                   "resume_token_ids", "prompt_token_ids", "tokenizer_id", "dp_rank",
                                   SCHEMA_INPUT)
CONTROL_INPUT = "pd_control"
DESCRIBE = "describe"
CARD_VERSION = 1


@dataclass(frozen=True)
class InstanceCard:
    """What a PD worker says of itself when asked (``pd_control = "describe"``): how a router finds the
    instance's rendezvous (where its load, health and registration are) when no registry announces it.

    Attributes:
        instance_id: ``<model>@<grpc host:port>``, fleet-unique.
        role: ``"prefill"`` or ``"decode"``.
        model_name: the Triton model that serves it.
        address: the Triton gRPC endpoint (``host:port``) routers send its requests to.
        rendezvous_url: its own rendezvous (``http://host:port``).
        epoch: changes on every start of the instance (``time.time_ns()`` of its KV manager's start).
    """

    instance_id: str
    role: str
    model_name: str
    address: str
    rendezvous_url: str
    epoch: int

    def to_json(self) -> str:
        return json.dumps({"version": CARD_VERSION, **asdict(self)})

    @classmethod
    def from_json(cls, text: str) -> InstanceCard:
        """Raises ``ValueError`` on another version or a malformed card."""
        try:
            body = json.loads(text)
            if body.pop("version", None) != CARD_VERSION:
                raise ValueError(f"instance card version is not {CARD_VERSION}")
            return cls(**body)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed instance card: {e}") from None


@dataclass(frozen=True)
class PDRequest:
    """One half of a disaggregated request.

    Attributes:
        request: the client's request (always treated as streaming, the prompt never echoed).
        room: the bootstrap room.
        prefill_instance: decode only: which prefill instance writes this room's KV; empty: direct decode.
        prefill_rendezvous: decode only: that prefill instance's rendezvous URL.
        resume_token_ids: decode only, direct: tokens already generated and sent (a migrated request); empty:
            a new request.
        prompt_token_ids: the prompt's ids as the router tokenized it (empty: not sent).
        tokenizer_id: the fingerprint of the tokenizer that made ``prompt_token_ids``.
        dp_rank: the DP-attention rank the router chose for the request; None: the instance places it.
    """

    request: GenerateRequest
    room: Room
    prefill_instance: str = ""
    prefill_rendezvous: str = ""
    resume_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    tokenizer_id: str = ""
    dp_rank: int | None = None

    @property
    def direct(self) -> bool:
        """Decode only: no prefill instance, the decode engine prefills the prompt itself."""
        return not self.prefill_instance


def parse_pd_request(llm_inputs: Mapping[str, bytes | str | bool],
                     pd_inputs: Mapping[str, np.ndarray]) -> PDRequest:
    """Validate a child request.

    Args:
        llm_inputs: the LLM-convention inputs (``triton_io.read_inputs``).
        pd_inputs: ``bootstrap_room`` (int64, one element) and, for decode, ``prefill_instance`` (bytes; empty
            or absent: direct decode) with ``prefill_rendezvous`` (bytes, required with ``prefill_instance``),
            and ``resume_token_ids`` (integers ``[k]``, direct decode only), ``prompt_token_ids`` (integers
            ``[k]`` >= 0, with ``tokenizer_id``), ``dp_rank`` (one integer >= 0).
    Raises:
        ChildSchemaMismatch: ``child_schema`` is another build's (``serving.child.codec``), checked first.
        RequestError: naming the offending input.
    """
    check_schema(pd_inputs)
    request = replace(parse_request(llm_inputs), stream=True, exclude_input_in_output=True)
    if "bootstrap_room" not in pd_inputs:
        raise RequestError("bootstrap_room", "is required (send requests to pd_ensemble, which allocates it)")
    room_array = np.asarray(pd_inputs["bootstrap_room"]).reshape(-1)
    if room_array.size != 1 or not np.issubdtype(room_array.dtype, np.integer):
        raise RequestError("bootstrap_room", "must be one integer")
    room = int(room_array[0])
    if not 0 <= room <= MAX_ROOM:
        raise RequestError("bootstrap_room", f"must be a 63-bit id, got {room}")
    prefill_instance = _optional_text(pd_inputs, "prefill_instance")
    prefill_rendezvous = _optional_text(pd_inputs, "prefill_rendezvous")
    if prefill_instance and not prefill_rendezvous.startswith(("http://", "https://")):
        raise RequestError("prefill_rendezvous", "must be the prefill instance's rendezvous URL "
                           "(http://host:port) when prefill_instance is set")
    resume = _resume_token_ids(pd_inputs, request.params.max_tokens)
    if resume and prefill_instance:
        raise RequestError("resume_token_ids", "resumes a direct decode: send it without prefill_instance")
    prompt_ids = _token_ids(pd_inputs, "prompt_token_ids")
    tokenizer_id = _optional_text(pd_inputs, "tokenizer_id")
    if prompt_ids and not tokenizer_id:
        raise RequestError("tokenizer_id", "is required with prompt_token_ids (the fingerprint of the "
                           "tokenizer that made them)")
    return PDRequest(request=request, room=room, prefill_instance=prefill_instance,
                     prefill_rendezvous=prefill_rendezvous, resume_token_ids=resume,
                     prompt_token_ids=prompt_ids, tokenizer_id=tokenizer_id, dp_rank=_dp_rank(pd_inputs))


def _dp_rank(pd_inputs: Mapping[str, np.ndarray]) -> int | None:
    """``dp_rank``: one integer >= 0; None when absent. Whether the instance has that rank is its engine's
    to say (``LLMEngine.add_request``). Raises ``RequestError`` naming the input."""
    raw = pd_inputs.get("dp_rank")
    if raw is None:
        return None
    array = np.asarray(raw).reshape(-1)
    if array.size != 1 or not np.issubdtype(array.dtype, np.integer) or int(array[0]) < 0:
        raise RequestError("dp_rank", f"must be one integer >= 0 (a DP-attention rank of the instance), got "
                                      f"{array.tolist()[:4]}")
    return int(array[0])


def _resume_token_ids(pd_inputs: Mapping[str, np.ndarray], max_tokens: int) -> tuple[int, ...]:
    ids = _token_ids(pd_inputs, "resume_token_ids")
    if len(ids) >= max_tokens:
        raise RequestError("resume_token_ids", f"{len(ids)} tokens leave none of max_tokens {max_tokens}")
    return ids


def _token_ids(pd_inputs: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    """A non-empty 1-D integer input of ids >= 0; () when absent. Raises ``RequestError`` naming ``name``."""
    raw = pd_inputs.get(name)
    if raw is None:
        return ()
    array = np.asarray(raw)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise RequestError(name, f"must be a non-empty list of token ids, got shape {tuple(array.shape)} of "
                                 f"{array.dtype}")
    if int(array.min()) < 0:
        raise RequestError(name, "token ids must be >= 0")
    return tuple(int(t) for t in array)


def _optional_text(pd_inputs: Mapping[str, np.ndarray], name: str) -> str:
    raw = pd_inputs.get(name)
    if raw is None:
        return ""
    flat = np.asarray(raw).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"must hold one string, got shape {tuple(np.shape(raw))}")
    item = flat[0]
    try:
        return item.decode("utf-8") if isinstance(item, bytes) else str(item)
    except UnicodeDecodeError:
        raise RequestError(name, "must be UTF-8") from None
