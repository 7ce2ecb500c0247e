"""Facts the README and docs state that the code decides: each is read from both and compared, so that a
change to one without the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sentence(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[begin:text.index(end, begin)]


def test_the_variables_the_readme_says_serve_sh_sets_are_the_ones_it_exports() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())   # lines reflowed freely
    serve = (ROOT / "scripts" / "serve.sh").read_text()
    claimed = set(re.findall(r"`([A-Z][A-Z0-9_]+)=", _sentence(readme, "It sets `", "puts the venv first")))
    exported = set(re.findall(r"export ([A-Z][A-Z0-9_]+)=", serve))
    assert claimed, "the README no longer says which variables serve.sh sets"
    assert claimed <= exported, f"README claims serve.sh sets {sorted(claimed - exported)}, which it does not"
    always = {"PATH", "PYTHONPATH", "PYTHONUNBUFFERED"}
    top_level = set(re.findall(r"^(?:if .*then )?export ([A-Z][A-Z0-9_]+)=", serve, re.MULTILINE)) - always
    assert top_level <= claimed, \
        f"serve.sh exports {sorted(top_level - claimed)}, which the README does not say"


def test_the_protocol_doc_names_the_envelope_version_the_code_sends() -> None:
    from bootstrap.messages import PROTOCOL_VERSION

    protocol = (ROOT / "docs" / "protocol.md").read_text()
    assert f'envelope `{{"version": {PROTOCOL_VERSION},' in protocol

