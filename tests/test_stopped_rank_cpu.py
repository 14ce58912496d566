"""A rank stopped mid-stream (SIGSTOP, as a debugger or a frozen host does),
on the CPU backend across processes (tests/test_gpu_failures.py runs the
same on GPUs, where a failed call gives NaN and jax_arx.check() raises):
the attack of docs/failures.md's second case, repeated to hit its races.

Every rank calls jax_arx.psum and jax_arx.all_gather on one mesh axis in
turn, back to back, each result checked exactly; the last rank stops
itself (a helper outside it sends SIGSTOP) at a random moment 0.2-1.2 s
into the stream, for STOP_S = 7 s with JAX_ARX_TIMEOUT_S = 3, then runs
again. Per episode, every rank reports the calls it completed and its
error. What docs/failures.md promises, checked for each episode:

- every rank raises (the healthy ones give up on the stopped one after
  the timeout; it then fails too), and the healthy ranks' errors name the
  stopped rank;
- the stopped rank never blames a healthy one: no "waiting for rank H"
  timeout for a healthy H unless it also says it was itself not running;
- the ranks' completed calls differ by at most one (the axis's psum and
  bulk communicators fail together);
- no call returned a wrong value.

An episode is one jax_arx.initialize() .. shutdown() cycle in the same
processes (the compiled functions are reused), so a run of many costs one
start of jax. The fast tier runs none; the slow suite runs one episode per
case; ``ARX_STOP_EPISODES=N`` runs N (the issue's counts: 50 over tcp and
50 over shm at world 2, 20 at world 3), each case printing its tally.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import launched

THIS = os.path.abspath(__file__)
TIMEOUT_S = 3  # JAX_ARX_TIMEOUT_S
STOP_S = 7  # how long the last rank stays stopped
EPISODES = int(os.environ.get("ARX_STOP_EPISODES", "1"))


@pytest.mark.slow
@pytest.mark.parametrize("transport,nprocs", [("tcp", 2), ("shm", 2), ("tcp", 3)])
def test_a_rank_stopped_mid_stream(core_built, tmp_path, summary_line, transport, nprocs):
    check_stopped_mid_stream(tmp_path, summary_line, transport, nprocs, gpus=None)


def check_stopped_mid_stream(tmp_path, summary_line, transport, nprocs, gpus):
    """The episodes on ``nprocs`` ranks over ``transport``, on the CPU backend
    or, with ``gpus``, sharing those GPUs (tests/test_gpu_failures.py)."""
    env = {"JAX_ARX_TIMEOUT_S": str(TIMEOUT_S)}
    if gpus:
        import gpu_common

        env = gpu_common.gpu_env(gpus, nprocs, env)
    results = launched.run_suite(
        THIS,
        f"episodes:{EPISODES}",
        nprocs,
        transport,
        tmp_path,
        cpu_devices=None if gpus else 1,
        env=env,
        timeout=120 + EPISODES * (STOP_S + 6 * TIMEOUT_S),
    )
    stopped = nprocs - 1
    tally = {"all raised": 0, "all completed": 0, "differ by one call": 0}
    for k in range(EPISODES):
        eps = [results[r]["episodes"][k] for r in range(nprocs)]
        where = f"episode {k}: {json.dumps(eps)}"
        assert all(e["exact"] for e in eps), "a call returned a wrong value: " + where
        assert eps[stopped]["was_stopped"], where
        errors = [e["error"] for e in eps]
        if not any(errors):
            tally["all completed"] += 1
            continue
        assert all(errors), "some ranks raised, some did not: " + where
        tally["all raised"] += 1
        for r in range(stopped):
            assert f"rank {stopped}" in errors[r], f"healthy rank {r} does not name the stopped rank: " + where
        for m in re.finditer(r"waiting for rank (\d+)", errors[stopped]):
            assert int(m.group(1)) == stopped or "itself was not running" in errors[stopped], (
                "the stopped rank blames a healthy peer: " + where
            )
        done = [e["done"] for e in eps]
        assert max(done) - min(done) <= 1, "the ranks' completed calls differ by more than one: " + where
        tally["differ by one call"] += max(done) != min(done)
    on = "GPU" if gpus else "CPU"
    summary_line(f"stopped mid-stream, {on}, {transport} x{nprocs}, {EPISODES} episodes: {tally}")


# --- the worker -------------------------------------------------------------------------


def _episode(jax, jax_arx, mesh, client, k, fns, x, wants):
    me, world = jax.process_index(), mesh.size
    jax_arx.initialize(mesh)
    for f, want in zip(fns, wants, strict=True):  # connected, exact, together
        assert np.array_equal(np.asarray(f(x).addressable_data(0)), want)
    client.wait_at_barrier(f"test_stopped/{k}/warm", 120_000)
    if me == world - 1:
        delay = random.Random(k).uniform(0.2, 1.2)
        subprocess.Popen(
            ["sh", "-c", f"sleep {delay:.3f}; kill -STOP {os.getpid()}; sleep {STOP_S}; kill -CONT {os.getpid()}"],
            start_new_session=True,
        )
    report = {"done": 0, "error": "", "exact": True}
    start = time.monotonic()
    # Past the stop and the timeouts it causes: a rank that has not raised
    # by then has seen every call complete.
    deadline = start + 1.2 + STOP_S + 4 * TIMEOUT_S
    while time.monotonic() < deadline:
        i = report["done"] % len(fns)
        try:
            got = np.asarray(fns[i](x).addressable_data(0))
            if np.isnan(got).all():
                # On GPUs a failed call's kernel gives NaN, and the error
                # comes from jax_arx.check() (on the CPU the call raises).
                jax_arx.check()
                raise AssertionError("NaN from a call jax_arx.check() finds nothing wrong with")
        except Exception as e:
            report["error"] = launched.error_text(e)
            break
        report["exact"] &= bool(np.array_equal(got, wants[i]))
        report["done"] += 1
    report["seconds"] = round(time.monotonic() - start, 2)
    report["was_stopped"] = me != world - 1 or report["seconds"] >= STOP_S
    client.wait_at_barrier(f"test_stopped/{k}/done", (STOP_S + 10 * TIMEOUT_S + 60) * 1000)
    jax_arx.shutdown()
    return report


def _worker(episodes):
    from test_failures_cpu import _setup  # beside this file

    jax, jax_arx, mesh, sharded, P = _setup()
    from jax_arx import _compat

    world, n = mesh.size, 1024
    rows = np.arange(world * n, dtype=np.float32).reshape(world, n)
    x = jax.make_array_from_callback(rows.shape, sharded, lambda idx: rows[idx])

    def smap(body, out):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out))

    fns = (smap(lambda v: jax_arx.psum(v, "x"), P()), smap(lambda v: jax_arx.all_gather(v, "x", tiled=True), P("x")))
    # Each device's block: the sum of the rows (exact: small integers), and
    # every rank's row.
    wants = (rows.sum(0, dtype=np.float32)[None], rows)
    client = _compat.distributed_client()
    return {"episodes": [_episode(jax, jax_arx, mesh, client, k, fns, x, wants) for k in range(episodes)]}


if __name__ == "__main__" and "--worker" in sys.argv:
    suite = sys.argv[sys.argv.index("--worker") + 1]
    if os.environ.get("ARX_TEST_GPUS"):
        import gpu_common

        gpu_common.place_rank()  # before jax starts its backend
    print(launched.RESULT + json.dumps(_worker(int(suite.split(":")[1]))), flush=True)
