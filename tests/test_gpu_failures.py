"""tests/test_failures_cpu.py's suites on 2 processes with one GPU each: a
stranger who read the rendezvous store gets no tcp stream; a stopped peer
makes a 96 MiB psum (the proxy sends it on GPUs) and an 80 MiB all_gather
fail, and shutdown() return, within about the timeout; a rank SIGKILLed in
initialize(), and ranks that os._exit after a failed one, leave nothing in
/dev/shm. Marked ``gpu`` and skipped without 2 NVIDIA GPUs or without a
jax_arx built with CUDA (tests/test_gpu_psum.py's detection). Run::

    pip install --no-build-isolation . && python -m pytest -m gpu tests/test_gpu_failures.py -v
"""

from __future__ import annotations

import pytest

import test_failures_cpu as suites
from test_gpu_prefill import two_gpus  # noqa: F401  (the fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("user_secret", [False, True], ids=["no-JAX_ARX_SECRET", "JAX_ARX_SECRET"])
def test_a_stranger_with_the_store_gets_no_stream(two_gpus, tmp_path, user_secret):  # noqa: F811
    suites.check_stranger(tmp_path, user_secret, gpu=True)


@pytest.mark.parametrize("op", ["psum", "all_gather"])
def test_a_stopped_peer_fails_the_call_and_shutdown_within_the_timeout(two_gpus, tmp_path, op):  # noqa: F811
    suites.check_stopped_peer(tmp_path, op, gpu=True)


@pytest.mark.parametrize("suite", ["killed_in_initialize", "failed_initialize"])
def test_no_shared_memory_left_after_failed_set_ups(two_gpus, tmp_path, suite):  # noqa: F811
    suites.check_no_shared_memory_left(tmp_path, suite, gpu=True)
