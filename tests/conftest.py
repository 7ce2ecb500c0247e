"""Suite-wide hooks: the session starts only when every piece ``scripts/setup.sh`` provides is there
(``scripts/prereqs.py``; a missing one fails the run at once, naming it and its package, instead of turning
into skips: ``PD_TESTS_ALLOW_MISSING=1`` runs anyway, for a partial run on a machine set up by hand); a failed
test's report ends with the log tail of every ``scripts/serve.sh`` server the test
session has running (``perf.server.started_servers``), so that a live failure in CI, where the server logs are
gone with the temp dirs, shows what each server said last (a server that exited, a port it could not bind)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

LOG_LINES = 30
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def pytest_sessionstart(session: pytest.Session) -> None:
    import prereqs

    lacking = prereqs.missing()
    if lacking and os.environ.get("PD_TESTS_ALLOW_MISSING") != "1":
        pytest.exit("this machine lacks what scripts/setup.sh installs (run it as root; or set "
                    "PD_TESTS_ALLOW_MISSING=1 to run what can run, the rest skipping):\n"
                    + prereqs.report(lacking), returncode=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    server_module = sys.modules.get("perf.server")
    if not report.failed or server_module is None:
        return
    for server in server_module.started_servers():
        try:
            lines = server.log_tail(16000).splitlines()[-LOG_LINES:]
        except OSError as exc:
            lines = [f"(log unreadable: {exc})"]
        report.sections.append((f"serve.sh log {server.log_path.name} (last {LOG_LINES} lines)",
                                "\n".join(lines)))
