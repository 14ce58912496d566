"""jax_arx.stats() and concurrent calls, on the CPU backend with the real C++
core, across 2 processes (``python -m jax_arx.launch``; each test launches
this file as its worker, ``--worker SUITE``).

- ``stats``: the counters against what the worker did, exactly: psum
  three times, a pytree psum of two leaves, all_gather twice, psum_scatter
  and the fused MoE combine (the ``moe_fused`` tuning: the kernel itself,
  so no plan steps aside) once each, a psum that falls back (int32: one
  fallback, counted when traced, however often it runs); then rank 1 comes
  4 s late to a psum (a stall on rank 0, reported in words); then the ranks
  issue psums of different sizes (a failed call on each, the endpoints'
  failure messages). After shutdown() no communicator is left.
- ``threads``: two threads of each rank call the same jitted psum at once,
  many times. Collectives from several threads have no order every rank
  agrees on: calls that overlap on one endpoint fail (all of them, on every
  rank: the endpoint fails and tells its peers), and docs/failures.md says that
  calls that merely follow each other in different orders can be summed
  into each other. The test asserts what holds whatever the scheduling:
  a call that returns a sum and is not followed by a failure of its
  thread's rank got its own; a failure says what happened.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import pytest

import launched

THIS = os.path.abspath(__file__)
LATE_S = 4  # how late rank 1 comes to a psum: past the watchdog's 2 s


@pytest.fixture(scope="module")
def core_built(tmp_path_factory):
    reason = launched.core_is_installed(tmp_path_factory.mktemp("probe"))
    if reason:
        pytest.skip(reason)


def _op(calls, nbytes, algorithms, failed=0):
    return {"calls": calls, "bytes": nbytes, "failed": failed, "algorithms": algorithms}


_IDLE = {op: _op(0, 0, {}) for op in ("psum", "all_gather", "psum_scatter", "moe_combine_psum_scatter")}
# What the worker runs per rank (world 2; sizes in _suite_stats).
_RAN = {
    "psum": _op(3 + 2, 3 * 4000 + 7 * 2 + 5 * 2, {"one_shot": 5}),
    "all_gather": _op(2, 2 * 64 * 4, {"bulk": 2}),
    "psum_scatter": _op(1, 32 * 4, {"bulk": 1}),
    "moe_combine_psum_scatter": _op(1, 4 * 128 * 2, {"bulk": 1}),
}


def test_stats_count_what_ran(core_built, tmp_path):
    results = launched.run_suite(
        THIS, "stats", 2, "shm", tmp_path, env={"JAX_ARX_PREFILL_SLOT_BYTES": "256K", "JAX_ARX_TIMEOUT_S": "20"}
    )
    for rank, r in results.items():
        first = r["first"]
        assert first["transport"] == "shm" and first["world"] == 2, first
        assert first["ops"] == _IDLE and first["relayed_puts"] == 0, first
        (ep,) = first["endpoints"]
        assert (ep["rank"], ep["group"], ep["failure"], ep["last_stall"]) == (rank, 0, None, None), ep
        ran = r["ran"]
        assert ran["ops"] == _RAN and ran["endpoints"][0]["ops"] == _RAN, ran
        # One fallback, traced once and run twice.
        assert r["fallbacks"] == {"psum": {"dtype int32 is not supported (float32, bfloat16 and float16 are)": 1}}
        assert r["plans"] == {}, r["plans"]
        late = r["late"]
        assert late["ops"]["psum"]["calls"] == 6, late
        failed = r["failed"]
        assert failed["ops"]["psum"] == _op(
            7, _RAN["psum"]["bytes"] + 4000 + (1000 + rank) * 4, {"one_shot": 7}, failed=1
        ), failed
        failure = failed["endpoints"][0]["failure"]
        assert failure and ("different collective" in failure), failed
        assert r["after_shutdown"] == {}, r
    # Rank 0 waited 4 s for rank 1: a stall, reported in words.
    late = results[0]["late"]
    assert late["stalls"] >= 1, late
    report = late["endpoints"][0]["last_stall"]
    assert "no progress for" in report and "rank 1: psum #" in report, report


_OVERLAP = "began while another collective of this endpoint was still running"


def test_collectives_from_two_threads_at_once_fail_on_every_rank(core_built, tmp_path):
    results = launched.run_suite(THIS, "threads", 2, "shm", tmp_path, env={"JAX_ARX_TIMEOUT_S": "20"})
    # Every rank failed (its own guard caught two psums at once, or a peer
    # told it), at least one through the guard; check() raises it after.
    assert any(_OVERLAP in e for r in results.values() for e in r["errors"]), results
    for rank, r in results.items():
        assert r["errors"] and all(_OVERLAP in e or "and said so" in e for e in r["errors"]), (rank, r)
        assert r["check"] and r["failed_calls"] >= 1, (rank, r)


# --- the workers ------------------------------------------------------------------


def _suite_stats():
    w = launched.MeshWorker("tp", tuning={"moe_fused": 1})  # the fused combine's own counters
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    import ml_dtypes

    from jax_arx import _compat

    client = _compat.distributed_client()
    me, n = jax.process_index(), w.world

    def put(rows):
        g = np.stack(rows) if isinstance(rows, list) else rows
        return jax.make_array_from_callback(g.shape, w.sharded, lambda idx: g[idx])

    def comm():
        return jax_arx.stats()["communicators"]["tp"]

    report = {"first": comm()}
    # psum: 3 runs of a 1000-float partial, a pytree of two leaves once.
    f = w.smap(lambda x: jax_arx.psum(x, "tp"), P("tp"), P())
    x = put(np.ones((n, 1000), np.float32))
    for _ in range(3):
        f(x).block_until_ready()
    tree = {"a": put(np.ones((n, 7), ml_dtypes.bfloat16)), "b": put(np.ones((n, 5), np.float16))}
    jax.block_until_ready(w.smap(lambda t: jax_arx.psum(t, "tp"), (P("tp"),), P())(tree))
    # all_gather of 64 floats twice; psum_scatter to 32 floats; the combine once.
    g = w.smap(lambda v: jax_arx.all_gather(v, "tp", tiled=True), P("tp"), P("tp"))
    v = put(np.ones((n, 64), np.float32))
    for _ in range(2):
        g(v).block_until_ready()
    w.smap(lambda v: jax_arx.psum_scatter(v[0], "tp", tiled=True)[None], P("tp"), P("tp"))(
        put(np.ones((n, 32 * n), np.float32))
    ).block_until_ready()
    T, H, R, topk = 4 * n, 128, 8, 2
    moe = (
        put([np.ones((R, H), ml_dtypes.bfloat16)] * n),
        put([np.zeros((T, topk), np.int32)] * n),
        put([np.full((T, topk), 0.5, np.float32)] * n),
        put([np.ones((T, H), ml_dtypes.bfloat16)] * n),
    )
    w.smap(
        lambda y, pos, wt, shared: jax_arx.moe_combine_psum_scatter(y[0], pos[0], wt[0], shared[0], "tp")[None],
        (P("tp"),) * 4,
        P("tp"),
    )(*moe).block_until_ready()
    # A fallback: traced once, run twice (jax.lax's psum: gloo, run together).
    i32 = put(np.ones((n, 3), np.int32))
    lax = w.smap(lambda x: jax_arx.psum(x, "tp"), P("tp"), P())
    for _ in range(2):
        w.together(lax, i32)
    report["ran"] = comm()
    report["fallbacks"], report["plans"] = jax_arx.stats()["fallbacks"], jax_arx.stats()["plans"]

    # Rank 1 comes late to a psum: rank 0's watchdog reports the stall.
    client.wait_at_barrier("test_stats/late", 120_000)
    if me == 1:
        time.sleep(LATE_S)
    f(x).block_until_ready()
    report["late"] = comm()

    # Different sizes: a mismatch, a failed call on each rank.
    y = jax.make_array_from_callback((n, 1000 + me), w.sharded, lambda idx: np.ones((1, 1000 + me), np.float32))
    try:
        f(y).block_until_ready()
    except Exception:
        pass
    report["failed"] = comm()
    jax_arx.shutdown()
    report["after_shutdown"] = jax_arx.stats()["communicators"]
    return report


def _suite_threads(calls=200):
    """Two threads call the same jitted psum, each with its own input, until
    a call fails (or ``calls`` each). Reports the errors."""
    w = launched.MeshWorker("tp")
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    n = w.world
    f = w.smap(lambda x: jax_arx.psum(x, "tp"), P("tp"), P())
    xs = [
        jax.make_array_from_callback((n, 4096), w.sharded, lambda idx, t=t: np.full((1, 4096), t + 1, np.float32))
        for t in range(2)
    ]
    for x in xs:
        f(x).block_until_ready()
    errors, lock = [], threading.Lock()
    start = threading.Barrier(2)

    def run(t):
        start.wait()
        for _ in range(calls):
            try:
                f(xs[t]).block_until_ready()
            except Exception as e:
                with lock:
                    errors.append(str(e))
                return

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        jax_arx.check()
        check = ""
    except jax_arx.CollectiveError as e:
        check = str(e)
    failed = jax_arx.stats()["communicators"]["tp"]["ops"]["psum"]["failed"]
    return {"errors": errors, "check": check, "failed_calls": failed}


if __name__ == "__main__" and "--worker" in sys.argv:
    suite = sys.argv[sys.argv.index("--worker") + 1]
    print(launched.RESULT + json.dumps({"stats": _suite_stats, "threads": _suite_threads}[suite]()), flush=True)
