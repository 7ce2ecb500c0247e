"""Suite-wide hooks: a failed test's report ends with the log tail of every ``scripts/serve.sh`` server the test
session has running (``perf.server.started_servers``), so that a live failure in CI, where the server logs are
gone with the temp dirs, shows what each server said last (a server that exited, a port it could not bind)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

LOG_LINES = 30


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
        report.sections.append((f"serve.sh log {server.log_path.name} (last {LOG_LINES} lines)", "\n".join(lines)))
