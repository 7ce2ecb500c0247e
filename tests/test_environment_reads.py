"""Environment variables are read in few, named places (docs/architecture.md, "Configuration"): the config
layer (``serving/config.py``), the command lines' entry points, ``kv_transfer/network.py`` (the transport
libraries' own ``UCX_*``/``MC_*``, which those libraries read themselves), and two of the engine's (its model
cache root's default, and the environment a tensor-parallel rank process inherits). Everything else gets
values."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kv_transfer", "bootstrap", "serving", "frontend", "model_repository")
#: the modules that may touch ``os.environ`` / ``os.getenv``, and why
ALLOWED = {
    "serving/config.py": "the config layer",
    "serving/triton/admin_access.py": "its command line (main)",
    "bootstrap/auth.py": "its command line (main)",
    "bootstrap/membership/__main__.py": "the registry's command line",
    "kv_transfer/network.py": "the transport libraries' own variables",
    "engine/model/loader.py": "default_cache_root: TRITON_PD_CACHE when no cache_dir is passed",
    "engine/parallel/group.py": "a rank process inherits the environment",
}


def reads_environment(source: str) -> list[int]:
    """Lines of ``source`` that touch ``os.environ`` or call ``os.getenv`` (or import either from ``os``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_named_modules_read_the_environment() -> None:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            lines = reads_environment(path.read_text())
            if lines and name not in ALLOWED:
                found[name] = lines
    assert not found, f"environment read outside the config layer: {found}"


def test_the_check_sees_each_form() -> None:
    assert reads_environment("import os\nx = os.environ.get('A')")
    assert reads_environment("import os\nx = os.getenv('A')")
    assert reads_environment("from os import environ")
    assert not reads_environment("import os\nx = os.getpid()")
