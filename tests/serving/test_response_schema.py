"""``serving.schema`` is what every model declares: no ``model_repository/*/config.pbtxt`` declares an output
or a ``return_*`` input; each ``model.py``'s ``auto_complete_config`` adds exactly the schema's outputs of its
layout (name, data type, dims) and, for the client models, its ``return_*`` inputs; ``initialize`` refuses a
config without them (a server under ``--disable-auto-complete-config``), naming that flag. The served configs
of a live server are checked in ``test_llm_api_live.py``."""

from __future__ import annotations

import copy
import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest

from serving.schema import (
    CHILD_MODELS,
    CHILD_OUTPUTS,
    CLIENT_MODELS,
    CLIENT_OUTPUTS,
    OUTPUTS,
    RETURN_FLAGS,
    config_outputs,
    undeclared,
)
from serving.triton.entry import UndeclaredOutputs, check_declared

ROOT = Path(__file__).resolve().parents[2]
_ENTRY = re.compile(r'name: "(\w+)", data_type: (TYPE_\w+)(?:, dims: \[ ([-\d, ]+) \])?')


def declared(model: str, section: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (data_type, dims)}`` of the ``input`` or ``output`` section of the model's config.pbtxt ({}
    when it has none)."""
    text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
    body = re.search(rf"^{section} \[(.*?)^\]", text, re.S | re.M)
    if body is None:
        return {}
    return {name: (data_type, tuple(int(d) for d in dims.split(","))) for name, data_type, dims
            in _ENTRY.findall(body.group(1))}


class FakeModelConfig:
    """python_backend's ``pb_utils.ModelConfig`` as ``auto_complete_config`` sees it: ``add_input`` and
    ``add_output`` append an entry, keep one of the same name, data type and dims, and raise ValueError for
    one of the same name with another data type or dims; ``as_dict`` is the config."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def _add(self, section: str, entry: dict[str, Any]) -> None:
        for current in self._config[section]:
            if current["name"] == entry["name"]:
                if (current["data_type"], current["dims"]) != (entry["data_type"], entry["dims"]):
                    raise ValueError(f"{section} {entry['name']!r}: the config declares it otherwise")
                return
        self._config[section].append(entry)

    def add_input(self, entry: dict[str, Any]) -> None:
        self._add("input", entry)

    def add_output(self, entry: dict[str, Any]) -> None:
        self._add("output", entry)

    def as_dict(self) -> dict[str, Any]:
        return self._config


def committed_config(model: str) -> dict[str, Any]:
    """The model's config.pbtxt as Triton hands it to ``auto_complete_config`` (name, inputs, outputs)."""
    return {"name": model, **{section: [{"name": n, "data_type": t, "dims": list(d)}
                                        for n, (t, d) in declared(model, section).items()]
                              for section in ("input", "output")}}


def auto_completed(model: str, config: Any = None) -> dict[str, Any]:
    """What ``model_repository/<model>/1/model.py``'s ``auto_complete_config`` makes of ``config`` (default: a
    ``FakeModelConfig`` of the committed config)."""
    namespace = runpy.run_path(str(ROOT / "model_repository" / model / "1" / "model.py"))
    config = config if config is not None else FakeModelConfig(committed_config(model))
    return namespace["TritonPythonModel"].auto_complete_config(config).as_dict()


def entries(config: dict[str, Any], section: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {e["name"]: (e["data_type"], tuple(e["dims"])) for e in config[section]}


@pytest.mark.parametrize("model", CLIENT_MODELS + CHILD_MODELS)
def test_no_config_declares_an_output_or_a_return_flag(model: str) -> None:
    """A new output is a schema row and no config edit."""
    assert declared(model, "output") == {}
    assert not [name for name in declared(model, "input") if name.startswith("return_")]


@pytest.mark.parametrize("model", CLIENT_MODELS)
def test_each_client_model_auto_completes_the_client_layout_and_its_return_flags(model: str) -> None:
    config = auto_completed(model)
    assert entries(config, "output") == {o.name: (o.client.data_type, o.client.dims)
                                         for o in CLIENT_OUTPUTS.values() if o.client}
    flags = {name: value for name, value in entries(config, "input").items() if name.startswith("return_")}
    assert flags == {flag: ("TYPE_BOOL", (1,)) for flag in RETURN_FLAGS}
    assert all(e["optional"] for e in config["input"] if e["name"].startswith("return_"))
    # the config's own inputs are kept as they were
    assert {k: v for k, v in entries(config, "input").items() if k not in flags} == declared(model, "input")
    check_declared(config, model)


@pytest.mark.parametrize("model", CHILD_MODELS)
def test_each_child_model_auto_completes_the_child_layout(model: str) -> None:
    config = auto_completed(model)
    assert entries(config, "output") == {o.name: (o.child.data_type, o.child.dims)
                                         for o in CHILD_OUTPUTS.values() if o.child}
    assert entries(config, "input") == declared(model, "input")
    check_declared(config, model)


def test_auto_complete_keeps_a_config_that_already_declares_the_schema() -> None:
    """A config rendered complete (or a reload's config, read back from a server) completes to itself."""
    config = auto_completed("pd_ensemble")
    again = auto_completed("pd_ensemble", FakeModelConfig(copy.deepcopy(config)))
    assert again == config


def test_auto_complete_through_the_python_backends_own_model_config() -> None:
    """The same through ``pb_utils.ModelConfig`` of the installed python backend (its ``add_*`` rules)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("nvidia-pytriton is not installed: run scripts/setup.sh")
    path = Path(next(iter(spec.submodule_search_locations))) / "tritonserver/backends/python"
    pb_utils = runpy.run_path(str(path / "triton_python_backend_utils.py"))
    for model in CLIENT_MODELS + CHILD_MODELS:
        real = pb_utils["ModelConfig"](json.dumps({**committed_config(model), "max_batch_size": 0}))
        assert entries(auto_completed(model, real), "output") == entries(auto_completed(model), "output")


@pytest.mark.parametrize("model", CLIENT_MODELS + CHILD_MODELS)
def test_a_rendered_complete_config_declares_what_auto_complete_does(model: str) -> None:
    """``scripts/perf/server.py``'s ``complete_config`` (``serving.schema.config_pbtxt`` appended: what the
    test servers run under ``--disable-auto-complete-config``) parses as Triton's ModelConfig to the committed
    config plus exactly what auto-complete adds."""
    import sys

    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from perf.server import complete_config
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    text = complete_config((ROOT / "model_repository" / model / "config.pbtxt").read_text(), model)
    parsed = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                       preserving_proto_field_name=True)
    for section in ("input", "output"):
        for e in parsed[section]:
            e["dims"] = [int(d) for d in e["dims"]]
        assert entries(parsed, section) == entries(auto_completed(model), section), section
    check_declared(parsed, model)
    assert complete_config(text, model) == text   # complete already: left as it is


def test_a_config_without_the_schema_fails_initialize_naming_the_flag() -> None:
    """What a server started with ``--disable-auto-complete-config`` hands ``initialize``."""
    for model in CLIENT_MODELS + CHILD_MODELS:
        with pytest.raises(UndeclaredOutputs, match="--disable-auto-complete-config") as failure:
            check_declared(committed_config(model), model)
        assert "text_output" in str(failure.value)
    config = auto_completed("decode")
    config["output"] = [e for e in config["output"] if e["name"] != "error_kind"]
    assert undeclared(config, "decode") == ["error_kind"]
    config["output"].append({"name": "error_kind", "data_type": "TYPE_STRING", "dims": [-1]})
    assert undeclared(config, "decode") == ["error_kind"]   # another type is not the schema's


def test_every_row_is_in_a_layout_and_every_client_output_but_text_has_its_flag() -> None:
    assert all(o.models for o in OUTPUTS)
    assert [o.name for o in CLIENT_OUTPUTS.values() if o.return_flag is None] == ["text_output"]
    assert all(o.return_flag == f"return_{o.name}" for o in CLIENT_OUTPUTS.values() if o.return_flag)
    assert all(o.description for o in OUTPUTS)


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model role"):
        config_outputs("prefill_1")
