"""GPU tests of jax_arx.psum_add_norm: the norm in the epilogue of the LL
one-shot (ffi/cuda/ll.cu), of the one-shot (oneshot.cu) and after the
two-shot (norm.cu), over every route to the peers.

Marked ``gpu``; tests/gpu_common.py says when they run and where the ranks
go (all on one GPU here). One launch per world size (2, 3 and 4) runs the
phases below, each with jax_arx initialized anew; a test asserts on one
phase of one launch. In each phase:

- ``norms``: one program of fused calls, every dtype, both kinds, with and
  without bias, rows of 1, odd widths and leading shapes, sizes that run
  LL, the one-shot and the two-shot. Checked against tests/norm_reference.py
  (numpy): hidden bit for bit against the fp32 rank-order sum rounded once
  plus the residual rounded once; normed bit for bit against the float32
  model of ffi/base/norm.h's order, and within the contract's tolerance of
  the float64 formula. Every phase
  runs the same inputs, so the digest of its results is the same in every
  phase (every route and algorithm gives the same bits); the test compares
  them.
- ``graph``: the program run again 5 times, each run checked (CUDA graphs
  replay it at worlds 2 and 4).

Every phase but ``steps_aside`` runs the fused kernels (the ``norm_fused``
tuning, tests/gpu_common.py). ``steps_aside`` runs the defaults, where the
plan steps aside for jax_arx.psum then the add and the norm in jax
(ffi/comm/plan.cc, plan_add_norm): no fused call lowered, the plan's
reason counted in ``jax_arx.stats()["plans"]``, hidden bit for bit as
above, normed within the contract's tolerance of the float64 formula.

``--cpu-smoke`` runs the worker on the CPU backend (the host device side,
tests/test_gpu_workers_cpu.py), where the same numpy reference holds.
"""

from __future__ import annotations

import os
import sys

import pytest

import gpu_common
import norm_reference as ref
from gpu_common import AXIS

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
EPS = 1e-5

PHASES = {
    "gpu_inboxes": ({}, {}),
    "host_inboxes": ({"JAX_ARX_CUDA_PEER_MEMORY": "0"}, {}),
    "proxy": ({"JAX_ARX_CUDA_DIRECT": "0"}, {}),
    "tcp": ({"JAX_ARX_TRANSPORT": "tcp"}, {}),
    "ring": ({"JAX_ARX_TOPOLOGY": "ring"}, {}),
    "ring_tcp": ({"JAX_ARX_TOPOLOGY": "ring", "JAX_ARX_TRANSPORT": "tcp"}, {}),
    "steps_aside": ({}, {"norm_fused": 0}),
}
SMOKE_PHASES = ("gpu_inboxes", "tcp")
CASES = ["norms", "graph"]

# (shape, dtypes): 8 KB and 128 KB of bf16 rows of 4096 (LL where it runs),
# 512 KB (past the default slot: the two-shot), odd widths, leading shapes.
SHAPES = [
    ((1, 4096), ("bfloat16", "float32")),
    ((16, 4096), ("bfloat16",)),
    ((64, 4096), ("bfloat16",)),
    ((33, 1000), ("float32",)),
    ((1, 7), ("float16", "bfloat16")),
    ((3, 257), ("float16", "float32")),
    ((2, 3, 40), ("bfloat16",)),
    ((5, 1), ("float32",)),
    ((2, 2048), ("float16",)),
]


# --- the tests -------------------------------------------------------------------

test_norm, test_norm_ring = gpu_common.phase_tests(THIS, "norm", PHASES, lambda *a: check_phase(*a))


def check_phase(run, phase, world, summary_line):
    """What phase ``phase`` of ``run`` must show; returns its reports."""
    env, _ = PHASES[phase]
    reports = run.phase(phase)
    assert sorted(reports) == list(range(world)), sorted(reports)
    gpu_common.assert_route(run, reports, env, summary_line)
    if phase == "steps_aside":
        gpu_common.assert_correct(reports, ["unfused"])
        return reports
    gpu_common.assert_correct(reports, CASES)
    # The same inputs in every phase of a launch: the same bits on every route.
    digests = {name: r["digest"] for name, r in run.reports[0].items() if name != "steps_aside"}
    assert len(set(digests.values())) == 1, digests
    return reports


# --- the cases -------------------------------------------------------------------


def specs():
    out = []
    for i, (shape, names) in enumerate(SHAPES):
        for name in names:
            for kind in ("rms", "layer"):
                out.append((shape, name, kind, (i + len(out)) % 2 == 1))
    return out


# --- the worker --------------------------------------------------------------------


def program(w, cases, data):
    """One program of one psum_add_norm per case: x's rows split over the
    ranks, the rest replicated; returns (f, args), f's results (normed,
    hidden) per case."""
    P = w.P

    def body(*ops):
        out, i = [], 0
        for _, _, kind, has_bias in cases:
            b = ops[i + 3] if has_bias else None
            n, h = w.jax_arx.psum_add_norm(ops[i][0], ops[i + 1], ops[i + 2], AXIS, kind=kind, bias=b, eps=EPS)
            i += 4 if has_bias else 3
            out += [n[None], h[None]]
        return tuple(out)

    args, specs_in = [], []
    for p, r, wt, b in data:
        args += [w.put(p), r, wt] + ([b] if b is not None else [])
        specs_in += [P(AXIS), P(), P()] + ([P()] if b is not None else [])
    return w.smap(body, tuple(specs_in), (P(AXIS),) * (2 * len(cases))), args


def case_norms(w, runs):
    cases = specs()
    data = [ref.inputs(w.world, s) for s in cases]
    wants = []
    for s, (p, r, wt, b) in zip(cases, data, strict=True):
        h = ref.hidden(p, r, ref.dtypes()[s[1]])
        wants.append((ref.normed_lanes(h, wt, b, s[2], EPS), h, ref.normed_f64(h, wt, b, s[2], EPS)))
    f, args = program(w, cases, data)
    lowered = w.calls(f, *args, target="jax_arx_psum_add_norm")
    if len(lowered) != len(cases):
        w.fail("norms", f"{len(lowered)} fused calls lowered for {len(cases)} cases")
    for k in range(1 + runs):
        outs = f(*args)
        for j, (spec, (want_n, want_h, f64)) in enumerate(zip(cases, wants, strict=True)):
            for rank, got in w.mine(outs[2 * j]).items():
                w.check("norms" if k == 0 else "graph", got, want_n, f"normed {spec} rank {rank}")
                if k == 0:
                    bad = ref.close_report(got, f64, ref.dtypes()[spec[1]])
                    w.record("norms", bad and f"normed {spec} rank {rank} vs float64: {bad}")
            for rank, got in w.mine(outs[2 * j + 1]).items():
                w.check("norms" if k == 0 else "graph", got, want_h, f"hidden {spec} rank {rank}")


def case_unfused(w):
    """The defaults on a GPU: the plan's unfused form (see the top)."""
    cases = specs()
    data = [ref.inputs(w.world, s) for s in cases]
    f, args = program(w, cases, data)
    before = sum(w.jax_arx.stats()["plans"].get("psum_add_norm", {}).values())
    if w.calls(f, *args, target="jax_arx_psum_add_norm"):
        w.fail("unfused", "a fused call was lowered where the plan steps aside")
    planned = sum(w.jax_arx.stats()["plans"].get("psum_add_norm", {}).values()) - before
    w.record("unfused", None if planned >= len(cases) else f"{planned} calls counted in plans, {len(cases)} made")
    outs = f(*args)
    for j, (spec, (p, r, wt, b)) in enumerate(zip(cases, data, strict=True)):
        h = ref.hidden(p, r, ref.dtypes()[spec[1]])
        f64 = ref.normed_f64(h, wt, b, spec[2], EPS)
        for rank, got in w.mine(outs[2 * j + 1]).items():
            w.check("unfused", got, h, f"hidden {spec} rank {rank}")
        for rank, got in w.mine(outs[2 * j]).items():
            bad = ref.close_report(got, f64, ref.dtypes()[spec[1]])
            w.record("unfused", bad and f"normed {spec} rank {rank} vs float64: {bad}")


def worker(argv):
    smoke = "--cpu-smoke" in argv
    names = gpu_common.worker_phases(argv, SMOKE_PHASES if smoke else gpu_common.mesh_phases(PHASES))
    w = gpu_common.GpuWorker(smoke)
    for name in names:
        error = w.phase(name, *PHASES[name])
        if error:
            w.report(init_error=error)
            continue
        ran = w.counted(case_unfused, w) if name == "steps_aside" else w.counted(case_norms, w, 5)
        w.report(ran=ran)
    w.jax_arx.check()


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    worker(sys.argv)
