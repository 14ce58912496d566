"""Shared pytest hooks.

The tiers: ``pytest tests`` runs the fast tier, every test not marked with
one of ``SLOW_SUITES`` (the unit tests, the multi-process tests of every
op, carrier and topology at worlds 2 and 3, the docs' checks, the launcher,
the failure cases that take seconds). The slow suites run where a marker
expression or a test's node id asks for them (``pytest -m tsan tests``,
``pytest tests/test_verbs.py::test_psum_soft_roce``); each is a named step
of ``.ci/run`` (docs/development.md lists them).

``summary_line`` lets a test put a line into pytest's terminal summary, which
is printed even under ``-q`` and with output captured: CI logs show there
what a long test that ran elsewhere (the soft-RoCE VM) actually did. The
line travels in the test's report, so it reaches the summary also from a
pytest-xdist worker (``-n auto``: one worker more than the cores, below).
``core_built``: jax_arx is installed with its C++ module (the multi-process
tests run it from outside the source tree); skipped where it is not, failed
in CI (tests/needs.py).

The tests that run in this process import jax_arx from the source tree when
pytest runs from its root (``python -m pytest`` puts the working directory
first on sys.path), where the C++ module is not built: it is in the
installed package (``pip install .``). ``jax_arx._core`` is found there, so
those tests run the tree's Python with the installed core.
"""

import importlib.util
import os
import pathlib
import sys

import pytest

import needs


def _installed_core_for_the_source_tree() -> None:
    if "jax_arx" in sys.modules:
        return
    spec = importlib.util.find_spec("jax_arx")
    if spec is None or spec.origin is None:
        return
    here = pathlib.Path(spec.origin).parent.resolve()
    if any(here.glob("_core*.so")):
        return
    for entry in sys.path:
        there = (pathlib.Path(entry or ".") / "jax_arx").resolve()
        if there != here and any(there.glob("_core*.so")):
            # Imported here with both folders on its path from the start:
            # jax_arx's own import already looks for its C++ module.
            spec.submodule_search_locations.append(str(there))
            module = importlib.util.module_from_spec(spec)
            sys.modules["jax_arx"] = module
            spec.loader.exec_module(module)
            return


_installed_core_for_the_source_tree()

# The in-process tests' stand-in core and fixtures (and this process's jax
# on 4 CPU devices, set before any test starts it).
pytest_plugins = ["stand_in_core"]

_SUMMARY: list[str] = []
_SUMMARY_KEY = "jax_arx_summary"

# The slow suites: each marker is one step of .ci/run (pyproject.toml says
# what each holds). "slow" is the rest: tests of minutes that no other
# suite holds.
SLOW_SUITES = ("slow", "tsan", "aarch64", "verbs", "netns", "soak")
_deselected_slow: list[int] = []


def _fast_tier(config) -> bool:
    return not config.option.markexpr and not any("::" in str(a) for a in config.args)


def pytest_collection_modifyitems(config, items):
    """The fast tier: without ``-m`` and without a node id naming a test,
    the slow suites' tests are deselected (counted in the summary)."""
    if not _fast_tier(config):
        return
    keep, slow = [], []
    for item in items:
        (slow if any(item.get_closest_marker(m) for m in SLOW_SUITES) else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
        _deselected_slow.append(len(slow))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores. The multi-process tests
    spend much of their time waiting (a peer's start, a timeout they
    provoke), and a third worker on 2 cores fills it: the fast tier took
    347 s with ``-n 3`` against 480 s in one process (docs/development.md)."""
    return (os.cpu_count() or 1) + 1


@pytest.fixture
def summary_line(request):
    """Call it with a line to show at the end of the test run."""
    return lambda line: request.node.user_properties.append((_SUMMARY_KEY, line))


def pytest_runtest_logreport(report):
    # The teardown report carries every line the test added; under xdist it
    # is the one copy of them that reaches this (the controlling) process.
    if report.when == "teardown":
        _SUMMARY.extend(value for key, value in report.user_properties if key == _SUMMARY_KEY)


@pytest.fixture(scope="session")
def core_built(tmp_path_factory):
    needs.require_core(tmp_path_factory.mktemp("probe"))


def pytest_terminal_summary(terminalreporter, config):
    if _fast_tier(config) and not hasattr(config, "workerinput"):
        # Under xdist the workers collect, so the count is theirs alone.
        count = (
            f"{_deselected_slow[0]} tests of the slow suites were"
            if _deselected_slow
            else "the slow suites' tests were"
        )
        terminalreporter.write_line(
            f"jax_arx: the fast tier; {count} not run "
            f"(pytest -m 'slow or tsan or aarch64 or verbs or netns or soak' tests runs them; "
            f"docs/development.md)"
        )
    if _SUMMARY:
        terminalreporter.section("jax_arx: what the long tests did")
        for line in _SUMMARY:
            terminalreporter.write_line(line)
