"""``serving.triton_io``: numpy halves of the tensor conversions (the pb_utils halves run in the live test)."""

from __future__ import annotations

import numpy as np
import pytest

from serving.request import RequestError, parse_request
from serving.stream import ResponseChunk
from serving.triton_io import response_arrays, scalars_from_arrays


def test_inputs_as_triton_hands_them_over() -> None:
    arrays = {
        "text_input": np.array([b"Hello"], dtype=np.object_),
        "stream": np.array([True]),
        "sampling_parameters": np.array([[b'{"max_tokens": "4"}']], dtype=np.object_),
        "exclude_input_in_output": np.array([np.bool_(True)]),
    }
    values = scalars_from_arrays(arrays)
    assert values == {"text_input": b"Hello", "stream": True, "sampling_parameters": b'{"max_tokens": "4"}',
                      "exclude_input_in_output": True}
    assert type(values["stream"]) is bool
    req = parse_request(values)
    assert req.stream and req.params.max_tokens == 4


@pytest.mark.parametrize("arrays, field", [
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input"),
    ({"text_input": np.array([], dtype=np.object_)}, "text_input"),
    ({"stream": np.array([1.5])}, "stream"),
])
def test_bad_tensors_name_the_input(arrays: dict[str, np.ndarray], field: str) -> None:
    with pytest.raises(RequestError) as info:
        scalars_from_arrays(arrays)
    assert info.value.field == field


def test_response_arrays_types() -> None:
    arrays = response_arrays(ResponseChunk("héllo", "stop", 7, 3))
    assert arrays["text_output"].dtype == np.object_ and arrays["text_output"][0].decode() == "héllo"
    assert arrays["finish_reason"][0] == b"stop"
    assert arrays["num_input_tokens"].dtype == np.int32 and arrays["num_input_tokens"].tolist() == [7]
    assert arrays["num_output_tokens"].tolist() == [3]
    assert response_arrays(ResponseChunk("x"))["finish_reason"][0] == b""
