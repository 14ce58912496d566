"""Ring mode (``jax_arx.initialize(mesh, topology="ring")``, JAX_ARX_TOPOLOGY=ring)
on the CPU backend, with the real C++ core, across processes.

In a ring a rank has links to its previous and next rank only; at world 4
what goes to the rank two away is relayed by the rank in between
(ffi/comm/relay.h). One launch per carrier (shm, tcp) and world (2, 3 and 4
processes, as tests/test_psum_cpu.py launches its workers): every rank runs
the same programs twice, first in a ring, then, after ``jax_arx.shutdown()``,
in a mesh (at world 4 the ring only: ``topologies``), and reports per
topology:

- every result against the numpy references of tests/bulk_reference.py
  (the float32 rank-order sum from rank 0's element, rounded once; the
  gathered blocks), bit for bit: psum (the host device side's one-shot; the
  two-shot runs on GPUs only, tests/test_gpu_psum.py's ring phases), from one
  element to the slot, in float32, bfloat16 and float16, led by signed zeros;
  all_gather; psum_scatter; the fused MoE combine
  (``jax_arx.moe_combine_psum_scatter``);
- ``bursts``: 20 bursts of one program of 16 collectives of every kind, some
  dependent on others, fresh inputs each time: the relay records and lanes
  are reused over and over (a relay ring holds kRing records);
- a CRC of every result, which must be the same in the ring and in the mesh;
- what the proxies relayed (``Endpoint.stats()["relayed_puts"]``): at world 4 in
  the ring, every rank forwarded its previous rank's puts; elsewhere none.

Failures, over tcp (``JAX_ARX_TIMEOUT_S=5``):

- ``mismatch`` (2 processes): process 0 sets up a mesh, process 1 a ring:
  initialize fails on both, saying that JAX_ARX_TOPOLOGY differs;
- ``relay_lost`` (a ring of 4): after a few exact psums rank 1, which relays
  for rank 0, exits without a word; every other rank's next psum fails
  within about the timeout (an error, or NaN and then an error from
  jax_arx.check()), never a result, and its neighbours name it.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import numpy as np
import pytest

import launched

THIS = os.path.abspath(__file__)
RESULT = launched.RESULT
SLOT_BYTES = 64 * 1024  # JAX_ARX_SLOT_BYTES in the workers: the one-shot limit
PREFILL_SLOT_BYTES = 256 * 1024  # JAX_ARX_PREFILL_SLOT_BYTES
TOPOLOGIES = ("ring", "mesh")


def topologies(world):
    """The topologies a launch of ``world`` runs. At world 4 the ring alone:
    its results are checked bit for bit against the same references as the
    mesh's, and a mesh of four processes is tests/test_psum_cpu.py's and
    tests/test_prefill_cpu.py's (the mesh half took half of this slow
    test's two minutes)."""
    return TOPOLOGIES if world < 4 else TOPOLOGIES[:1]


CASES = ["psum", "gather", "scatter", "moe", "bursts"]
BURSTS, BURST_OPS = 20, 16
LOST_TIMEOUT_S = 5  # JAX_ARX_TIMEOUT_S of relay_lost


# --- the tests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def core_built(tmp_path_factory):
    reason = launched.core_is_installed(tmp_path_factory.mktemp("probe"))
    if reason:
        pytest.skip(reason)


# World 4 (the relays, through processes) is a slow suite's; the fast tier
# has the relays through tests/cpp/test_core.cc's ring, ranks as threads.
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ring_is_the_mesh_bit_for_bit(core_built, tmp_path, transport, world):
    results = launched.run_suite(
        THIS,
        "ring",
        world,
        transport,
        tmp_path,
        timeout=600,
        env={
            "JAX_ARX_SLOT_BYTES": str(SLOT_BYTES),
            "JAX_ARX_TIMEOUT_S": "60",
            "JAX_ARX_PREFILL_SLOT_BYTES": str(PREFILL_SLOT_BYTES),
        },
    )
    for topology in topologies(world):
        launched.assert_all_correct({rank: r[topology] for rank, r in results.items()}, expect=CASES)
    for rank, r in results.items():
        assert sorted(r) == sorted(topologies(world)), (rank, sorted(r))
        ring = r["ring"]
        assert ring["transport"] == transport and ring["topology"] == "ring", r
        assert ring["bursts"] == BURSTS * BURST_OPS, ring
        if "mesh" in r:
            mesh = r["mesh"]
            assert mesh["transport"] == transport and mesh["topology"] == "mesh", r
            # The same bits, case by case, whichever way the bytes went.
            assert ring["digests"] == mesh["digests"], (rank, ring["digests"], mesh["digests"])
            assert mesh["relayed"] == 0, (rank, mesh["relayed"])
        if world == 4:
            # Every rank relays what its previous rank sends two ranks on:
            # at least a record per collective.
            assert ring["relayed"] >= ring["collectives"], (rank, ring["relayed"], ring["collectives"])
        else:
            assert ring["relayed"] == 0, (rank, ring["relayed"])  # every rank is a neighbour


def test_topologies_that_differ_fail_initialize(core_built, tmp_path):
    results = launched.run_suite(THIS, "mismatch", 2, "tcp", tmp_path, env={"JAX_ARX_TIMEOUT_S": "60"})
    for rank, r in results.items():
        assert r["error"], (rank, r)
        assert "cabled as a" in r["error"] and "set JAX_ARX_TOPOLOGY the same everywhere" in r["error"], (rank, r)


def test_a_lost_relay_fails_every_rank_within_the_timeout(core_built, tmp_path):
    results = launched.run_suite(THIS, "relay_lost", 4, "tcp", tmp_path, env={"JAX_ARX_TIMEOUT_S": str(LOST_TIMEOUT_S)})
    assert results[1] == {"exited": True}, results[1]
    for rank in (0, 2, 3):
        r = results[rank]
        assert r["good"] == 3 and not r["finite"], (rank, r)  # never a result without rank 1
        assert r["error"] and r["check"], (rank, r)
        assert r["seconds"] < 2 * LOST_TIMEOUT_S + 5, (rank, r)
    for rank in (0, 2):  # rank 1's neighbours: their links to it broke
        assert "rank 1" in results[rank]["error"] + results[rank]["check"], (rank, results[rank])


# --- the worker -------------------------------------------------------------------
# Everything below runs in the worker processes only.


def _worker():
    import bulk_cases as suites

    class Worker(suites._Worker):
        """bulk_cases' worker (a 1-D mesh "sp" of every device, its
        numpy-checked cases, without the comparisons with jax.lax), with a
        CRC of the results of each case."""

        against_lax = False

        def __init__(self):
            super().__init__()
            self.digests: dict[str, int] = {}

        def check(self, case, got, want, what):
            super().check(case, got, want, what)
            self.digests[case] = zlib.crc32(np.ascontiguousarray(got).tobytes(), self.digests.get(case, 0))

    return Worker()


def case_psum(w):
    """One program of independent psums: three dtypes, counts from one
    element to the slot, odd ones, led by signed zeros."""
    import gpu_common
    from bulk_cases import _dtypes, _lift, reference_sum

    specs = [
        (name, c)
        for name in ("float32", "bfloat16", "float16")
        for c in (
            1,
            3,
            17,
            1001,
            4099,
            SLOT_BYTES // _dtypes()[name].itemsize - 1,
            SLOT_BYTES // _dtypes()[name].itemsize,
        )
    ]
    parts = [
        gpu_common.signed_inputs(_dtypes()[name], c, w.world, seed=zlib.crc32(f"{name}/{c}".encode()))
        for name, c in specs
    ]
    f = w.smap(
        _lift(lambda *xs: tuple(w.jax_arx.psum(x, "sp") for x in xs)),
        (w.P("sp"),) * len(specs),
        (w.P("sp"),) * len(specs),
        check_vma=False,
    )
    if len(w.calls(f, *[w.put(p) for p in parts], target="jax_arx_psum")) != len(specs):
        w.fail("psum", "not every psum lowered to jax_arx")
    for (name, c), p, out in zip(specs, parts, f(*[w.put(p) for p in parts]), strict=True):
        for r, got in w.mine(out).items():
            w.check("psum", got, reference_sum(p), f"{name}[{c}] rank {r}")


def case_bursts(w, bursts=BURSTS):
    """``bursts`` runs of one program of 16 collectives (psums, all_gathers,
    psum_scatters, a fused MoE combine; some dependent on others), each with
    fresh inputs, every result checked. Returns the collectives run."""
    import ml_dtypes

    from bulk_cases import (
        _lift,
        _moe_inputs,
        random_array,
        reference_combine,
        reference_gather,
        reference_scatter,
        reference_sum,
    )

    jax_arx, n = w.jax_arx, w.world
    bf16 = np.dtype(ml_dtypes.bfloat16)
    T, R, H, topk = 2 * n + 1, 24, 128, 3

    def body(a, b, c, d, y, pos, wt, shared):
        out = []
        for i in range(3):
            s = jax_arx.psum_scatter(c, "sp", tiled=True)
            out += [
                jax_arx.psum(a * (i + 1), "sp"),
                jax_arx.all_gather(b, "sp", axis=i % 2, tiled=True),
                s,
                jax_arx.all_gather(s, "sp", tiled=True),
            ]  # the last depends on s
        m = jax_arx.moe_combine_psum_scatter(y, pos, wt, shared, "sp")
        out += [
            jax_arx.psum(d, "sp"),
            m,
            jax_arx.all_gather(m, "sp", tiled=True),
            jax_arx.psum(out[0] + out[8], "sp"),
        ]  # on two earlier psums
        return tuple(out)

    f = w.smap(_lift(body), (w.P("sp"),) * 8, (w.P("sp"),) * BURST_OPS, check_vma=False)
    rng = np.random.default_rng(20)
    for k in range(bursts):
        a = [random_array(rng, (5, 33), np.dtype(np.float32)) for _ in range(n)]
        b = [random_array(rng, (6, 7), bf16) for _ in range(n)]
        c = [random_array(rng, (n * 9, 4), np.dtype(np.float16)) for _ in range(n)]
        d = [random_array(rng, (3001,), bf16) for _ in range(n)]
        ys, _, poss, ws, shareds = _moe_inputs(rng, w, T, R, H, topk, e4m3=False)
        args = [w.put(x) for x in (a, b, c, d, ys, poss, ws, shareds)]
        if k == 0 and len(w.calls(f, *args)) != BURST_OPS:
            w.fail("bursts", f"{len(w.calls(f, *args))} jax_arx calls in the burst program, expected {BURST_OPS}")
        p = [reference_sum([x * np.float32(i + 1) for x in a]) for i in range(3)]
        s = [reference_scatter(c, 0, True, r) for r in range(n)]
        tpad = -(-T // n) * n
        combined = [reference_combine(ys[r], poss[r], ws[r], shareds[r], None, tpad) for r in range(n)]
        m = [reference_scatter(combined, 0, True, r) for r in range(n)]
        wants = []
        for i in range(3):
            wants += [
                lambda r, i=i, p=p: p[i],
                lambda r, i=i, b=b: reference_gather(b, i % 2, True),
                lambda r, s=s: s[r],
                lambda r, s=s: np.concatenate(s),
            ]
        wants += [
            lambda r, d=d: reference_sum(d),
            lambda r, m=m: m[r],
            lambda r, m=m: np.concatenate(m),
            lambda r, p=p: reference_sum([p[0] + p[2]] * n),
        ]
        for j, out in enumerate(f(*args)):
            for r, got in w.mine(out).items():
                w.check("bursts", got, wants[j](r), f"burst {k} output {j} rank {r}")
    return BURST_OPS * bursts


def run_topology(w, topology):
    """Every case with jax_arx initialized anew as ``topology``; the report."""
    import bulk_cases as suites
    from jax_arx import _comm

    w.jax_arx.shutdown()
    w.cases, w.digests = {}, {}
    w.jax_arx.initialize(w.mesh, topology=topology, _tuning=suites.MOE_FUSED)  # the fused combine itself
    comm = _comm.communicator("sp")
    stats = lambda: [le.endpoint.stats() for le in comm.endpoints]
    before = stats()
    case_psum(w)
    suites.case_gather(w, ("float32", "bfloat16", "int8"), shapes=((3, 5, 7), (1, 1, 1)))
    suites.case_scatter(w, ("float32", "bfloat16"))
    suites.case_moe(w, shapes=suites.MOE_SHAPES[1:3])
    bursts = case_bursts(w)
    after = stats()
    collectives = sum(sum(a["calls"].values()) - sum(b["calls"].values()) for a, b in zip(after, before, strict=True))
    w.jax_arx.check()
    return {
        "cases": w.cases,
        "digests": w.digests,
        "bursts": bursts,
        "collectives": collectives,
        "relayed": sum(a["relayed_puts"] - b["relayed_puts"] for a, b in zip(after, before, strict=True)),
        "topology": comm.topology,
        "transport": w.jax_arx.transport("sp"),
    }


def suite_mismatch():
    """Process 0 asks for a mesh, process 1 for a ring; both report what
    initialize raised. Process 1 reads process 0's connection details only
    once process 0 has failed (the order a loaded host can give): it must
    still name the mismatch, not wait out the timeout for them."""
    import jax_arx

    jax_arx.distributed_initialize()
    import jax

    from jax_arx import _compat, _store

    client, me = _compat.distributed_client(), jax.process_index()
    if me == 1:
        get = _store.Store.get

        def late_get(store, key, waiting_for):
            if key.endswith("/details/0"):
                client.blocking_key_value_get("test_ring_cpu/rank0_failed", 600_000)
            return get(store, key, waiting_for)

        _store.Store.get = late_get
    mesh = jax.make_mesh((jax.device_count(),), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    try:
        jax_arx.initialize(mesh, topology="ring" if me else "mesh")
        return {"error": ""}
    except jax_arx.InitializationError as e:
        return {"error": str(e)}
    finally:
        if me == 0:
            client.key_value_set("test_ring_cpu/rank0_failed", "1")


def suite_relay_lost(w):
    """A ring of 4: three exact psums, then rank 1 exits; the others call
    again until the call fails (see the module doc)."""
    import time

    from bulk_cases import _lift, reference_sum
    from jax_arx import _compat

    w.jax_arx.shutdown()
    w.jax_arx.initialize(w.mesh, topology="ring")
    parts = [np.full((4099,), r + 1, np.float32) for r in range(w.world)]
    f = w.smap(_lift(lambda v: w.jax_arx.psum(v, "sp")), w.P("sp"), w.P("sp"), check_vma=False)
    x = w.put(parts)
    good = sum(all(got.tobytes() == reference_sum(parts).tobytes() for got in w.mine(f(x)).values()) for _ in range(3))
    client, me = _compat.distributed_client(), w.jax.process_index()
    # Rank 1 finishing its calls is not its peers finishing theirs (it
    # relays for rank 0 after its own sum is done): it leaves once all have.
    client.key_value_set(f"test_ring_cpu/good{me}", "1")
    if me == 1:
        for r in range(w.world):
            client.blocking_key_value_get(f"test_ring_cpu/good{r}", 120_000)
        print(RESULT + json.dumps({"exited": True}), flush=True)
        client.key_value_set("test_ring_cpu/exiting", "1")
        os._exit(0)  # no shutdown, no word to the others
    client.blocking_key_value_get("test_ring_cpu/exiting", 120_000)
    time.sleep(0.5)  # the exit closes its sockets at once
    report = {"good": good, "finite": False, "error": "", "check": ""}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * LOST_TIMEOUT_S and not report["error"]:
        try:
            got = next(iter(w.mine(f(x)).values()))
            report["finite"] |= bool(np.isfinite(got).any())
            if np.isnan(got).all():
                break  # NaN: the call failed; check() says why
        except Exception as e:  # the handler's error, as jax raises it
            report["error"] = launched.error_text(e)
    report["seconds"] = time.monotonic() - t0
    try:
        w.jax_arx.check()
    except w.jax_arx.CollectiveError as e:
        report["check"] = str(e)
    report["error"] = report["error"] or report["check"]
    print(RESULT + json.dumps(report), flush=True)
    launched.leave_after_a_lost_peer("test_ring_cpu", [0, *range(2, w.world)])


def _worker_main(argv):
    suite = argv[argv.index("--worker") + 1]
    if suite == "mismatch":
        report = suite_mismatch()
    else:
        w = _worker()
        if suite == "relay_lost":
            suite_relay_lost(w)
        report = {topology: run_topology(w, topology) for topology in topologies(w.world)}
    print(RESULT + json.dumps(report), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main(sys.argv)
