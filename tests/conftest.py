"""Shared pytest hooks.

``summary_line`` lets a test put a line into pytest's terminal summary, which
is printed even under ``-q`` and with output captured: CI logs show there
what a long test that ran elsewhere (the soft-RoCE VM) actually did.
"""

import pytest

_SUMMARY: list[str] = []


@pytest.fixture
def summary_line():
    """Call it with a line to show at the end of the test run."""
    return _SUMMARY.append


def pytest_terminal_summary(terminalreporter):
    if _SUMMARY:
        terminalreporter.section("jax_arx: what the long tests did")
        for line in _SUMMARY:
            terminalreporter.write_line(line)
