"""jax_arx.all_gather, jax_arx.psum_scatter and jax_arx.moe_combine_psum_scatter
on the CPU backend, with the real C++ core, across processes.

Each test launches tests/bulk_cases.py as a worker under ``python -m
jax_arx.launch`` (``--worker SUITE``): every rank builds a 1-D mesh over all
devices, runs a suite of cases (many per launch: a launch costs seconds),
and prints one ``RESULT {json}`` line. Results are compared bit for bit
with references computed with numpy (and ml_dtypes), independently of jax
and of jax_arx (tests/bulk_reference.py says what each is). The MoE cases'
weights and scales have full float32 precision (some are 0); the fused op
must also equal ``jax_arx.psum_scatter(jax_arx.moe_combine(...))`` bit for
bit.

No reference uses a collective of jax's own (gloo on the CPU gives up its
waits after a fixed time, which a loaded machine reaches); where a fallback
runs one, the program is compiled first and started together everywhere.

- ``full`` (2 processes over shm, 3 over tcp): first, nothing for the bulk
  collectives before the first (the endpoints initialize() made hold no
  bulk lanes, and over shm this process maps nothing else in /dev/shm),
  psum runs, then the first all_gather makes their endpoints and runs; every
  dtype all_gather takes,
  axes 0, 1, 2 and -1, tiled and stacked, element counts that do not divide
  into the 8 pieces; psum_scatter in float32, bfloat16 and float16 over
  every dimension, tiled and not; sizes at and past the prefill slot
  (``JAX_ARX_PREFILL_SLOT_BYTES=256K`` here; past it: jax.lax); all three
  interleaved with psum in one program of independent calls, many times;
  3000 dependent calls in a ``jax.lax.fori_loop``; 200 back-to-back jitted
  calls; ``jax.grad`` against ``jax.grad`` of the same function written
  without collectives on one device; the fused MoE combine with bfloat16
  and e4m3 ``y``, topk 1 to 16, T not a multiple of the world, against the
  numpy reference.
- ``quick`` (3 processes over shm, 2 over tcp, 4 over shm and tcp, and 2
  processes with 2 CPU devices each): a subset, the first use included.
- ``moe_plan`` (2 processes over shm and over tcp,
  ``JAX_ARX_FALLBACK=error``): by default the plan steps aside for the
  fused combine's unfused pair: the program holds jax_arx's psum_scatter
  and no fused call, ``stats()["plans"]`` counts every call traced under a
  reason that names the route, docs/performance.md and the same bits, no
  fallback is counted, logged or raised, and every result equals, bit for
  bit, the numpy reference and the fused kernel's (the ``moe_fused``
  tuning, run first in the same processes). The other suites run the MoE
  cases with that tuning: the fused kernel itself.
- ``failures`` (2 processes, ``JAX_ARX_TIMEOUT_S=3``): ranks that trace
  different programs (rank 0 its first all_gather, which sets up the bulk
  endpoints on every process, rank 1 a psum) both fail within the timeout,
  rank 0 naming the process it waited for; ranks that issue different
  prefill ops get an error, never a result; a peer that never calls makes
  the call fail within the timeout, naming it.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise (failed in CI: tests/needs.py). The worker suites do not depend on the backend:
tests/test_gpu_bulk.py runs most of them on GPUs.
"""

from __future__ import annotations

import os

import pytest

import launched
from bulk_cases import FULL_CASES, PREFILL_SLOT_BYTES, QUICK_CASES

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bulk_cases.py")


# --- the tests ----------------------------------------------------------------


# The full suite over tcp at 3 ranks is the slow suite's; the fast tier has
# tcp at 3 ranks through the quick suite.
@pytest.mark.parametrize("transport,nprocs", [("shm", 2), pytest.param("tcp", 3, marks=pytest.mark.slow)])
def test_full_suite(core_built, tmp_path, transport, nprocs):
    results = _run("full", nprocs, transport, tmp_path)
    launched.assert_all_correct(results, expect=FULL_CASES)


# Four processes on two cores are a slow suite's; the fast tier stops at three.
@pytest.mark.parametrize(
    "transport,nprocs",
    [
        ("shm", 3),
        ("tcp", 2),
        ("tcp", 3),
        pytest.param("shm", 4, marks=pytest.mark.slow),
        pytest.param("tcp", 4, marks=pytest.mark.slow),
    ],
)
def test_quick_suite(core_built, tmp_path, transport, nprocs):
    results = _run("quick", nprocs, transport, tmp_path)
    launched.assert_all_correct(results, expect=QUICK_CASES)


def test_two_processes_with_two_devices_each(core_built, tmp_path):
    results = _run("quick", 2, "shm", tmp_path, cpu_devices=2)
    launched.assert_all_correct(results, expect=QUICK_CASES)
    assert all(r["world"] == 4 and r["local_devices"] == 2 for r in results.values())


@pytest.mark.parametrize("transport,route", [("shm", "over shared memory"), ("tcp", "through the proxy")])
def test_moe_combine_steps_aside_by_default(core_built, tmp_path, transport, route):
    results = _run("moe_plan", 2, transport, tmp_path, env={"JAX_ARX_FALLBACK": "error"})
    launched.assert_all_correct(results, expect=["moe_plan"])
    for r in results.values():
        ((reason, n),) = r["plans"].items()  # one reason, every call traced (the worker checks how many)
        assert n == 8, r["plans"]
        assert f"CPU backend {route}" in reason and "docs/performance.md" in reason, reason
        assert "the same bits" in reason, reason


def test_failures_are_errors_not_results(core_built, tmp_path):
    results = _run("failures", 2, "tcp", tmp_path, env={"JAX_ARX_TIMEOUT_S": "3"})
    first, other = results[0]["trace_differs"], results[1]["trace_differs"]
    assert first["kind"] == "InitializationError" and "process 1" in first["error"], first
    assert "every process must trace the same program" in first["error"], first
    assert other["kind"] == "CollectiveTimeoutError" and "rank 0" in other["error"], other
    assert 2.5 < first["seconds"] < 30 and other["seconds"] < 30, (first, other)
    missing = launched.assert_failure_suite(results)
    assert "rank 1" in missing["error"] and "timed out" in missing["error"], missing
    assert missing["kind"] == "CollectiveTimeoutError", missing  # the call's JaxRuntimeError, translated
    assert "all_gather #1" in missing["error"], missing
    assert missing["nan"], missing


# --- running workers ------------------------------------------------------------


def _run(suite, nprocs, transport, cwd, *, cpu_devices=1, env=None, timeout=300):
    return launched.run_suite(
        WORKER,
        suite,
        nprocs,
        transport,
        cwd,
        cpu_devices=cpu_devices,
        timeout=timeout,
        env={
            "JAX_ARX_PREFILL_SLOT_BYTES": str(PREFILL_SLOT_BYTES),
            "JAX_ARX_SLOT_BYTES": "64K",
            "JAX_ARX_TIMEOUT_S": "30",
            **(env or {}),
        },
    )
