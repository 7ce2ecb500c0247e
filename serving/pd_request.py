"""The extra inputs of the prefill and decode models: the bootstrap room and the paired prefill instance.

``pd_ensemble`` sends each child request the client's LLM-convention inputs (``text_input``,
``sampling_parameters``, ``apply_chat_template``) plus:

=====================  =======  ==============================================================================
``bootstrap_room``     INT64    the room both halves of the request meet in, ``0 <= room < 2**63``
``prefill_instance``   STRING   decode only: the instance id of the prefill instance that computes the KV (as
                                registered at the bootstrap service); empty or absent: **direct decode**, the
                                decode instance prefills the prompt itself and streams every token
``router_id``          STRING   optional: the lease id of the router that sent the request; when that lease
                                ends (the router died or stopped), the worker drops the request
=====================  =======  ==============================================================================

Children always stream: prefill answers with the first token, then FINAL once its KV has been sent; decode
answers with one response per text delta of the tokens after the first one (direct decode: from the first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from serving.request import GenerateRequest, RequestError, parse_request

Room = int
MAX_ROOM = 2**63 - 1
PD_INPUT_NAMES: tuple[str, ...] = ("bootstrap_room", "prefill_instance", "router_id")


@dataclass(frozen=True)
class PDRequest:
    """One half of a disaggregated request.

    Attributes:
        request: the client's request (always treated as streaming, the prompt never echoed).
        room: the bootstrap room.
        prefill_instance: decode only: which prefill instance writes this room's KV; empty: direct decode.
        router_id: lease id of the sending router (empty: none named).
    """

    request: GenerateRequest
    room: Room
    prefill_instance: str = ""
    router_id: str = ""

    @property
    def direct(self) -> bool:
        """Decode only: no prefill instance, the decode engine prefills the prompt itself."""
        return not self.prefill_instance


def parse_pd_request(llm_inputs: Mapping[str, bytes | str | bool], pd_inputs: Mapping[str, np.ndarray]) -> PDRequest:
    """Validate a child request.

    Args:
        llm_inputs: the LLM-convention inputs (``triton_io.read_inputs``).
        pd_inputs: ``bootstrap_room`` (int64, one element), ``router_id`` (bytes, optional) and, for decode,
            ``prefill_instance`` (bytes; empty or absent: direct decode).
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
    return PDRequest(request=request, room=room, prefill_instance=_optional_text(pd_inputs, "prefill_instance"),
                     router_id=_optional_text(pd_inputs, "router_id"))


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
