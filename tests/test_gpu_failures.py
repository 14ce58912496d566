"""GPU tests of jax_arx's failures on NVIDIA GPUs: every wait bounded in time,
a failed collective NaN plus an error that names the peer, never a wrong
result or a hang, and the GPU still usable.

Marked ``gpu``. tests/gpu_common.py says when they run, where the ranks go
and how the workers report; each test runs 3 processes, on one GPU where
there is one. JAX_ARX_TIMEOUT_S=3 and XLA command buffers forced on.

- ``peer_exit`` (over shm, and over tcp): after 50 correct psums, rank 2
  exits without a word. Once it is gone (its process no longer exists),
  ranks 0 and 1 call again: the kernel returns within 2x the timeout with
  NaN (over shm the wait times out; over tcp the carrier sees the
  connection close and fails the endpoint, which stops the wait at once, or
  makes the handler raise if XLA runs it),
  jax_arx.check() names rank 2, the GPU runs other work, the captured graph
  replays within the timeout (NaN: the kernel sees the recorded failure, or
  its handler runs and raises), and the next call whose handler runs raises
  naming rank 2.
- ``mismatch``: rank 2 issues a psum of another size; then, on fresh
  endpoints, an all_gather where the others issue a psum_scatter: on every
  rank the call gives NaN (or raises) and jax_arx.check() says "different
  collective". Then, on fresh endpoints, rank 0 calls alone: NaN after the
  timeout and within 2x it, and jax_arx.check() names ranks 1 and 2.

- ``test_a_rank_stopped_mid_stream``: tests/test_stopped_rank_cpu.py's
  episodes with the ranks sharing the GPU (a stopped rank's launched
  kernels run on; a failed call gives NaN, jax_arx.check() the error).

On the CPU (``--cpu-smoke``) a failed call raises instead of giving NaN, and
the timings are not checked: they are this machine's, not the GPU's.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

import gpu_common
import test_failures_cpu as failures_cpu
import test_stopped_rank_cpu as stopped_rank
from gpu_common import AXIS, CMDBUF_ON

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
WORLD = 3
TIMEOUT_S = 3.0
ENV = {"JAX_ARX_TIMEOUT_S": str(TIMEOUT_S), "XLA_FLAGS": CMDBUF_ON}


# --- the tests -------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_exits_mid_stream(transport):
    gpus = gpu_common.require_gpus(1)
    run = gpu_common.run_workers(
        THIS,
        ["peer_exit"],
        WORLD,
        gpu_common.gpu_env(gpus, WORLD, {**ENV, "JAX_ARX_TRANSPORT": transport}),
        timeout=300,
        peer_lost=True,
    )
    check_peer_exit(run, transport)


def test_mismatched_collectives_and_a_missing_peer():
    gpus = gpu_common.require_gpus(1)
    run = gpu_common.run_workers(THIS, ["mismatch"], WORLD, gpu_common.gpu_env(gpus, WORLD, ENV), timeout=300)
    check_mismatch(run)


def check_peer_exit(run, transport):
    """What the survivors of peer_exit report (tests/test_gpu_workers_cpu.py
    checks its CPU runs with this too)."""
    reports = run.phase("peer_exit")
    gone = f"rank {WORLD - 1}"
    assert reports[WORLD - 1]["exited"], reports[WORLD - 1]
    for rank in range(WORLD - 1):
        r = reports[rank]
        assert r["cases"]["healthy"]["bad"] == [] and r["cases"]["healthy"]["checked"] == 50, r["cases"]
        assert r["gone"], r
        assert gone in r["check_error"], r["check_error"]
        if transport == "shm":
            assert "timed out" in r["check_error"], r["check_error"]
        assert r["gpu_still_works"], r
        assert gone in r["next_error"], r["next_error"]
        if r["platform"] == "cuda":
            # The kernel gave up, and its output is NaN, never a sum without the
            # peer. Over tcp the endpoint may have failed before the call (the
            # carrier saw the connection close): then a handler that runs raises.
            assert r["wait_s"] <= 2 * TIMEOUT_S, r
            assert r["all_nan"] or transport == "tcp" and gone in r["error"], r
            assert r["replay_s"] <= TIMEOUT_S and (r["replay_all_nan"] or gone in r["replay_error"]), r
        else:
            assert gone in r["error"], r["error"]


def check_mismatch(run):
    for phase in ("psum_mismatch", "bulk_mismatch"):
        for rank, r in run.phase(phase).items():
            # Either the call raised, or it returned NaN and check() raised: never a result.
            assert not r["finite_result"], (phase, rank, r)
            assert "different collective" in r["error"], (phase, rank, r["error"])
    missing = run.phase("missing_peer")
    alone = missing[0]
    assert alone["nan"] and alone["check_type"] == "CollectiveTimeoutError", alone
    assert "timed out" in alone["check"] and "rank 1, 2" in alone["check"], alone["check"]
    if alone["platform"] == "cuda":
        assert TIMEOUT_S <= alone["seconds"] <= 2 * TIMEOUT_S, alone
    assert all(missing[rank]["skipped"] for rank in range(1, WORLD)), missing


# --- the workers --------------------------------------------------------------------
# Everything below runs in the worker processes only.


def _psum_program(w, scale=1):
    from bulk_cases import _lift

    return w.smap(_lift(lambda v: w.jax_arx.psum(v * scale, AXIS)), w.P(AXIS), w.P(AXIS), check_vma=False)


def _timed_call(w, f, x):
    """(seconds, all NaN, error): on GPUs a failed collective comes back as
    NaN (the kernel gave up); on the CPU it raises."""
    start = time.monotonic()
    try:
        got = np.concatenate([v.astype(np.float32) for v in w.mine(f(x)).values()])
        return time.monotonic() - start, bool(np.isnan(got).all()), ""
    except Exception as e:  # jax's runtime error type differs between versions
        return time.monotonic() - start, False, str(e)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_peer_exit(smoke):
    import jax

    import launched

    # jax.distributed ends every process soon after one stops sending
    # heartbeats; the survivors outlive their peer on purpose.
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
        heartbeat_timeout_seconds=600,
    )
    from bulk_cases import _dtypes, reference_sum
    from jax_arx import _compat

    w = gpu_common.GpuWorker(smoke)
    w.phase("peer_exit")
    rank, last = jax.process_index(), w.world - 1
    parts = gpu_common.signed_inputs(_dtypes()["bfloat16"], 4096, w.world, seed=5)
    x = w.put(parts)
    # Compiled while every rank lives (compiling a program over the mesh after
    # a peer is gone would wait for it in jax.distributed), then started
    # together: with JAX_ARX_TIMEOUT_S=3, a rank still compiling on a loaded
    # host must not be a timeout of the healthy calls.
    f = _psum_program(w).lower(x).compile()
    g = _psum_program(w, 2).lower(x).compile()
    client = _compat.distributed_client()
    client.key_value_set(f"peer_exit/pid/{rank}", str(os.getpid()))
    client.wait_at_barrier("peer_exit/compiled", 600_000)  # a bound no load reaches
    for _ in range(50):
        for r, got in w.mine(f(x)).items():
            w.check("healthy", got, reference_sum(parts), f"rank {r}")
    # Every rank has finished the 50 before the last one leaves: a rank's
    # call ends when its peers' data has arrived, not its own sends, so one
    # that exits at once can take its last send with it (the documented
    # slack of one call), and a peer still in that call would fail it.
    client.wait_at_barrier("peer_exit/healthy", 600_000)
    if rank == last:  # exit mid-stream without a word to anyone (no atexit, no shutdown)
        w.report(exited=True)
        sys.stderr.flush()
        os._exit(0)
    pid = int(client.blocking_key_value_get(f"peer_exit/pid/{last}", 60_000))
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the condition, not standing in for it
    report = {"gone": not _alive(pid)}
    report["wait_s"], report["all_nan"], report["error"] = _timed_call(w, f, x)
    try:
        w.jax_arx.check()
        report["check_error"] = ""
    except w.jax_arx.CollectiveError as e:
        report["check_error"] = str(e)
    y = w.jax.numpy.arange(100, dtype=np.float32)
    report["gpu_still_works"] = float(y @ y) == 328350.0
    # The captured graph again: no handler runs, the kernel sees the failure.
    report["replay_s"], report["replay_all_nan"], report["replay_error"] = _timed_call(w, f, x)
    # A program not run before: its handler runs, and raises the failure.
    report["next_error"] = _timed_call(w, g, x)[2]
    w.report(**{k: v[:3000] if isinstance(v, str) else v for k, v in report.items()})
    launched.leave_after_a_lost_peer("peer_exit", range(last))


def worker_mismatch(smoke):
    import launched
    from bulk_cases import _lift

    w = gpu_common.GpuWorker(smoke)
    jax_arx, P = w.jax_arx, w.P
    me, last = w.jax.process_index(), w.world - 1

    def result(f, x):
        return np.concatenate([v.astype(np.float32).ravel() for v in w.mine(f(x)).values()])

    # Rank 2 sums another size: every rank's wait sees another descriptor.
    w.phase("psum_mismatch")
    x = w.put([np.ones(1000 + (me == last), np.float32)] * w.world)
    w.report(**launched.mismatch_report(lambda: result(_psum_program(w), x), jax_arx))

    # Rank 2 gathers where the others scatter, the same bulk sequence number.
    # Each program is the collective alone: nothing else for XLA to compile
    # differently on different ranks.
    w.phase("bulk_mismatch", fresh=True)
    if me == last:
        x = w.put([np.ones((2, 8), np.float32)] * w.world)
        f = w.smap(_lift(lambda v: jax_arx.all_gather(v, AXIS, tiled=True)), P(AXIS), P(AXIS))
    else:
        x = w.put([np.ones((2 * w.world, 8), np.float32)] * w.world)
        f = w.smap(_lift(lambda v: jax_arx.psum_scatter(v, AXIS, tiled=True)), P(AXIS), P(AXIS))
    w.report(**launched.mismatch_report(lambda: result(f, x), jax_arx))

    # Rank 0 alone; the others wait on the key-value store until it is done.
    w.phase("missing_peer", fresh=True)
    x = w.put([np.ones(64, np.float32)] * w.world)
    f = w.smap(_lift(lambda v: jax_arx.all_gather(v, AXIS)), P(AXIS), P(AXIS))
    compiled = f.lower(x).compile() if me == 0 else None  # timed: the call, not its compilation
    w.report(
        **launched.alone_call_report(
            lambda: {"nan": bool(np.isnan(result(compiled, x)).all())},
            jax_arx,
            "test_gpu_failures/rank0_done",
            on_error={"nan": True},
        )
    )


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    smoke = "--cpu-smoke" in sys.argv
    {"peer_exit": worker_peer_exit, "mismatch": worker_mismatch}[sys.argv[sys.argv.index("--worker") + 1]](smoke)


# tests/test_failures_cpu.py's suites on GPUs: a stranger who read the
# rendezvous store gets no tcp stream; a stopped peer makes a 96 MiB psum (the
# proxy sends it on GPUs) and an 80 MiB all_gather fail, and shutdown()
# return, within about the timeout; a rank SIGKILLed in initialize(), and
# ranks that os._exit after a failed one, leave nothing in /dev/shm.


@pytest.mark.parametrize("user_secret", [False, True], ids=["no-JAX_ARX_SECRET", "JAX_ARX_SECRET"])
def test_a_stranger_with_the_store_gets_no_stream(tmp_path, user_secret):
    failures_cpu.check_stranger(tmp_path, user_secret, gpus=gpu_common.require_gpus(1))


@pytest.mark.parametrize("op", ["psum", "all_gather"])
def test_a_stopped_peer_fails_the_call_and_shutdown_within_the_timeout(tmp_path, op):
    failures_cpu.check_stopped_peer(tmp_path, op, gpus=gpu_common.require_gpus(1))


@pytest.mark.parametrize("suite", ["killed_in_initialize", "failed_initialize"])
def test_no_shared_memory_left_after_failed_set_ups(tmp_path, suite):
    failures_cpu.check_no_shared_memory_left(tmp_path, suite, gpus=gpu_common.require_gpus(1))


# tests/test_stopped_rank_cpu.py on GPUs: the last rank stopped mid-stream
# while its kernels may still run; every rank raises or every rank
# completes, the stopped one never blames a healthy one, the completed calls
# differ by at most one, never a wrong value (ARX_STOP_EPISODES=N for more).
@pytest.mark.parametrize("transport,nprocs", [("tcp", 2), ("shm", 2), ("tcp", 3)])
def test_a_rank_stopped_mid_stream(tmp_path, summary_line, transport, nprocs):
    stopped_rank.check_stopped_mid_stream(tmp_path, summary_line, transport, nprocs, gpus=gpu_common.require_gpus(1))
