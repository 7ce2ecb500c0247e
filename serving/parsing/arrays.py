"""Input arrays (numpy, as a Triton request or a worker's own endpoint hands them over) → the Python scalars
``serving.parsing.request`` parses. numpy only: no ``pb_utils``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from serving.parsing.request import RawValue, RequestError


def scalars_from_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, RawValue]:
    """One Python scalar per input array: ``bytes``/``str`` stay as they are, ``np.bool_`` becomes ``bool``.

    Raises:
        RequestError: naming an input that holds other than exactly one element, or one of another type.
    """
    values: dict[str, RawValue] = {}
    for name, array in arrays.items():
        flat = np.asarray(array).reshape(-1)
        if flat.size != 1:
            raise RequestError(name, f"must hold exactly one element, got shape {tuple(np.shape(array))}")
        item = flat[0]
        if isinstance(item, (bool, np.bool_)):
            values[name] = bool(item)
        elif isinstance(item, (bytes, np.bytes_)):
            values[name] = bytes(item)
        elif isinstance(item, (str, np.str_)):
            values[name] = str(item)
        else:
            raise RequestError(name, f"must be a string or a bool, got {type(item).__name__}")
    return values
