"""GPU tests of the prefill ops' CUDA device side: jax_arx.all_gather,
jax_arx.psum_scatter and jax_arx.moe_combine_psum_scatter on NVIDIA GPUs.

Marked ``gpu`` and skipped without 2 NVIDIA GPUs or without a jax_arx built
with CUDA, as tests/test_gpu_psum.py decides (its detection, imported only
when a test runs). Every test runs its GPU work in two fresh processes with
one GPU each (``python -m jax_arx.launch -n 2``, each rank restricted to its
GPU with CUDA_VISIBLE_DEVICES, as in test_gpu_psum.py), so the pytest process
never starts a GPU backend and each scenario gets the environment it needs.

The worker suites are tests/test_prefill_cpu.py's, run as they are on the
GPUs (``test_prefill_cpu.run_worker``): this file, run as a worker, picks
its GPU and hands over. What they check, over shm (the kernels write the
peer's buffers themselves) and tcp (the proxy's work ring):

- ``full``: all_gather of every dtype, axis and tiling, psum_scatter of
  float32, bfloat16 and float16 over every dimension, element counts that
  do not divide into the pieces, sizes at and past the prefill slot, the
  three interleaved with psum, 3000 dependent calls in a fori_loop, 200
  back-to-back jitted calls, jax.grad, the fused MoE combine with bfloat16
  and e4m3 ``y`` and topk 1 to 16. Bit for bit against the numpy references
  (the gathered pieces; the float32 rank-order sum rounded once);
- ``quick`` with the GPU-only ``large`` (the same cases at several MB per
  rank: many pieces of many blocks each) and ``replay`` (one program of
  dependent prefill ops run again and again on the same buffers, so that
  with command buffers XLA replays its CUDA graph: every replay checked, and
  the handlers' runs counted to show the capture), with XLA command buffers
  forced on (every jitted call captured) and off;
- ``failures``: ranks that issue different prefill ops get NaN and an
  error naming "a different collective", never a result; a peer that never
  calls makes the call give NaN within the timeout, and jax_arx.check()
  names the peer.

Run them (with tests/test_gpu_psum.py) on a machine with 2 GPUs::

    pip install --no-build-isolation . && python -m pytest -m gpu tests/test_gpu_psum.py tests/test_gpu_prefill.py -v

``JAX_ARX_PREFILL_SLOT_BYTES=32MiB python -m jax_arx.launch -n 2 --cpu-devices 1
tests/test_gpu_prefill.py --worker quick+large+replay`` runs the worker on
the CPU backend, to check this file's own cases without a GPU.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import launched
import test_prefill_cpu as suites

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)

# As in tests/test_gpu_psum.py: graphs of even one custom call are captured,
# so every jitted call runs from a CUDA graph; or none is.
CMDBUF_ON = "--xla_gpu_graph_min_graph_size=1"
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="

# The suites' settings (test_prefill_cpu._run): `full` checks sizes at and past
# this prefill slot. `large` needs the default's room (the gathered output or
# the scattered input of its biggest case is 17 MB).
SMALL_SLOTS = {"JAX_ARX_PREFILL_SLOT_BYTES": str(suites.PREFILL_SLOT_BYTES), "JAX_ARX_SLOT_BYTES": "64K"}
LARGE_SLOTS = {"JAX_ARX_PREFILL_SLOT_BYTES": "32MiB", "JAX_ARX_SLOT_BYTES": "64K"}


# --- when to run ------------------------------------------------------------

@pytest.fixture(scope="module")
def two_gpus():
    # test_gpu_psum's detection; imported here so a worker never runs it.
    from test_gpu_psum import _built_with_cuda, _gpu_count

    if _gpu_count() < 2 or not _built_with_cuda():
        pytest.skip("needs 2 NVIDIA GPUs and jax_arx built with CUDA")


def _run(suite, transport, cwd, env, timeout):
    """The worker suite on 2 processes x 1 GPU over ``transport``; each
    rank's RESULT, after checking that it ran on one GPU of two."""
    results = launched.run_suite(THIS, suite, 2, transport, cwd, cpu_devices=None, timeout=timeout,
                                 env={"JAX_PLATFORMS": "cuda", "JAX_ARX_TIMEOUT_S": "30", **env})
    for rank, r in results.items():
        assert (r["platform"], r["world"], r["local_devices"]) == ("gpu", 2, 1), (rank, r)
    return results


# --- the tests ----------------------------------------------------------------

@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_full_suite(two_gpus, tmp_path, transport):
    results = _run("full", transport, tmp_path, SMALL_SLOTS, timeout=300)
    launched.assert_all_correct(results, expect=suites._FULL_CASES)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_command_buffers_on(two_gpus, tmp_path, transport):
    results = _run("quick+large+replay", transport, tmp_path, {"XLA_FLAGS": CMDBUF_ON, **LARGE_SLOTS},
                   timeout=240)
    _assert_quick_large_replay(results)


def test_command_buffers_off(two_gpus, tmp_path):
    results = _run("quick+large+replay", "shm", tmp_path, {"XLA_FLAGS": CMDBUF_OFF, **LARGE_SLOTS}, timeout=240)
    _assert_quick_large_replay(results)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_failures_are_nan_and_errors_not_results(two_gpus, tmp_path, transport):
    # The ranks compile different programs on purpose (different ops at one
    # seq); XLA's sharded autotuning would have each wait in the compiler for
    # the other's results on a module the other never compiles. Nothing here
    # needs autotuning.
    results = _run("failures", transport, tmp_path,
                   {**SMALL_SLOTS, "JAX_ARX_TIMEOUT_S": "3", "XLA_FLAGS": "--xla_gpu_autotune_level=0"}, timeout=180)
    missing = launched.assert_failure_suite(results)
    # On GPUs a failed call gives NaN (the kernel gave up) and jax_arx.check()
    # raises; a handler that runs later raises too. Either way the failure
    # record names the op, the peer and the timeout.
    assert missing["nan"], missing
    assert "timed out" in missing["check"], missing
    assert "all_gather #1" in missing["error"] + missing["check"], missing


def _assert_quick_large_replay(results):
    launched.assert_all_correct(results, expect=suites._QUICK_CASES + ["replay"])
    for rank, r in results.items():
        assert set(LARGE_CASES) <= set(r["seconds"]), (rank, r["seconds"])


# --- the GPU-only cases ---------------------------------------------------------
# Everything below runs in the worker processes only.

LARGE_CASES = ("large_gather", "large_scatter", "large_moe")


def _suite_large(w):
    """test_prefill_cpu's cases at several MB per rank, with element counts
    that divide neither into the pieces nor into blocks; the results count
    under their cases ("gather", "scatter", "moe")."""
    n = w.world

    # 63 * 129 * 257 elements a rank: 4.2 MB in bfloat16, 8.4 MB in float32.
    w.timed(suites.case_gather, ("float32", "bfloat16", "int8"), shapes=((63, 129, 257),), record_as="large_gather")
    w.timed(suites.case_scatter, ("float32", "bfloat16"),
            specs=[((n * 1000003,), 0, True), ((515, n * 4099), 1, True), ((n, 3, 700001), 0, False)],
            record_as="large_scatter")
    # T = 2049 tokens of 2048 (8.4 MB of rows), topk 8; 129 tokens of 1024, topk 16.
    w.timed(suites.case_moe, shapes=((1024, 3000, 2048, 8), (64, 700, 1024, 16)), record_as="large_moe")


def case_replay(w, runs=20):
    """One program of dependent prefill ops (all_gather, psum_scatter, an
    all_gather along the minor dimension, the fused MoE combine), run again
    and again on the same inputs: with command buffers XLA captures it once
    and replays the graph, whose kernels must take their sequence numbers
    from the device. Every run is checked against the numpy references."""
    import ml_dtypes

    jax_arx, P = w.jax_arx, w.P
    n = w.world
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(11)
    parts = [suites.random_array(rng, (4099, 8), bf16) for _ in range(n)]
    T, R, H, topk = 2 * n + 1, 40, 256, 4
    ys, _, poss, ws, shareds = suites._moe_inputs(rng, w, T, R, H, topk, e4m3=False)

    def body(x, y, pos, wt, shared):
        g = jax_arx.all_gather(x, "sp", tiled=True)  # [n * 4099, 8], the same on every rank
        s = jax_arx.psum_scatter(g, "sp", tiled=True)  # [4099, 8]: n * parts[rank], rounded once
        g2 = jax_arx.all_gather(s, "sp", axis=1, tiled=True)  # [4099, 8 * n]
        m = jax_arx.moe_combine_psum_scatter(y, pos, wt, shared + g2[:T, :1], "sp")  # after g2
        return g2, m

    f = w.smap(suites._lift(body), (P("sp"),) * 5, (P("sp"),) * 2)
    args = [w.put(parts), w.put(ys), w.put(poss), w.put(ws), w.put(shareds)]
    calls = len(w.calls(f, *args))
    if calls != 4:
        w.fail("replay", f"{calls} jax_arx calls, expected 4")
    gathered = np.concatenate(parts)
    s = {r: suites.reference_scatter([gathered] * n, 0, True, r) for r in range(n)}
    want_g2 = np.concatenate([s[r] for r in range(n)], axis=1)
    tpad = -(-T // n) * n
    combined = [suites.reference_combine(ys[r], poss[r], ws[r],
                                         (shareds[r].astype(np.float32) + want_g2[:T, :1].astype(np.float32))
                                         .astype(bf16), None, tpad) for r in range(n)]
    before = _prefill_handler_calls()
    for run in range(runs):
        g2, m = f(*args)
        for r, got in w.mine(g2).items():
            w.check("replay", got, want_g2, f"run {run}: all_gather along dimension 1, rank {r}")
        for r, got in w.mine(m).items():
            w.check("replay", got, suites.reference_scatter(combined, 0, True, r), f"run {run}: moe, rank {r}")
    # Captured or not: with command buffers forced on, XLA runs the handlers
    # when it records the graph (again when buffer addresses change), not on
    # every replay -- test_gpu_psum.py's criterion, fewer than a quarter; with
    # them off, on every call. The first run (compile, capture) is counted.
    handled = _prefill_handler_calls() - before
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_gpu_graph_min_graph_size=1" in flags:
        w.check("replay", handled < calls * runs / 4, True,
                f"{handled} handler calls for {calls * runs} ops (captured: fewer than a quarter expected)")
    elif "--xla_gpu_enable_command_buffer=" in flags.split():
        w.check("replay", handled, calls * runs, f"{handled} handler calls for {calls * runs} ops (not captured)")


def _prefill_handler_calls() -> int:
    """How many times XLA ran a prefill op's CUDA handler in this process
    (ffi/xla/testing_cuda.cc); 0 on the CPU backend (a smoke run of this
    file), where nothing is captured."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        return 0
    import ctypes

    from jax_arx import _core
    lib = ctypes.CDLL(_core.__file__)
    lib.arx_testing_prefill_handler_calls.restype = ctypes.c_uint64
    return int(lib.arx_testing_prefill_handler_calls())


def _pick_gpu():
    """This rank's one GPU: the rank-th of CUDA_VISIBLE_DEVICES (of all GPUs
    when unset), before jax starts its backend."""
    rank = int(os.environ["JAX_PROCESS_ID"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[rank] if visible else str(rank)


if __name__ == "__main__" and "--worker" in sys.argv:
    if os.environ.get("JAX_PLATFORMS") != "cpu":  # under --cpu-devices: a check of this file without GPUs
        _pick_gpu()
    suites.run_worker(sys.argv[sys.argv.index("--worker") + 1],
                      {**suites.SUITES, "large": _suite_large, "replay": lambda w: w.timed(case_replay)})
