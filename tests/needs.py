"""What a test needs that is not here: a skip that names it, or, in CI, a
failure.

CI (``CI=true``, which .ci/run exports, as GitHub Actions and GitLab do)
installs everything the suites need (.ci/run): there, a suite that cannot
run is coverage lost without a word, so ``missing`` fails the test instead
of skipping it. What CI cannot have (a GPU, RDMA hardware, an opt-in) is
skipped everywhere with ``pytest.skip`` directly.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """True where ``CI`` is set to a true value (true, 1, yes)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> None:
    """This test cannot run here, for ``reason`` (which says what to
    install or do): skips it, or in CI fails it."""
    if in_ci():
        pytest.fail(
            f"CI=true and a suite CI must run cannot: {reason} (.ci/run installs what the suites need)", pytrace=False
        )
    pytest.skip(reason)


def require_core(cwd) -> None:
    """jax_arx with its C++ module imports in a fresh interpreter (outside
    the source tree, from ``cwd``), else ``missing``."""
    import launched

    reason = launched.core_is_installed(cwd)
    if reason:
        missing(reason)
