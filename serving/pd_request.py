"""The extra inputs of the prefill and decode models: the bootstrap room and the paired prefill instance.

``pd_ensemble`` sends each child request the client's LLM-convention inputs (``text_input``,
``sampling_parameters``, ``apply_chat_template``) plus:

=====================  =======  ==============================================================================
``bootstrap_room``     INT64    the room both halves of the request meet in, ``0 <= room < 2**63``
``prefill_instance``   STRING   decode only: the id of the prefill instance that computes the KV (the name of
                                the prefill model; see docs/architecture.md, "Pairing")
=====================  =======  ==============================================================================

Children always stream: prefill answers with the first token, then FINAL once its KV has been sent; decode
answers with one response per text delta of the tokens after the first one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from serving.request import GenerateRequest, RequestError, parse_request

Room = int
MAX_ROOM = 2**63 - 1
PD_INPUT_NAMES: tuple[str, ...] = ("bootstrap_room", "prefill_instance")


@dataclass(frozen=True)
class PDRequest:
    """One half of a disaggregated request.

    Attributes:
        request: the client's request (always treated as streaming, the prompt never echoed).
        room: the bootstrap room.
        prefill_instance: decode only: which prefill instance writes this room's KV.
    """

    request: GenerateRequest
    room: Room
    prefill_instance: str = ""


def parse_pd_request(llm_inputs: Mapping[str, bytes | str | bool], pd_inputs: Mapping[str, np.ndarray],
                     need_prefill_instance: bool) -> PDRequest:
    """Validate a child request.

    Args:
        llm_inputs: the LLM-convention inputs (``triton_io.read_inputs``).
        pd_inputs: ``bootstrap_room`` (int64, one element) and, for decode, ``prefill_instance`` (bytes).
        need_prefill_instance: True on the decode side.
    Raises:
        RequestError: naming the offending input.
    """
    request = replace(parse_request(llm_inputs), stream=True, exclude_input_in_output=True)
    if "bootstrap_room" not in pd_inputs:
        raise RequestError("bootstrap_room", "is required (send requests to pd_ensemble, which allocates it)")
    room_array = np.asarray(pd_inputs["bootstrap_room"]).reshape(-1)
    if room_array.size != 1 or not np.issubdtype(room_array.dtype, np.integer):
        raise RequestError("bootstrap_room", "must be one integer")
    room = int(room_array[0])
    if not 0 <= room <= MAX_ROOM:
        raise RequestError("bootstrap_room", f"must be a 63-bit id, got {room}")
    prefill_instance = ""
    if need_prefill_instance:
        raw = pd_inputs.get("prefill_instance")
        flat = np.asarray(raw).reshape(-1) if raw is not None else np.array([])
        if flat.size != 1:
            raise RequestError("prefill_instance", "is required on the decode side")
        item = flat[0]
        prefill_instance = item.decode("utf-8") if isinstance(item, bytes) else str(item)
        if not prefill_instance:
            raise RequestError("prefill_instance", "must not be empty")
    return PDRequest(request=request, room=room, prefill_instance=prefill_instance)
