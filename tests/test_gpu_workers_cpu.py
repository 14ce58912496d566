"""The GPU test workers' own Python, run on the CPU backend (their
``--cpu-smoke`` modes), so that CI, which has no GPU, runs it: the phases
and their re-initialization, the cases and their references, the reports,
and the GPU tests' own checks of those reports (``check_phase`` and the
like), with what the host device side must show instead of a GPU's (routes:
direct over shm, proxy over tcp; the one-shot only; a failed call raises).

The wait tests' worker drives the CUDA-only test hooks and has no CPU mode.
Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise (failed in CI), as the other multi-process CPU tests are.
"""

from __future__ import annotations

import gpu_common
import test_gpu_bulk
import test_gpu_failures
import test_gpu_norm
import test_gpu_psum


def _smoke(module, args, world, env=None, **kw):
    return gpu_common.run_workers(
        module.THIS, [*args, "--cpu-smoke"], world, gpu_common.cpu_env(env), timeout=600, cpu_devices=1, **kw
    )


def test_psum_worker(core_built, summary_line):
    run = _smoke(test_gpu_psum, ["psum"], 2)
    for phase in test_gpu_psum.SMOKE_PHASES:
        test_gpu_psum.check_phase(run, phase, 2, summary_line)


def test_bulk_worker(core_built, summary_line):
    # Bulk buffers of 4 MiB: the envelope case gathers that much.
    run = _smoke(test_gpu_bulk, ["bulk"], 2, {"JAX_ARX_PREFILL_SLOT_BYTES": "4MiB"})
    for phase in test_gpu_bulk.SMOKE_PHASES:
        test_gpu_bulk.check_phase(run, phase, 2, summary_line)


def test_norm_worker(core_built, summary_line):
    run = _smoke(test_gpu_norm, ["norm"], 2)
    for phase in test_gpu_norm.SMOKE_PHASES:
        test_gpu_norm.check_phase(run, phase, 2, summary_line)


def test_peer_exit_worker(core_built):
    env = {"JAX_ARX_TIMEOUT_S": str(test_gpu_failures.TIMEOUT_S), "JAX_ARX_TRANSPORT": "tcp"}
    run = _smoke(test_gpu_failures, ["peer_exit"], test_gpu_failures.WORLD, env, peer_lost=True)
    test_gpu_failures.check_peer_exit(run, "tcp")


def test_mismatch_worker(core_built):
    env = {"JAX_ARX_TIMEOUT_S": str(test_gpu_failures.TIMEOUT_S)}
    test_gpu_failures.check_mismatch(_smoke(test_gpu_failures, ["mismatch"], test_gpu_failures.WORLD, env))
