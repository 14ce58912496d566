"""GPU tests of the bulk collectives on NVIDIA GPUs (ffi/cuda/bulk.cu):
jax_arx.all_gather, jax_arx.psum_scatter and jax_arx.moe_combine_psum_scatter,
over every route to the peers.

Marked ``gpu``. tests/gpu_common.py says when they run, where the ranks go
(processes share a GPU when there are fewer GPUs than ranks: every test here
runs on one GPU) and how the workers report.

One launch per world size (2, 3 and 4 processes) runs these phases in turn,
each with jax_arx initialized anew with its settings; a test asserts on one
phase of one launch:

============  ===============================  =================================================
phase         settings                         route (Endpoint.route)
============  ===============================  =================================================
gpu_inboxes   the defaults                     direct, GPU inboxes where every rank maps every
                                               peer's inbox; else direct (the core says why)
host_inboxes  JAX_ARX_CUDA_PEER_MEMORY=0       direct
proxy         JAX_ARX_CUDA_DIRECT=0            proxy (shm carrier)
tcp           JAX_ARX_TRANSPORT=tcp            proxy (tcp carrier)
ring          JAX_ARX_TOPOLOGY=ring            proxy (shm carrier), links to prev and next only;
                                               at world 4 every rank relays
ring_tcp      JAX_ARX_TOPOLOGY=ring,           proxy (tcp carrier), likewise
              JAX_ARX_TRANSPORT=tcp
============  ===============================  =================================================

The ring phases run in a launch of their own per world (``test_bulk_ring``;
``python3 -m pytest -m gpu -k ring tests`` runs them alone).

Each phase runs tests/bulk_cases.py's cases as they are, without their
comparisons with jax.lax (on GPUs that is NCCL, which refuses ranks sharing a
GPU): all_gather over every axis and tiling, psum_scatter over every
dimension, the fused MoE combine with bfloat16 and e4m3 ``y`` and topk 1 to
16, with element counts that do not divide into the pieces (the first
phase: all_gather of five dtypes, psum_scatter of float32, bfloat16 and
float16; the others a subset); bit for bit against the numpy references (the
float32 rank-order sum from rank 0's element, rounded once: ``zeros`` sums
signed zeros). What the handlers ran
(Endpoint.stats) must be one bulk collective for each call in those
programs. Then the three interleaved with psum, and 100 dependent steps of
all_gather, psum_scatter and psum in a fori_loop.

The first phase adds: the same cases at several MB per rank (many pieces
of many blocks), all_gather at exactly the bulk buffers' size
(JAX_ARX_PREFILL_SLOT_BYTES) and one element past it (JAX_ARX_FALLBACK=error:
the lowering raises), 50 back-to-back jitted calls, and ``replay``: one
program of dependent bulk ops run 20 times, each run checked. XLA command
buffers are forced on at world 2 and 4 (the graph replays: the handlers run
far fewer times than the calls) and off at world 3 (once a call).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import gpu_common
from gpu_common import AXIS

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
PHASES = {
    "gpu_inboxes": {},
    "host_inboxes": {"JAX_ARX_CUDA_PEER_MEMORY": "0"},
    "proxy": {"JAX_ARX_CUDA_DIRECT": "0"},
    "tcp": {"JAX_ARX_TRANSPORT": "tcp"},
    "ring": {"JAX_ARX_TOPOLOGY": "ring"},
    "ring_tcp": {"JAX_ARX_TOPOLOGY": "ring", "JAX_ARX_TRANSPORT": "tcp"},
}
SMOKE_PHASES = ("gpu_inboxes", "tcp", "ring")  # --cpu-smoke: the host device side's two routes, and a ring
CASES = ["gather", "scatter", "moe", "zeros", "mixed", "loop"]
FIRST_CASES = ["envelope", "python_loop", "replay"]  # the first phase's own


# --- the tests -------------------------------------------------------------------

# check_phase (below) asserts one phase of a launch.
test_bulk, test_bulk_ring = gpu_common.phase_tests(THIS, "bulk", PHASES, lambda *a: check_phase(*a))


def check_phase(run, phase, world, summary_line):
    """Everything phase ``phase`` of ``run`` must show (see the module doc).
    tests/test_gpu_workers_cpu.py checks its CPU runs with this too."""
    reports = run.phase(phase)
    assert sorted(reports) == list(range(world)), sorted(reports)
    gpu_common.assert_route(run, reports, PHASES[phase], summary_line)
    # Each rank's results against the references; they differ between ranks
    # (each gets its own block), so there is no digest to compare.
    gpu_common.assert_correct(
        reports, CASES + (FIRST_CASES if phase == next(iter(PHASES)) else []), same_everywhere=False
    )
    gpu_common.assert_relays(reports, PHASES[phase])
    for r in reports.values():
        # One bulk collective per call of the cases' programs, each run once.
        gpu_common.assert_ran(r["ran"], r["lowered"], "calls")
        gpu_common.assert_ran(r["ran"], {"bulk": sum(r["lowered"].values())}, "algorithms")
        if "replay" in r["cases"]:
            gpu_common.assert_graph_calls(r["graph"], r["xla_flags"], r["platform"])


# --- the worker ---------------------------------------------------------------------
# Everything below runs in the worker processes only.


def case_zeros(w):
    """psum_scatter of inputs led by signed zeros (all negative: -0.0)."""
    import bulk_cases as suites

    n = w.world
    for name in ("float32", "bfloat16", "float16"):
        parts = gpu_common.signed_inputs(suites._dtypes()[name], 3 << n, n, seed=n)
        f = w.smap(suites._lift(lambda v: w.jax_arx.psum_scatter(v, AXIS, tiled=True)), w.P(AXIS), w.P(AXIS))
        for r, got in w.mine(f(w.put(parts))).items():
            w.check("zeros", got, suites.reference_scatter(parts, 0, True, r), f"{name} rank {r}")


def case_large(w):
    """The cases at several MB per rank, counts that divide neither into the
    pieces nor into blocks; every call's gathered output (or scattered
    input) within the default bulk buffers at world 4."""
    import bulk_cases as suites

    n = w.world
    suites.case_gather(w, ("bfloat16", "int8"), shapes=((63, 129, 257),))
    suites.case_scatter(w, ("float32",), specs=[((n * 1000003,), 0, True)])
    suites.case_scatter(w, ("bfloat16",), specs=[((515, n * 4099), 1, True), ((n, 3, 300001), 0, False)])
    suites.case_moe(w, shapes=((512, 3000, 2048, 8), (64, 700, 1024, 16)))


def case_envelope(w, bulk_bytes):
    """all_gather of exactly the bulk buffers (JAX_ARX_PREFILL_SLOT_BYTES)
    gathered runs in jax_arx; one element more per rank is refused at trace
    time (JAX_ARX_FALLBACK=error), with the setting to raise in the message."""
    import bulk_cases as suites

    at = bulk_bytes // 4 // w.world
    f = w.smap(suites._lift(lambda v: w.jax_arx.all_gather(v, AXIS, tiled=True)), w.P(AXIS), w.P(AXIS))
    rng = np.random.default_rng(4)
    parts = [suites.random_array(rng, (at,), np.dtype(np.float32)) for _ in range(w.world)]
    for r, got in w.mine(f(w.put(parts))).items():
        w.check("envelope", got, np.concatenate(parts), f"all_gather of {at} floats per rank, rank {r}")
    try:
        w.calls(f, w.put([np.zeros(at + 1, np.float32)] * w.world))
        w.fail("envelope", f"all_gather of {at + 1} floats per rank lowered without JaxArxFallbackError")
    except w.jax_arx.JaxArxFallbackError as e:
        w.record("envelope", None if "JAX_ARX_PREFILL_SLOT_BYTES" in str(e) else f"the error says no fix: {e}")


def case_replay(w, runs=20):
    """One program of dependent bulk ops (all_gather, psum_scatter, an
    all_gather along the minor dimension, the fused MoE combine) run again
    and again on the same inputs, every run checked; returns how often the
    handlers ran for the ``runs``."""
    import ml_dtypes

    import bulk_cases as suites

    jax_arx, P, n = w.jax_arx, w.P, w.world
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(11)
    parts = [suites.random_array(rng, (4099, 8), bf16) for _ in range(n)]
    T, R, H, topk = 2 * n + 1, 40, 256, 4
    ys, _, poss, ws, shareds = suites._moe_inputs(rng, w, T, R, H, topk, e4m3=False)

    def body(x, y, pos, wt, shared):
        g = jax_arx.all_gather(x, AXIS, tiled=True)  # [n * 4099, 8], the same on every rank
        s = jax_arx.psum_scatter(g, AXIS, tiled=True)  # [4099, 8]: n * parts[rank], rounded once
        g2 = jax_arx.all_gather(s, AXIS, axis=1, tiled=True)  # [4099, 8 * n]
        m = jax_arx.moe_combine_psum_scatter(y, pos, wt, shared + g2[:T, :1], AXIS)  # after g2
        return g2, m

    f = w.smap(suites._lift(body), (P(AXIS),) * 5, (P(AXIS),) * 2)
    args = [w.put(parts), w.put(ys), w.put(poss), w.put(ws), w.put(shareds)]
    ops = len(w.calls(f, *args))
    if ops != 4:
        w.fail("replay", f"{ops} jax_arx calls, expected 4")
    gathered = np.concatenate(parts)
    s = {r: suites.reference_scatter([gathered] * n, 0, True, r) for r in range(n)}
    want_g2 = np.concatenate([s[r] for r in range(n)], axis=1)
    tpad = -(-T // n) * n
    combined = [
        suites.reference_combine(
            ys[r],
            poss[r],
            ws[r],
            (shareds[r].astype(np.float32) + want_g2[:T, :1].astype(np.float32)).astype(bf16),
            None,
            tpad,
        )
        for r in range(n)
    ]

    def run(k):
        g2, m = f(*args)
        for r, got in w.mine(g2).items():
            w.check("replay", got, want_g2, f"run {k}: all_gather along dimension 1, rank {r}")
        for r, got in w.mine(m).items():
            w.check("replay", got, suites.reference_scatter(combined, 0, True, r), f"run {k}: moe, rank {r}")

    run(0)  # compiles, and records the graph
    calls = w.counted(lambda: [run(k) for k in range(1, runs + 1)])
    return {"ops": ops * runs, "calls": {rank: c["calls"] for rank, c in calls.items()}}


def worker(argv):
    import bulk_cases as suites
    import jax_arx.config

    smoke = "--cpu-smoke" in argv
    w = gpu_common.GpuWorker(smoke)
    for name in gpu_common.worker_phases(argv, SMOKE_PHASES if smoke else gpu_common.mesh_phases(PHASES)):
        error = w.phase(name, PHASES[name])
        if error:
            w.report(init_error=error)
            continue
        extra, first = {}, name == next(iter(PHASES))
        lowered = dict(w.lowered)
        # Every dtype in the first phase; the other routes carry a subset.
        gathered = ("float32", "bfloat16", "float16", "int8", "bool") if first and not smoke else ("bfloat16", "int8")
        scattered = ("float32", "bfloat16", "float16") if first else ("float32", "float16")
        ran = w.counted(
            lambda gathered=gathered, scattered=scattered, first=first: (
                suites.case_gather(w, gathered),
                suites.case_scatter(w, scattered),
                suites.case_moe(w, shapes=suites.MOE_SHAPES[0 if first else 1 : 4]),
            )
        )
        extra["lowered"] = {k: v - lowered.get(k, 0) for k, v in w.lowered.items()}
        case_zeros(w)
        suites.case_mixed(w, iters=3)
        suites.case_loop(w, steps=100)
        if first:
            if not smoke:
                case_large(w)
            case_envelope(w, jax_arx.config.load().bulk_bytes)
            suites.case_python_loop(w, calls=50)
            extra["graph"] = case_replay(w)
        w.report(ran=ran, **extra)
    w.jax_arx.check()


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    worker(sys.argv)
