"""scripts/prereqs.py and scripts/setup.sh name the same system packages: the apt packages the requirements
say provide them are the ones set-up installs, and what set-up checks before the venv (``--system``) is
exactly what apt provides."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import prereqs  # noqa: E402


def _setup_packages() -> set[str]:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    match = re.search(r"^SYSTEM_PACKAGES=\(([^)]*)\)", setup, re.MULTILINE)
    assert match, "scripts/setup.sh has no SYSTEM_PACKAGES=(...)"
    return set(match.group(1).split()) | {f"libpython{prereqs.PY}"}   # appended in install_system_libs


def _apt_packages(requirement: prereqs.Requirement) -> set[str]:
    if not requirement.provider.startswith("apt: "):
        return set()
    return set(requirement.provider.removeprefix("apt: ").split())


def test_the_apt_packages_the_requirements_name_are_the_ones_setup_installs() -> None:
    named = set().union(*(_apt_packages(r) for r in prereqs.REQUIREMENTS))
    installed = _setup_packages()
    assert named, "no requirement names an apt package"
    assert named <= installed, f"named, but setup.sh does not install them: {sorted(named - installed)}"
    assert installed <= named, f"installed by setup.sh, checked by none: {sorted(installed - named)}"


def test_the_system_requirements_are_the_ones_apt_provides() -> None:
    for requirement in prereqs.REQUIREMENTS:
        assert requirement.system == bool(_apt_packages(requirement)), requirement.what


def test_main_takes_only_system_as_an_argument() -> None:
    assert prereqs.main(["--bogus"]) == 2
