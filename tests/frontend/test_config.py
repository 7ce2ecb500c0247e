"""The front's configuration is validated where it is built; the command line maps onto it one to one."""

from __future__ import annotations

import pytest

from frontend.__main__ import parse_config
from frontend.config import FrontendConfig


@pytest.mark.parametrize("bad",
                         [{"port": 70000}, {"model": ""}, {"grpc_url": "nohost"}, {"default_max_tokens": 0},
                          {"grpc_keepalive_s": -1.0}])
def test_bad_values_fail_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FrontendConfig(**bad)  # type: ignore[arg-type]


def test_command_line_and_defaults() -> None:
    config, level = parse_config(["--port", "9100", "--grpc-url", "10.0.0.2:8001", "--model", "colocated",
                                  "--served-model-name", "smol", "--default-max-tokens", "64"])
    assert (config.port, config.grpc_url, config.model, config.public_name, config.default_max_tokens) == \
        (9100, "10.0.0.2:8001", "colocated", "smol", 64)
    assert config.grpc_keepalive_s == 0.0 and level == "info"   # no keepalive pings unless asked
    assert FrontendConfig(model="pd_ensemble").public_name == "pd_ensemble"
