"""The real C++ core, across processes, for what the in-process unit tests
cover over the stand-in core (tests/stand_in_core.py): meshes of two axes,
the bulk ops switched off, and JAX_ARX_ON_FAILURE=abort.

Each test launches this file as a worker under ``python -m jax_arx.launch``
(``--worker SUITE``), as tests/test_psum_cpu.py does, and asserts on each
rank's ``RESULT {json}`` line:

- ``mesh2d`` (2 processes x 2 CPU devices): a 2 x 2 mesh, first with the
  processes along its first axis (``dp``: across processes over the
  carrier, ``tp``: within each process), then transposed (``x`` within,
  ``y`` across). jax_arx.psum over each axis (one jax_arx call, which each
  endpoint's stats count), over both one after the other (two), and over
  both at once (a tuple of axes: left to jax.lax with one log line); every
  result bit for bit against the numpy rank-order sum (small integers for
  jax.lax's, which may add in another order).
- ``no_bulk`` (2 processes, JAX_ARX_PREFILL_SLOT_BYTES=0): all_gather,
  psum_scatter and the fused MoE combine all run as jax.lax's (no jax_arx
  call lowered, none counted, one log line each naming the variable), with
  the numpy references' results; psum still runs in jax_arx; with
  JAX_ARX_FALLBACK=error each bulk op raises.
- ``abort`` (2 processes, JAX_ARX_ON_FAILURE=abort, a 3 s timeout): rank 0
  calls a psum rank 1 never joins: rank 0's process exits with status 1,
  after the timeout and within twice it, printing the failure (naming rank
  1) and the reason it exits; the call never returns.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise (failed in CI: tests/needs.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

import launched

THIS = os.path.abspath(__file__)
RESULT = launched.RESULT
ABORT_TIMEOUT_S = 3.0
GRACE_S = 2  # the launcher's for the other ranks, once one failed


# --- the tests -------------------------------------------------------------------


def test_psum_over_each_axis_of_a_two_by_two_mesh(core_built, tmp_path):
    results = launched.run_suite(THIS, "mesh2d", 2, "shm", tmp_path, cpu_devices=2)
    launched.assert_all_correct(
        results, expect=["dp", "tp", "dp_then_tp", "dp_tp_at_once", "x", "y", "x_then_y", "x_y_at_once"]
    )
    for r in results.values():
        # Each axis of size 2 is a communicator; every process has an
        # endpoint in it for each of its devices.
        assert r["endpoints"] == {"dp": 2, "tp": 2, "x": 2, "y": 2}, r["endpoints"]
        # psum over one axis: one call per endpoint; one after the other:
        # one on each axis's endpoints; both at once: none (jax.lax).
        assert r["ran"] == {
            "dp": [1, 0],
            "tp": [0, 1],
            "dp_then_tp": [1, 1],
            "dp_tp_at_once": [0, 0],
            "x": [1, 0],
            "y": [0, 1],
            "x_then_y": [1, 1],
            "x_y_at_once": [0, 0],
        }, r["ran"]
        assert len(r["logged"]) == 2 and all("several mesh axes at once" in line for line in r["logged"]), r


def test_no_prefill_slot_leaves_the_bulk_ops_to_jax_lax(core_built, tmp_path):
    results = launched.run_suite(THIS, "no_bulk", 2, "shm", tmp_path, env={"JAX_ARX_PREFILL_SLOT_BYTES": "0"})
    launched.assert_all_correct(results, expect=["all_gather", "psum_scatter", "moe", "psum"])
    for r in results.values():
        assert r["lowered"] == {"all_gather": 0, "psum_scatter": 0, "moe": 0, "psum": 1}, r["lowered"]
        assert r["calls"] == {"psum": 1, "all_gather": 0, "psum_scatter": 0, "moe_combine_psum_scatter": 0}, r
        for op in ("all_gather", "psum_scatter", "moe_combine_psum_scatter"):
            lines = [line for line in r["logged"] if line.startswith(f"jax_arx.{op}:")]
            assert len(lines) == 1 and "more than JAX_ARX_PREFILL_SLOT_BYTES=0" in lines[0], (op, r["logged"])
            assert "JAX_ARX_PREFILL_SLOT_BYTES" in r["raised"][op], r["raised"]


def test_on_failure_abort_ends_the_process_with_the_failure(core_built, tmp_path):
    env = launched.clean_env(
        {"JAX_ARX_ON_FAILURE": "abort", "JAX_ARX_TIMEOUT_S": str(ABORT_TIMEOUT_S), "JAX_ARX_TRANSPORT": "shm"}
    )
    cmd = launched.launcher_cmd(2, 1, THIS, "--worker", "abort", grace_s=GRACE_S)
    p = launched.run_launcher(cmd, env, tmp_path, 300)
    ended = time.time()
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-4000:]
    # Rank 0 ends with status 1. Rank 1 then loses jax's coordination
    # service, which lives in rank 0's process, and exits with status 1
    # too: on a loaded machine rank 0's many threads may take longer to
    # end than rank 1 takes to notice, and the launcher then sees rank 1's
    # end first. Rank 0's own abort is checked in its lines below.
    first = re.search(r"\[launch\] rank (\d+) failed first \(([^)]*)\)", p.stderr)
    assert first and first.group(2) == "exited with status 1", out[-4000:]
    if first.group(1) != "0":
        assert first.group(1) == "1" and "Socket closed" in p.stderr, out[-4000:]
    called = re.search(r"\[rank 0\] CALLING (\d+\.\d+)", p.stdout)
    assert called and "RETURNED" not in p.stdout, out[-4000:]
    # From the call to the launcher's end: the timeout, then the exit, then
    # at most the launcher's grace for rank 1.
    seconds = ended - float(called.group(1))
    assert ABORT_TIMEOUT_S <= seconds <= 2 * ABORT_TIMEOUT_S + GRACE_S, (seconds, out[-4000:])
    rank0 = "\n".join(line for line in p.stderr.splitlines() if line.startswith("[rank 0]"))
    assert "rank 1" in rank0 and "timed out" in rank0, rank0[-3000:]
    assert "jax_arx: exiting because JAX_ARX_ON_FAILURE=abort" in rank0, rank0[-3000:]


# --- the workers --------------------------------------------------------------------
# Everything below runs in the worker processes only.


class _Report:
    """What a worker checked, by case (launched.assert_all_correct's form),
    and the jax_arx log lines it saw."""

    def __init__(self):
        import logging

        self.cases: dict[str, dict] = {}
        self.logged: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.logged.append(record.getMessage())
        logging.getLogger("jax_arx").addHandler(handler)

    def check(self, case, got, want, what):
        """``got`` is ``want``, bit for bit."""
        got = np.asarray(got)
        want = np.asarray(want, dtype=got.dtype).reshape(got.shape)
        self._record(
            case,
            None
            if got.tobytes() == want.tobytes()
            else f"{what}: {int((got != want).sum())} of {got.size} elements differ",
        )

    def close(self, case, got, want, what):
        """``got`` is ``want`` to within bfloat16's rounding."""
        ok = np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
        self._record(case, None if ok else f"{what}: not close to the reference")

    def _record(self, case, bad):
        entry = self.cases.setdefault(case, {"checked": 0, "bad": []})
        entry["checked"] += 1
        if bad:
            entry["bad"].append(bad)


def _stats(axes):
    from jax_arx import _comm

    return {a: sum(le.endpoint.stats()["calls"]["psum"] for le in _comm.communicator(a).endpoints) for a in axes}


def suite_mesh2d():
    import jax_arx

    jax_arx.distributed_initialize()
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    rep = _Report()
    ran, endpoints = {}, {}
    n = 1001
    rng = np.random.default_rng(5)
    g = rng.normal(size=(2, 2, n)).astype(np.float32)  # device (i, j) of the grid holds g[i, j]
    ints = rng.integers(-50, 50, size=(2, 2, n)).astype(np.float32)
    grid = np.array(jax.devices()).reshape(2, 2)  # row p: process p's devices
    for names, devices in ((("dp", "tp"), grid), (("x", "y"), grid.T)):
        a0, a1 = names
        mesh = Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)
        jax_arx.initialize(mesh)
        from jax_arx import _comm

        endpoints.update({a: len(_comm.communicator(a).endpoints) for a in names})
        sharding = NamedSharding(mesh, P(a0, a1))
        # The global array's block (i, j) sits on mesh position (i, j).
        put = lambda v: jax.make_array_from_callback(v.shape, sharding, lambda idx: v[idx])  # noqa: B023
        sums = {
            a0: lambda v: jax_arx.psum(v, a0),  # noqa: B023
            a1: lambda v: jax_arx.psum(v, a1),  # noqa: B023
            f"{a0}_then_{a1}": lambda v: jax_arx.psum(jax_arx.psum(v, a0), a1),  # noqa: B023
            f"{a0}_{a1}_at_once": lambda v: jax_arx.psum(v, (a0, a1)),  # noqa: B023
        }
        # The numpy rank-order sums (position order along the axis).
        want = {
            a0: lambda v: np.broadcast_to(v[0] + v[1], v.shape),
            a1: lambda v: np.broadcast_to((v[:, 0] + v[:, 1])[:, None], v.shape),
            f"{a0}_then_{a1}": lambda v: np.broadcast_to((v[0, 0] + v[1, 0]) + (v[0, 1] + v[1, 1]), v.shape),
            f"{a0}_{a1}_at_once": lambda v: np.broadcast_to(v.sum(axis=(0, 1)), v.shape),
        }
        for case, body in sums.items():
            data = ints if case.endswith("at_once") else g  # jax.lax's may add in another order
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(a0, a1), out_specs=P(a0, a1), check_vma=False))
            x = put(data)
            compiled = f.lower(x).compile()
            _start_together(case)  # jax.lax's gloo waits give up after a fixed time: start together
            before = _stats(names)
            out = jax.block_until_ready(compiled(x))  # every handler has run
            after = _stats(names)
            ran[case] = [int(after[a] - before[a]) // len(_comm.communicator(a).endpoints) for a in names]
            ref = want[case](data)
            for shard in out.addressable_shards:
                i, j = (s.start or 0 for s in shard.index[:2])
                rep.check(case, np.asarray(shard.data)[0, 0], ref[i, j], f"device {shard.device.id}")
    print(
        RESULT
        + json.dumps(
            {
                "cases": rep.cases,
                "ran": ran,
                "endpoints": endpoints,
                "logged": [m for m in rep.logged if "several mesh axes" in m],
            }
        ),
        flush=True,
    )
    jax_arx.shutdown()


def _start_together(name):
    from jax_arx import _compat

    _compat.distributed_client().wait_at_barrier(f"test_core_cpu/{name}", 600_000)


def suite_no_bulk():
    import bulk_cases as prefill

    w = prefill._Worker()
    jax, jax_arx, P, put, lift = w.jax, w.jax_arx, w.P, w.put, prefill._lift
    rep = _Report()
    n = w.world
    rng = np.random.default_rng(7)
    ints = [rng.integers(-100, 100, size=(4 * n, 3)).astype(np.float32) for _ in range(n)]  # exact in any order
    y, scales, pos, wt, shared = prefill._moe_inputs(rng, w, 2 * n + 1, 9, 128, 2, False)
    programs = {
        "all_gather": (lambda v: jax_arx.all_gather(v, "sp", tiled=True), [put(ints)]),
        "psum_scatter": (lambda v: jax_arx.psum_scatter(v, "sp", tiled=True), [put(ints)]),
        "moe": (lambda *a: jax_arx.moe_combine_psum_scatter(*a, "sp"), [put(y), put(pos), put(wt), put(shared)]),
        "psum": (lambda v: jax_arx.psum(v, "sp"), [put(ints)]),
    }
    targets = {
        "all_gather": "jax_arx_all_gather",
        "psum_scatter": "jax_arx_psum_scatter",
        "moe": "jax_arx_moe_combine_psum_scatter",
        "psum": "jax_arx_psum",
    }
    lowered, outs = {}, {}
    from jax_arx import _comm

    ep = _comm.communicator("sp").endpoints[0].endpoint
    before = ep.stats()["calls"]
    for case, (body, args) in programs.items():
        f = w.smap(lift(body), (P("sp"),) * len(args), P("sp"))
        lowered[case] = len(w.calls(f, *args, target=targets[case]))
        outs[case] = jax.block_until_ready(w.together(f, *args))
    after = ep.stats()["calls"]
    me = w.jax.process_index()
    rep.check("all_gather", w.mine(outs["all_gather"])[me], np.concatenate(ints), "rank's gather")
    rep.check(
        "psum_scatter", w.mine(outs["psum_scatter"])[me], prefill.reference_scatter(ints, 0, True, me), "rank's block"
    )
    tpad = -(-(2 * n + 1) // n) * n
    combined = [prefill.reference_combine(y[r], pos[r], wt[r], shared[r], None, tpad) for r in range(n)]
    # gloo's bfloat16 sum: close to the reference, not necessarily its bits.
    rep.close("moe", w.mine(outs["moe"])[me], prefill.reference_scatter(combined, 0, True, me), "rank's rows")
    rep.check("psum", w.mine(outs["psum"])[me], sum(ints[1:], ints[0]), "rank's sum")
    raised = {}
    os.environ["JAX_ARX_FALLBACK"] = "error"
    for case, op in (
        ("all_gather", "all_gather"),
        ("psum_scatter", "psum_scatter"),
        ("moe", "moe_combine_psum_scatter"),
    ):
        body, args = programs[case]
        try:
            w.smap(lift(body), (P("sp"),) * len(args), P("sp")).lower(*args)
            raised[op] = ""
        except jax_arx.JaxArxFallbackError as e:
            raised[op] = str(e)
    del os.environ["JAX_ARX_FALLBACK"]
    print(
        RESULT
        + json.dumps(
            {
                "cases": rep.cases,
                "lowered": lowered,
                "raised": raised,
                "calls": {k: after[k] - before[k] for k in after},
                "logged": [m for m in rep.logged if m.startswith("jax_arx.")],
            }
        ),
        flush=True,
    )


def suite_abort():
    w = launched.MeshWorker("sp")
    jax_arx, P = w.jax_arx, w.P
    f = w.smap(lambda v: jax_arx.psum(v, "sp"), P("sp"), P("sp"))
    x = w.jax.make_array_from_callback((w.world, 64), w.sharded, lambda idx: np.ones((1, 64), np.float32))
    compiled = f.lower(x).compile()
    if w.jax.process_index() != 0:
        # Never joins; stays up (its endpoint open) until the launcher stops it.
        from jax_arx import _compat

        _compat.distributed_client().blocking_key_value_get("test_core_cpu/never", 120_000)
        return
    print(f"CALLING {time.time():.3f}", flush=True)
    np.asarray(compiled(x))
    print("RETURNED", flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    {"mesh2d": suite_mesh2d, "no_bulk": suite_no_bulk, "abort": suite_abort}[sys.argv[sys.argv.index("--worker") + 1]]()
