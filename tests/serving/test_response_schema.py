"""``serving.schema`` is what every model declares: each ``model_repository/*/config.pbtxt`` holds exactly the
schema's outputs of its layout (name, data type, dims) and, for the client models, its ``return_*`` inputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from serving.schema import CHILD_MODELS, CHILD_OUTPUTS, CLIENT_MODELS, CLIENT_OUTPUTS, OUTPUTS, RETURN_FLAGS

ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r'name: "(\w+)", data_type: (TYPE_\w+)(?:, dims: \[ ([-\d, ]+) \])?')


def declared(model: str, section: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (data_type, dims)}`` of the ``input`` or ``output`` section of the model's config.pbtxt."""
    text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
    body = re.search(rf"^{section} \[(.*?)^\]", text, re.S | re.M)
    assert body is not None, (model, section)
    return {name: (data_type, tuple(int(d) for d in dims.split(","))) for name, data_type, dims
            in _ENTRY.findall(body.group(1))}


@pytest.mark.parametrize("model", CLIENT_MODELS)
def test_each_client_model_declares_the_client_layout_and_its_return_flags(model: str) -> None:
    want = {o.name: (o.client.data_type, o.client.dims) for o in CLIENT_OUTPUTS.values() if o.client}
    assert declared(model, "output") == want
    flags = {name for name in declared(model, "input") if name.startswith("return_")}
    assert flags == set(RETURN_FLAGS)


@pytest.mark.parametrize("model", CHILD_MODELS)
def test_each_child_model_declares_the_child_layout(model: str) -> None:
    want = {o.name: (o.child.data_type, o.child.dims) for o in CHILD_OUTPUTS.values() if o.child}
    assert declared(model, "output") == want


def test_every_row_is_in_a_layout_and_every_client_output_but_text_has_its_flag() -> None:
    assert all(o.models for o in OUTPUTS)
    assert [o.name for o in CLIENT_OUTPUTS.values() if o.return_flag is None] == ["text_output"]
    assert all(o.return_flag == f"return_{o.name}" for o in CLIENT_OUTPUTS.values() if o.return_flag)

