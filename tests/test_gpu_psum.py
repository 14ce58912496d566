"""GPU tests of jax_arx.psum on NVIDIA GPUs: the one-shot (ffi/cuda/oneshot.cu),
the two-shot (twoshot.cu) and the LL one-shot (ll.cu), over every route to
the peers (ffi/cuda/attach.cc).

Marked ``gpu``. tests/gpu_common.py says when they run, where the ranks go
(processes share a GPU when there are fewer GPUs than ranks: all but two of
these tests run on one GPU) and how the workers report.

One launch per world size (2, 3 and 4 processes) runs these phases in turn,
each with jax_arx initialized anew with its settings; a test asserts on one
phase of one launch:

=====================  ===========================================  ==============================
phase                  settings                                     route (Endpoint.route)
=====================  ===========================================  ==============================
gpu_inboxes            the defaults                                 direct, GPU inboxes where every
                                                                    rank maps every peer's inbox;
                                                                    else direct, and the core says
                                                                    why in one log line
gpu_inboxes_required   JAX_ARX_CUDA_PEER_MEMORY=1; no LL, pieces    direct, GPU inboxes; where the
                       of 4 KiB (``_tuning``)                       default fell back, initialize
                                                                    must fail saying why
host_inboxes           JAX_ARX_CUDA_PEER_MEMORY=0; LL to 16 KiB     direct
proxy                  JAX_ARX_CUDA_DIRECT=0,                       proxy (shm carrier)
                       JAX_ARX_ONESHOT_MAX_BYTES=64 KiB
tcp                    JAX_ARX_TRANSPORT=tcp; pieces of 16 KiB      proxy (tcp carrier)
ring                   JAX_ARX_TOPOLOGY=ring                        proxy (shm carrier), links to
                                                                    prev and next only; at world 4
                                                                    every rank relays (Endpoint.
                                                                    stats()["relayed_puts"])
ring_tcp               JAX_ARX_TOPOLOGY=ring, JAX_ARX_TRANSPORT=    proxy (tcp carrier), likewise
                       tcp; pieces of 16 KiB
=====================  ===========================================  ==============================

The ring phases run in a launch of their own per world (``test_psum_ring``;
``python3 -m pytest -m gpu -k ring tests`` runs them alone): ranks that
share one GPU, cabled as a ring, the one-shot and the two-shot through the
proxy, relayed at world 4, with the same bits as the mesh (numpy's).

Each phase runs, in one process per rank:

- ``sizes``: float32, bfloat16 and float16 psums of odd and even counts
  from one element to the two-shot's limit (min(send, world x slot)), on
  both sides of the LL limits, the one-shot limit and the slot, in one
  program. Every result bit for bit against the reference (the fp32 sum in
  rank order from rank 0's element, rounded once; inputs led by signed
  zeros, over twelve binades so that the order shows) and the same on every
  rank. What the handlers ran (Endpoint.stats) against what the phase's
  settings make of each size; the pieces the plan cuts (Endpoint.plan);
- ``graph``: a program of 8 psums of LL, one-shot and two-shot sizes run
  21 times, every run checked. XLA command buffers are forced on at world 2
  and 4 (the CUDA graph replays: the handlers run far fewer times than the
  calls) and off at world 3 (once a call), so both modes are covered
  without more launches;
- ``loop``: 300 dependent one-shot psums in a fori_loop, past the 256 seqs
  after which the LL flag's seq bits wrap (and past the proxy's trigger
  ring), each checked on the device;
- ``aliased``: input and output one buffer, for each algorithm.
The first phase adds 30 dependent two-shot psums to ``loop``, and prefetch
operands (``prefetch``).

Two tests need two GPUs and are skipped on one: GPU inboxes mapped across
two devices (world 2 on two GPUs, JAX_ARX_CUDA_PEER_MEMORY=1), and one
process driving two GPUs.
"""

from __future__ import annotations

import collections
import os
import sys
import zlib

import numpy as np
import pytest

import gpu_common
from gpu_common import AXIS, CMDBUF_ON, GPU_INBOXES, HOST_INBOXES, PROXY

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
DTYPES = ("float32", "bfloat16", "float16")
LL_CAP = 128 << 10  # the LL one-shot's largest partial, its default limit (ffi/base/layout.h, kLLMaxPayload)
LL_PROXY = 8 << 10  # its default limit through the proxy (ffi/comm/plan.cc, kLLMaxProxy)
ALGORITHMS = {"one_shot": 1, "two_shot": 2, "ll": 3}  # Endpoint.plan's numbers (ffi/comm/plan.h)
PIECE_BYTES = (4096, 40000, 65536)  # partials whose pieces each phase asks the plan for

# name: (environment, _tuning)
PHASES = {
    "gpu_inboxes": ({}, {}),
    "gpu_inboxes_required": ({"JAX_ARX_CUDA_PEER_MEMORY": "1"}, {"cuda_ll_max_bytes": 0, "cuda_chunk_bytes": 4096}),
    "host_inboxes": ({"JAX_ARX_CUDA_PEER_MEMORY": "0"}, {"cuda_ll_max_bytes": 16384}),
    "proxy": ({"JAX_ARX_CUDA_DIRECT": "0", "JAX_ARX_ONESHOT_MAX_BYTES": "65536"}, {}),
    "tcp": ({"JAX_ARX_TRANSPORT": "tcp"}, {"cuda_chunk_bytes": 16384}),
    "ring": ({"JAX_ARX_TOPOLOGY": "ring"}, {}),
    "ring_tcp": ({"JAX_ARX_TOPOLOGY": "ring", "JAX_ARX_TRANSPORT": "tcp"}, {"cuda_chunk_bytes": 16384}),
}
SMOKE_PHASES = ("gpu_inboxes", "tcp", "ring")  # --cpu-smoke: the host device side's two routes, and a ring
CASES = ["sizes", "graph", "loop", "aliased"]


# --- the tests -------------------------------------------------------------------

# check_phase (below) asserts one phase of a launch.
test_psum, test_psum_ring = gpu_common.phase_tests(THIS, "psum", PHASES, lambda *a: check_phase(*a))


def test_gpu_inboxes_across_two_devices():
    gpu_common.require_gpus(2, why="GPU inboxes mapped across two devices, through their peer access")
    run = gpu_common.world_launch(THIS, "psum", 2)  # rank 0 on the first GPU, rank 1 on the second
    for phase in ("gpu_inboxes", "gpu_inboxes_required"):
        reports = run.phase(phase)
        assert {route for r in reports.values() for route in r["routes"].values()} == {GPU_INBOXES}, reports


def test_one_process_two_gpus(summary_line):
    gpus = gpu_common.require_gpus(2, why="one process driving two GPUs")
    phases = ("gpu_inboxes", "gpu_inboxes_required")
    run = gpu_common.run_workers(
        THIS,
        ["psum", "--phases", ",".join(phases)],
        None,
        gpu_common.gpu_env(gpus[:2], 2, {"XLA_FLAGS": CMDBUF_ON}, devices_per_process=2),
        timeout=300,
    )
    for phase in phases:
        reports = check_phase(run, phase, 2, summary_line)
        # Both endpoints of the process map each other's GPU inbox.
        assert set(reports[0]["routes"].values()) == {GPU_INBOXES}, reports[0]["routes"]


def check_phase(run, phase, world, summary_line):
    """Everything phase ``phase`` of ``run`` must show (see the module doc);
    returns its reports by rank. tests/test_gpu_workers_cpu.py checks its
    CPU runs with this too."""
    env, tuning = PHASES[phase]
    reports = run.phase(phase)
    assert sorted(reports) == list(range(world)), sorted(reports)
    first = reports[0]
    if first.get("init_error"):
        # Only where GPU inboxes cannot be mapped, which the default phase showed.
        default = {route for r in run.phase("gpu_inboxes").values() for route in r["routes"].values()}
        assert phase == "gpu_inboxes_required" and default == {HOST_INBOXES}, first["init_error"]
        for r in reports.values():
            assert "JAX_ARX_CUDA_PEER_MEMORY=1" in r["init_error"], r["init_error"]
        summary_line(
            f"psum world {world}: JAX_ARX_CUDA_PEER_MEMORY=1 refused, as it must be where GPU inboxes "
            f"cannot be mapped: {first['init_error'][:300]}"
        )
        return reports
    route = gpu_common.assert_route(run, reports, env, summary_line)
    gpu_common.assert_correct(reports, CASES + (["prefetch"] if phase == next(iter(PHASES)) else []))
    gpu_common.assert_relays(reports, env)
    # What ran: each size of the sizes program once, by the algorithm the
    # phase's settings make of it.
    want = collections.Counter(expected_algorithm(phase, n, first, route) for n in first["sizes"])
    assert None not in want, want
    for r in reports.values():
        gpu_common.assert_ran(r["ran"], {"psum": len(first["sizes"])}, "calls")
        gpu_common.assert_ran(r["ran"], want, "algorithms")
        gpu_common.assert_graph_calls(r["graph"], r["xla_flags"], r["platform"])
        for n in PIECE_BYTES:
            algorithm, pieces = r["plans"][str(n)]
            assert algorithm == ALGORITHMS[expected_algorithm(phase, n, first, route)], (n, r["plans"])
            want_pieces = expected_pieces(phase, n, first)
            assert pieces == want_pieces if want_pieces is not None else pieces >= 1, (n, pieces, tuning)
    return reports


def expected_algorithm(phase, nbytes, report, route):
    """What the settings of ``phase`` make of a psum of ``nbytes``: LL up to
    its limit (cuda_ll_max_bytes, at most LL's cap; unset, the cap direct
    and LL_PROXY through the proxy; on GPUs: direct, or through the proxy over a carrier that
    puts whole words -- shm, not tcp -- with no relay, the lines within the
    send buffer), the one-shot up to the slot (or
    JAX_ARX_ONESHOT_MAX_BYTES; unset, on GPU host inboxes, up to LL's cap),
    the two-shot up to min(send, world x slot) (GPUs); None: jax_arx does not
    take it."""
    env, tuning = PHASES[phase]
    slot, cuda = report["slot"], report["platform"] == "cuda"
    default_oneshot = min(LL_CAP, slot) if cuda and route == HOST_INBOXES else slot
    oneshot_max = min(int(env.get("JAX_ARX_ONESHOT_MAX_BYTES", default_oneshot)), slot)
    ll = tuning.get("cuda_ll_max_bytes", -1)
    relayed = env.get("JAX_ARX_TOPOLOGY") == "ring" and report["world"] == 4
    proxy_ll = env.get("JAX_ARX_TRANSPORT") != "tcp" and not relayed and 2 * -(-nbytes // 8) * 8 <= report["send"]
    ll = (
        0
        if not cuda or (route == PROXY and not proxy_ll)
        else (LL_PROXY if route == PROXY else LL_CAP)
        if ll < 0
        else min(ll, LL_CAP)
    )
    if nbytes <= oneshot_max:
        return "ll" if nbytes <= ll else "one_shot"
    return "two_shot" if cuda and nbytes <= min(report["send"], report["world"] * slot) else None


def expected_pieces(phase, nbytes, report):
    """The pieces of a one-shot on GPUs: of _tuning's cuda_chunk_bytes each,
    where set (PIECE_BYTES stay within every route's cap); None where a
    benchmark's default decides. One on the CPU."""
    chunk = PHASES[phase][1].get("cuda_chunk_bytes")
    if report["platform"] == "cpu":
        return 1
    return -(-nbytes // chunk) if chunk else None


# --- the worker ---------------------------------------------------------------------
# Everything below runs in the worker processes only.


def _dtype(name):
    import bulk_cases

    return bulk_cases._dtypes()[name]


def _counts(itemsize, slot, limit):
    """Odd and even counts of every dtype, across every limit up to ``limit`` bytes."""
    edges = (2, 6, 16, 48, 1000, 8192, 16384, 16400, 65536, 65552, LL_CAP, LL_CAP + 16, 262144, slot, slot + 16, limit)
    counts = {1, 3} | {c for b in edges for c in (b // itemsize, b // itemsize - 1)}
    return sorted(c for c in counts if c >= 1 and c * itemsize <= limit)


def _check_psums(w, case, specs, outs, parts):
    from bulk_cases import reference_sum

    for (name, count), p, out in zip(specs, parts, outs, strict=True):
        want = reference_sum(p)
        for r, got in w.mine(out).items():
            w.check(case, got, want, f"{name}[{count}] rank {r}")


def _psums(w, specs, seed):
    """One program of independent psums, one per (dtype, count) of specs, and its inputs."""
    from bulk_cases import _lift

    parts = [
        gpu_common.signed_inputs(_dtype(name), c, w.world, zlib.crc32(f"{seed}/{name}/{c}".encode()))
        for name, c in specs
    ]
    f = w.smap(
        _lift(lambda *xs: tuple(w.jax_arx.psum(x, AXIS) for x in xs)),
        (w.P(AXIS),) * len(specs),
        (w.P(AXIS),) * len(specs),
        check_vma=False,
    )
    return f, [w.put(p) for p in parts], parts


def case_sizes(w, slot, limit):
    """Every dtype, every count of _counts; returns the partials' bytes."""
    specs = [(name, c) for name in DTYPES for c in _counts(_dtype(name).itemsize, slot, limit)]
    f, xs, parts = _psums(w, specs, "sizes")
    _check_psums(w, "sizes", specs, f(*xs), parts)
    return [c * _dtype(name).itemsize for name, c in specs]


def case_graph(w, slot, twoshot, runs=20):
    """A program of 8 psums, run once and then ``runs`` times, each run
    checked; returns how often the handlers ran for the ``runs``."""
    big = [("float32", slot // 4 + 1001), ("bfloat16", slot // 2 + 3)] if twoshot else [("float32", 12345)] * 2
    specs = [
        ("bfloat16", 4099),
        ("float32", 1001),
        ("float16", 3),
        ("bfloat16", 200003),
        ("float32", 40000),
        ("float16", 70001),
    ] + big
    f, xs, parts = _psums(w, specs, "graph")
    _check_psums(w, "graph", specs, f(*xs), parts)
    calls = w.counted(lambda: [_check_psums(w, "graph", specs, f(*xs), parts) for _ in range(runs)])
    return {"ops": len(specs) * runs, "calls": {rank: s["calls"] for rank, s in calls.items()}}


def case_loop(w, steps, count):
    """``steps`` dependent psums of ``count`` floats in a fori_loop, each
    compared on the device with its exact sum (small integers)."""
    jax, jnp = w.jax, w.jax.numpy
    n = w.world

    def body(x):
        r = jax.lax.axis_index(AXIS).astype(jnp.float32)
        i = jnp.arange(count, dtype=jnp.float32)

        def step(k, err):
            kf = k.astype(jnp.float32)
            y = w.jax_arx.psum(kf + r + i, AXIS)
            return err + jnp.sum(jnp.abs(y - (n * kf + n * (n - 1) / 2 + n * i)))

        return jax.lax.fori_loop(0, steps, step, x[0] * 0)[None]

    out = w.smap(body, w.P(AXIS), w.P(AXIS), check_vma=False)(w.put([np.zeros(1, np.float32)] * n))
    for r, got in w.mine(out).items():
        w.check("loop", got, np.zeros(1, np.float32), f"sum of errors over {steps} psums of {count} floats, rank {r}")


def case_aliased(w, counts):
    """The psum call with its input and output one buffer (the kernels' in
    == out paths), one count per algorithm."""
    import jax

    from bulk_cases import _lift
    from jax_arx import _comm

    comm_id = _comm.communicator(AXIS).comm_id
    for c in counts:
        parts = gpu_common.signed_inputs(_dtype("bfloat16"), c, w.world, seed=c)
        call = lambda x: jax.ffi.ffi_call(
            "jax_arx_psum", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True, input_output_aliases={0: 0}
        )(x * 1, comm_id=np.int64(comm_id), site=np.int64(0))
        _check_psums(
            w,
            "aliased",
            [("bfloat16", c)],
            [w.smap(_lift(call), w.P(AXIS), w.P(AXIS), check_vma=False)(w.put(parts))],
            [parts],
        )


def case_prefetch(w, slot):
    """psum(prefetch=weights): the weights reach the call as operands (its
    ``prefetch`` attribute counts them) and change no bit."""
    jnp = w.jax.numpy
    from bulk_cases import _lift

    def body(x):
        weights = {
            "w": jnp.ones((1 << 20,), jnp.bfloat16) * x[0].astype(jnp.bfloat16),
            "b": jnp.ones((777,), jnp.float32),
        }
        return w.jax_arx.psum(x, AXIS, prefetch=weights)

    for name in DTYPES:
        # The last: a two-shot on GPUs (past the slot); the host side has none.
        for c in (5, 4097, 200001) + ((slot // _dtype(name).itemsize + 8,) if w.platform == "cuda" else ()):
            parts = gpu_common.signed_inputs(_dtype(name), c, w.world, seed=7 + c)
            f, x = w.smap(_lift(body), w.P(AXIS), w.P(AXIS), check_vma=False), w.put(parts)
            if not all("prefetch = 2" in line for line in w.calls(f, x, target="jax_arx_psum")):
                w.fail("prefetch", f"{name}[{c}]: the call was lowered without its 2 prefetch operands")
            _check_psums(w, "prefetch", [(name, c)], [f(x)], [parts])


def worker(argv):
    import jax_arx.config

    smoke = "--cpu-smoke" in argv
    names = gpu_common.worker_phases(argv, SMOKE_PHASES if smoke else gpu_common.mesh_phases(PHASES))
    w = gpu_common.GpuWorker(smoke)
    cuda = w.platform == "cuda"
    for name in names:
        error = w.phase(name, *PHASES[name])
        if error:
            w.report(init_error=error)
            continue
        cfg = jax_arx.config.load()
        slot, send = cfg.slot_bytes, cfg.send_bytes
        limit = min(send, w.world * slot) if cuda else slot  # the host device side has no two-shot
        sizes = []
        ran = w.counted(lambda sizes=sizes, slot=slot, limit=limit: sizes.extend(case_sizes(w, slot, limit)))
        endpoint = w.endpoints()[0].endpoint
        plans = {n: list(endpoint.plan("psum", n)[:2]) for n in PIECE_BYTES}
        graph = case_graph(w, slot, twoshot=cuda)
        case_loop(w, 300 if not smoke else 100, 2048)
        case_aliased(w, (4001, 100003) + ((slot // 2 + 8,) if cuda else ()))
        if name == next(iter(PHASES)):
            if cuda:
                case_loop(w, 30, (slot + 4096) // 4)
            case_prefetch(w, slot)
        w.report(sizes=sizes, ran=ran, plans=plans, graph=graph, slot=slot, send=send)
    w.jax_arx.check()


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    worker(sys.argv)
