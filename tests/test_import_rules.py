"""The import rules of docs/architecture.md ("Import rules"), checked on the source: every ``import`` and
``from ... import`` of every module, function-level ones included.

Packages: ``engine`` imports no other project package; ``bootstrap`` none; ``kv_transfer`` only ``bootstrap``;
``serving`` never ``frontend``; ``frontend`` of ``serving`` only ``serving.schema``, which imports nothing but
the standard library. Inside ``serving``, ``LAYERS`` ranks every module: a module imports its own group or
groups of a lower rank, never a higher rank nor another group of its rank (``workers`` and ``router`` are
siblings).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("engine", "kv_transfer", "bootstrap", "serving", "frontend")
#: project packages each package may import (besides itself)
PACKAGES: dict[str, frozenset[str]] = {
    "engine": frozenset(),
    "bootstrap": frozenset(),
    "kv_transfer": frozenset({"bootstrap"}),
    "serving": frozenset({"engine", "kv_transfer", "bootstrap"}),
    "frontend": frozenset({"engine", "serving.schema"}),
}
#: (rank, group, module prefix) inside serving, bottom first; a module's is its longest matching prefix's
LAYERS: tuple[tuple[int, str, str], ...] = (
    (0, "init", "serving"),   # the package's __init__ (a docstring)
    (0, "schema", "serving.schema"),
    (1, "delta", "serving.delta"), (1, "events", "serving.events"),
    (2, "child", "serving.child"),
    # Triton's gRPC client side (no pb_utils): the router and the config layer use them
    (2, "triton-client", "serving.triton.grpc_tls"), (2, "triton-client", "serving.triton.control_client"),
    (2, "triton-client", "serving.triton.admin_access"),
    (3, "parsing", "serving.parsing"),
    (4, "stream", "serving.stream"), (4, "metrics", "serving.metrics"), (4, "config", "serving.config"),
    (5, "answering", "serving.answering"),
    (6, "workers", "serving.workers"), (6, "router", "serving.router"),
    # the python-backend glue and the router's Triton model: the top
    (7, "triton", "serving.triton"), (7, "triton", "serving.router.triton_model"),
)


def group_of(module: str) -> tuple[int, str]:
    """(rank, group) of a serving module: those of its longest prefix in ``LAYERS``."""
    matches = (layer for layer in LAYERS if module == layer[2] or module.startswith(layer[2] + "."))
    rank, group, _ = max(matches, key=lambda layer: len(layer[2]))
    return rank, group


def imports_of(source: str) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def violations(module: str, source: str) -> list[str]:
    """What ``module`` (dotted name) with ``source`` imports against the rules, one line each."""
    package = module.split(".")[0]
    bad = []
    for line, target in imports_of(source):
        top = target.split(".")[0]
        if module == "serving.schema":
            if top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{module}:{line} imports {target}: the schema is standard library only")
            continue
        if top not in PROJECT or top == package and package != "serving":
            continue
        if top != package:
            allowed = PACKAGES[package]
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                bad.append(f"{module}:{line} imports {target}: {package} may import {sorted(allowed)}")
            continue
        rank, group = group_of(module)
        target_rank, target_group = group_of(_module_part(target))
        if target_group != group and target_rank >= rank:
            bad.append(f"{module}:{line} imports {target} ({target_group}, rank {target_rank}) from {group} "
                       f"(rank {rank}): uphill or sideways")
    return bad


def _module_part(target: str) -> str:
    """``serving.x.y.Name`` → the serving module it names (the longest existing module path)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return target


def project_modules() -> list[tuple[str, Path]]:
    modules = []
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


def test_no_module_imports_against_the_rules() -> None:
    bad = [v for module, path in project_modules() for v in violations(module, path.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("module", "source"), [
    ("serving.delta", "from serving.stream import GenerationStream"),
    ("serving.child.codec", "def f():\n    from serving.triton.io import response_arrays"),
    ("serving.router.service", "from serving.workers.colocated import ColocatedWorker"),
    ("serving.metrics", "import serving.workers.engine_loop"),
    ("kv_transfer.manager", "from serving.config import WorkerConfig"),
    ("engine.scheduler", "from kv_transfer import KVPoll"),
    ("frontend.wire", "from serving.delta import Delta"),
    ("serving.schema", "import numpy"),
])
def test_an_uphill_or_sideways_import_fails(module: str, source: str) -> None:
    assert violations(module, source)


def test_downhill_imports_pass() -> None:
    assert not violations("serving.workers.prefill",
                          "from serving.stream import GenerationStream\nimport numpy")
    assert not violations("frontend.wire", "from serving.schema import OUTPUTS")
    assert not violations("kv_transfer.manager", "from bootstrap.client import ClientPool")
