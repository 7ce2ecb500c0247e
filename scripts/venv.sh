# Sourced by scripts/setup.sh and scripts/install_perf_tools.sh.
#
# new_venv PYTHON VENV: makes the venv VENV with PYTHON, pip in it. Debian/Ubuntu without python3-venv have
# no ensurepip: then a bare venv (--without-pip) gets pip from the host's pip, as a wheel that the venv's
# Python runs (any host pip; `pip --python` would need pip >= 22.3, and Ubuntu 22.04 has 22.0.2). Neither
# ensurepip nor a host pip: says so and returns 1.
new_venv() {
  local python=$1 venv=$2 tmp wheel
  if "$python" -c 'import ensurepip' 2>/dev/null; then
    "$python" -m venv "$venv"
    return
  fi
  if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "$python has neither ensurepip (apt: python3-venv) nor pip (apt: python3-pip): install one" >&2
    return 1
  fi
  echo "no ensurepip for $python (apt: python3-venv): a venv without pip, seeded from the host pip" >&2
  "$python" -m venv --without-pip "$venv"
  tmp="$(mktemp -d)"
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$tmp" pip
  wheel="$(ls "$tmp"/pip-*.whl)"
  "$venv/bin/python" "$wheel/pip" install --quiet --disable-pip-version-check --no-index "$wheel"
  rm -rf "$tmp"
}
