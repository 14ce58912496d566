"""The worker of the bulk collectives' tests: ``python -m jax_arx.launch -n
N tests/bulk_cases.py --worker SUITE`` (tests/test_prefill_cpu.py launches
it; its docstring says what each suite covers). Every rank builds a 1-D mesh
"sp" over all devices, runs the suite's cases (many per launch: a launch
costs seconds) and prints one ``RESULT {json}`` line; each result is checked
bit for bit against tests/bulk_reference.py.

No reference uses a collective of jax's own; where a fallback runs one, the
program is compiled first and started together everywhere. The cases do not
depend on the backend: the GPU suites (tests/gpu_common.py,
tests/test_gpu_bulk.py) and tests/test_ring_cpu.py run them too, and take
the references from here with them.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import numpy as np

import launched
from bulk_reference import (
    _dtypes,
    _moe_inputs,
    random_array,  # noqa: F401 (importers take them from here)
    reference_combine,
    reference_gather,
    reference_scatter,
    reference_sum,
)

RESULT = launched.RESULT
PREFILL_SLOT_BYTES = 256 * 1024  # JAX_ARX_PREFILL_SLOT_BYTES in the workers (tests/test_prefill_cpu.py)
# The _tuning under which the MoE cases run the fused kernel itself: by
# default the plan steps aside for its unfused pair (ffi/comm/plan.cc,
# plan_moe_combine; case_moe_plan tests that).
MOE_FUSED = {"moe_fused": 1}


# --- the worker -------------------------------------------------------------------


class _Worker(launched.MeshWorker):
    def __init__(self):
        super().__init__("sp", tuning=MOE_FUSED)
        self.extra = {}  # what a case reports besides its checks (in the RESULT line)

    def put(self, parts):
        """A global array whose device ``r`` holds ``parts[r]`` (stacked along
        a new leading axis that the shard_map body does not see)."""
        g = np.stack(parts)
        return self.jax.make_array_from_callback(g.shape, self.sharded, lambda idx: g[idx])

    def mine(self, x):
        """This process's results of ``x`` (out_specs P("sp") on a leading
        axis of size 1 per device), by rank."""
        return {self.rank_of(s.device): np.asarray(s.data)[0] for s in x.addressable_shards}

    def rank_of(self, device):
        return list(self.mesh.devices.flat).index(device)

    def check(self, case, got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        same = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
        self.record(
            case,
            None
            if same
            else f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
            + (f", {int((got != want).sum())} elements differ" if got.shape == want.shape else ""),
        )

    def close(self, case, got, want, what, rtol, atol):
        near = np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)
        self.record(case, None if near else f"{what}: not close to the reference")


def _lift(fn):
    """fn on the unstacked per-device value (the shard_map body sees a
    leading axis of 1) and back."""

    def body(*xs):
        out = fn(*[x[0] for x in xs])
        return tuple(o[None] for o in out) if isinstance(out, tuple) else out[None]

    return body


GATHER_SPECS = ((0, False), (0, True), (1, True), (1, False), (2, True), (-1, False))


def _shm_mapped_bytes():
    """Bytes of this process's mappings of jax_arx's shared memory (its own
    regions and its peers', whose names are gone from /dev/shm once mapped)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/jax_arx-" in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                total += hi - lo
    return total


def case_first_use(w: _Worker):
    """Run first in a process: before the first bulk collective, the
    endpoints initialize() made hold no bulk lanes, no bulk endpoint exists,
    and over shm the process maps just those lane-less regions (its own and
    its peers': world per local device); psum runs and makes none. Then the
    first all_gather makes the bulk endpoints (lanes of a world-th of
    JAX_ARX_PREFILL_SLOT_BYTES, 4 x world of them), which account for all the
    shared memory mapped since, and runs; psum still runs after it."""
    from jax_arx import _comm, _registry

    jax_arx, P = w.jax_arx, w.P
    psum_eps = _comm.communicator("sp").endpoints
    shm = _comm.transport("sp") == "shm"
    region = sum(w.world * le.endpoint.region_bytes for le in psum_eps) if shm else 0
    mapped = _shm_mapped_bytes()
    w.record(
        "first_use",
        None
        if all(le.endpoint.bulk_lane_bytes == 0 for le in psum_eps)
        else f"initialize()'s endpoints hold bulk lanes of {[le.endpoint.bulk_lane_bytes for le in psum_eps]} bytes",
    )
    w.record(
        "first_use",
        None
        if mapped == region
        else f"before any bulk collective this process maps {mapped} bytes of /dev/shm/jax_arx-*, not the {region} "
        "of its lane-less regions",
    )
    rng = np.random.default_rng(1)
    parts = [random_array(rng, (1000,), np.dtype(np.float32)) for _ in range(w.world)]
    f = w.smap(_lift(lambda v: jax_arx.psum(v, "sp")), P("sp"), P("sp"))
    for r, got in w.mine(f(w.put(parts))).items():
        w.check("first_use", got, reference_sum(parts), f"psum before the first bulk collective, rank {r}")
    w.record("first_use", None if "sp" not in _registry._bulk_communicators else "psum made bulk endpoints")

    g = w.smap(_lift(lambda v: jax_arx.all_gather(v, "sp", tiled=True)), P("sp"), P("sp"))
    for r, got in w.mine(g(w.put(parts))).items():
        w.check("first_use", got, np.concatenate(parts), f"the first all_gather, rank {r}")
    bulk = _registry._bulk_communicators.get("sp")
    if bulk is None:
        w.fail("first_use", "the first all_gather made no bulk endpoints")
        return
    lane = -(-PREFILL_SLOT_BYTES // w.world // 16) * 16
    w.record(
        "first_use",
        None
        if all(
            le.endpoint.bulk_lane_bytes == lane and le.endpoint.region_bytes >= 4 * w.world * lane
            for le in bulk.endpoints
        )
        else f"bulk endpoints of lanes {[le.endpoint.bulk_lane_bytes for le in bulk.endpoints]} bytes, regions "
        f"{[le.endpoint.region_bytes for le in bulk.endpoints]}; want lanes of {lane}",
    )
    grown = _shm_mapped_bytes() - mapped
    want = sum(w.world * le.endpoint.region_bytes for le in bulk.endpoints) if shm else 0
    w.record(
        "first_use",
        None
        if grown == want
        else f"the bulk endpoints added {grown} bytes of /dev/shm mappings, not their regions' {want}",
    )
    for r, got in w.mine(f(w.put(parts))).items():
        w.check("first_use", got, reference_sum(parts), f"psum after the first bulk collective, rank {r}")


def case_gather(w: _Worker, dtype_names=None, shapes=((3, 5, 7), (1, 1, 1), (4, 129, 17))):
    """Every dtype, axis and tiling, one program per dtype; against numpy."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(2)
    for name in dtype_names or list(_dtypes()):
        dt = _dtypes()[name]
        parts = [[random_array(rng, s, dt) for _ in range(w.world)] for s in shapes]
        xs = [w.put(p) for p in parts]
        specs = [(i, a, t) for i in range(len(shapes)) for a, t in GATHER_SPECS]

        def body(*xs, gather, specs=specs):
            return tuple(gather(xs[i], "sp", axis=a, tiled=t) for i, a, t in specs)

        f = w.smap(_lift(partial(body, gather=jax_arx.all_gather)), (P("sp"),) * len(xs), (P("sp"),) * len(specs))
        n = len(w.calls(f, *xs, target="jax_arx_all_gather"))
        if n != len(specs):
            w.fail("gather", f"{name}: {n} jax_arx all_gathers for {len(specs)} calls")
        outs = f(*xs)
        for k, (i, a, t) in enumerate(specs):
            want = reference_gather(parts[i], a, t)
            for r, got in w.mine(outs[k]).items():
                w.check("gather", got, want, f"{name} {shapes[i]} axis {a} tiled {t} rank {r}")


def _scatter_shapes(world):
    # (per-rank input shape, dimension, tiled)
    return [
        ((world * 3, 5, 7), 0, True),
        ((3, world * 5, 7), 1, True),
        ((3, 5, world * 7), 2, True),
        ((world, 5, 7), 0, False),
        ((3, world, 7), 1, False),
        ((3, 5, world), -1, False),
        ((world * 37, 129), 0, True),
        ((world,), 0, False),
    ]


def case_scatter(w: _Worker, dtype_names=("float32", "bfloat16", "float16"), specs=None):
    """Every dimension and tiling; against the numpy rank-order sum (bits).
    ``specs``: (per-rank input shape, dimension, tiled) triples,
    ``_scatter_shapes`` by default."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(3)
    specs = specs or _scatter_shapes(w.world)
    for name in dtype_names:
        dt = _dtypes()[name]
        parts = [[random_array(rng, s, dt) for _ in range(w.world)] for s, _, _ in specs]
        xs = [w.put(p) for p in parts]

        def body(*xs, scatter=jax_arx.psum_scatter):
            # jax.lax.psum_scatter refuses a negative dimension at lowering;
            # jax_arx takes it, as the numpy reference does.
            return tuple(
                scatter(x, "sp", scatter_dimension=d if scatter is jax_arx.psum_scatter else d % x.ndim, tiled=t)
                for x, (_, d, t) in zip(xs, specs, strict=True)
            )

        f = w.smap(_lift(body), (P("sp"),) * len(xs), (P("sp"),) * len(xs))
        n = len(w.calls(f, *xs, target="jax_arx_psum_scatter"))
        if n != len(specs):
            w.fail("scatter", f"{name}: {n} jax_arx psum_scatters for {len(specs)} calls")
        outs = f(*xs)
        for k, (shape, d, t) in enumerate(specs):
            for r, got in w.mine(outs[k]).items():
                what = f"{name} {shape} dimension {d} tiled {t} rank {r}"
                w.check("scatter", got, reference_scatter(parts[k], d, t, r), what)


def case_sizes(w: _Worker):
    """At the prefill slot jax_arx runs; past it jax.lax does (gloo: the
    program is compiled first and started together on every process, since
    gloo's waits give up after a fixed time), close to the numpy sum."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(4)
    at = PREFILL_SLOT_BYTES // 4 // w.world  # float32 elements per rank: gathered output == the slot
    for n, ours in ((at, True), (at + 4, False)):
        parts = [random_array(rng, (n,), np.dtype(np.float32)) for _ in range(w.world)]
        x = w.put(parts)
        f = w.smap(_lift(lambda v: jax_arx.all_gather(v, "sp", tiled=True)), P("sp"), P("sp"))
        if bool(w.calls(f, x)) != ours:
            w.fail("sizes", f"all_gather of {n} floats per rank: ran with jax_arx {not ours}, expected {ours}")
        for r, got in w.mine(w.together(f, x)).items():
            w.check("sizes", got, np.concatenate(parts), f"all_gather {n} rank {r}")
        parts = [random_array(rng, (n * w.world,), np.dtype(np.float32)) for _ in range(w.world)]
        g = w.put(parts)
        f = w.smap(_lift(lambda v: jax_arx.psum_scatter(v, "sp", tiled=True)), P("sp"), P("sp"))
        if bool(w.calls(f, g)) != ours:
            w.fail("sizes", f"psum_scatter of {n * w.world} floats: ran with jax_arx {not ours}, expected {ours}")
        for r, got in w.mine(w.together(f, g)).items():
            if ours:
                w.check("sizes", got, reference_scatter(parts, 0, True, r), f"psum_scatter {n} rank {r}")
            else:  # jax.lax's own sum, in its own order
                w.close(
                    "sizes",
                    got,
                    reference_scatter(parts, 0, True, r),
                    f"psum_scatter {n} rank {r} (jax.lax)",
                    rtol=1e-5,
                    atol=1e-5,
                )


def case_mixed(w: _Worker, iters=20):
    """all_gather, psum_scatter and psum interleaved in one program, most of
    them independent (XLA's CPU runtime would start them in different orders
    on different ranks if jax_arx did not order them), many times over."""
    jax_arx, P = w.jax_arx, w.P
    import ml_dtypes

    rng = np.random.default_rng(5)
    n = w.world
    a = [random_array(rng, (7, 3), np.dtype(np.float32)) for _ in range(n)]
    b = [random_array(rng, (n * 11,), np.dtype(ml_dtypes.bfloat16)) for _ in range(n)]
    c = [random_array(rng, (5, 9), np.dtype(np.float16)) for _ in range(n)]

    def body(a, b, c):
        g1 = jax_arx.all_gather(a, "sp", axis=1, tiled=True)
        s1 = jax_arx.psum_scatter(b, "sp", tiled=True)
        p1 = jax_arx.psum(c, "sp")
        g2 = jax_arx.all_gather(c, "sp")
        p2 = jax_arx.psum(a, "sp")
        s2 = jax_arx.psum_scatter(jax_arx.all_gather(s1, "sp", tiled=True), "sp", tiled=True)  # dependent
        return g1, s1, p1, g2, p2, s2

    f = w.smap(_lift(body), (P("sp"),) * 3, (P("sp"),) * 6, check_vma=False)
    calls = w.calls(f, w.put(a), w.put(b), w.put(c))
    if len(calls) != 7:
        w.fail("mixed", f"{len(calls)} jax_arx calls, expected 7")
    xs = (w.put(a), w.put(b), w.put(c))
    s1 = {r: reference_scatter(b, 0, True, r) for r in range(n)}
    s1_all = np.concatenate([s1[r] for r in range(n)])
    wants = lambda r: (
        np.concatenate(a, axis=1),
        s1[r],
        reference_sum(c),
        np.stack(c),
        reference_sum(a),
        reference_scatter([s1_all] * n, 0, True, r),
    )
    for it in range(iters):
        outs = f(*xs)
        for k, out in enumerate(outs):
            for r, got in w.mine(out).items():
                w.check("mixed", got, wants(r)[k], f"iteration {it} output {k} rank {r}")


def case_loop(w: _Worker, steps=1000):
    """Dependent calls back to back in a fori_loop: all_gather, psum_scatter
    and psum each step (3 * steps calls), small integers, exact."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    jnp = jax.numpy
    n = w.world
    x0 = [np.arange(13, dtype=np.float32) + 100 * r for r in range(n)]

    def body(x):
        def step(_, carry):
            x, t = carry
            s = jax_arx.psum_scatter(jax_arx.all_gather(x, "sp", tiled=True), "sp", tiled=True)  # n * x
            return s - (n - 1) * x + 1, t + jax_arx.psum(x[:1], "sp")

        return jax.lax.fori_loop(0, steps, step, (x, jnp.zeros((1,), jnp.float32)))

    f = w.smap(_lift(body), P("sp"), (P("sp"), P("sp")), check_vma=False)
    x, t = f(w.put(x0))
    base = sum(float(v[0]) for v in x0)
    for r, got in w.mine(x).items():
        w.check("loop", got, x0[r] + steps, f"x after {steps} steps, rank {r}")
    for r, got in w.mine(t).items():
        w.check("loop", got, np.array([steps * base + n * steps * (steps - 1) / 2], np.float32), f"t rank {r}")


def case_python_loop(w: _Worker, calls=200):
    """Back-to-back jitted calls, none waited for until the last."""
    jax_arx, P = w.jax_arx, w.P
    n = w.world
    f = w.smap(
        _lift(
            lambda v: jax_arx.psum_scatter(jax_arx.all_gather(v, "sp", tiled=True), "sp", tiled=True) - (n - 1) * v + 1
        ),
        P("sp"),
        P("sp"),
    )
    x = w.put([np.full((9,), r + 1, np.float32) for r in range(n)])
    outs = []
    for _ in range(calls):
        x = f(x)
        outs.append(x)
    for i in (0, calls // 2, calls - 1):
        for r, got in w.mine(outs[i]).items():
            w.check("python_loop", got, np.full((9,), r + 1 + i + 1, np.float32), f"call {i} rank {r}")


def case_grad(w: _Worker):
    """jax.grad through jax_arx's gather and scatter equals jax.grad of the
    same function written without collectives on one device (the gather a
    concatenation of the ranks' slices, the scatter a sum and a slice): a
    reference that needs no collective of jax's own."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    jnp = jax.numpy
    n = w.world
    parts = [np.linspace(-1, 1, 6 * n, dtype=np.float32).reshape(2 * n, 3) * (r + 1) for r in range(n)]
    x = w.put(parts)

    def whole(xs):  # xs [n, 2n, 3]: the sum over ranks of what each rank's body returns
        g = jnp.concatenate([jnp.sin(xs[r]) for r in range(n)], axis=1)  # every rank's gather, [2n, 3n]
        s = n * g * g  # the sum over ranks of g * g, which is the same on every rank
        return sum((s[2 * r : 2 * r + 2] ** 2).sum() + xs.sum() for r in range(n))

    ref = np.asarray(jax.jit(jax.grad(whole))(jnp.asarray(np.stack(parts))))
    for check_vma in (True, False):

        def body(x):
            g = jax_arx.all_gather(jnp.sin(x), "sp", axis=1, tiled=True)  # [2n, 3n]
            s = jax_arx.psum_scatter(g * g, "sp", scatter_dimension=0, tiled=True)  # [2, 3n]
            return (s * s).sum(keepdims=True) + jax_arx.all_gather(x, "sp").sum(keepdims=True)

        f = w.smap(_lift(body), P("sp"), P("sp"), check_vma=check_vma)
        got = jax.jit(jax.grad(lambda x, f=f: f(x).sum()))(x)
        for r, g in w.mine(got).items():
            w.close("grad", g, ref[r], f"check_vma={check_vma} rank {r}", rtol=1e-5, atol=1e-5)


MOE_SHAPES = ((5, 9, 128, 1), (13, 40, 256, 3), (37, 64, 128, 8), (2, 16, 128, 16), (20, 30, 128, 17))


def case_moe(w: _Worker, shapes=MOE_SHAPES):
    """The fused combine (jax_arx initialized with MOE_FUSED): bf16 and
    e4m3 y, topk 1 to 16 (17 falls back: moe_combine then
    jax_arx.psum_scatter), T + world - 1 not a multiple of the world;
    against the numpy reference (bits)."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(6)
    n = w.world
    for e4m3 in (False, True):
        cases = []
        for T, R, H, topk in shapes:
            T = T * n + 1  # never a multiple of the world
            cases.append((T, R, H, topk, _moe_inputs(rng, w, T, R, H, topk, e4m3)))
        args = []
        for *_, (ys, scales, poss, ws, shareds) in cases:
            args += [w.put(ys), w.put(scales) if e4m3 else None, w.put(poss), w.put(ws), w.put(shareds)]
        args = [a for a in args if a is not None]
        per = 5 if e4m3 else 4

        def body(*flat, scatter=None, cases=cases, per=per, e4m3=e4m3):
            """The fused op; with ``scatter``, the unfused program it
            promises to equal: scatter(moe_combine(...))."""
            outs = []
            for i in range(len(cases)):
                y, *rest = flat[i * per : (i + 1) * per]
                scale = rest.pop(0) if e4m3 else None
                pos, wt, shared = rest
                if scatter is None:
                    outs.append(jax_arx.moe_combine_psum_scatter(y, pos, wt, shared, "sp", y_scale=scale))
                else:
                    tpad = -(-pos.shape[0] // n) * n
                    rows = jax_arx.moe_combine(y, pos, wt, shared, y_scale=scale, padded_tokens=tpad)
                    outs.append(scatter(rows, "sp", scatter_dimension=0, tiled=True))
            return tuple(outs)

        f = w.smap(_lift(body), (P("sp"),) * len(args), (P("sp"),) * len(cases))
        fused = len(w.calls(f, *args, target="jax_arx_moe_combine_psum_scatter"))
        want_fused = sum(1 for c in cases if c[3] <= 16)
        if fused != want_fused:
            w.fail("moe", f"e4m3={e4m3}: {fused} fused calls, expected {want_fused}")
        outs = f(*args)
        g = w.smap(_lift(partial(body, scatter=jax_arx.psum_scatter)), (P("sp"),) * len(args), (P("sp"),) * len(cases))
        w.calls(g, *args, target="jax_arx_psum_scatter")  # the GPU workers count what their programs lowered
        unfused = g(*args)
        for k, (T, R, H, topk, (ys, scales, poss, ws, shareds)) in enumerate(cases):
            tpad = -(-T // n) * n
            combined = [
                reference_combine(ys[r], poss[r], ws[r], shareds[r], scales[r] if e4m3 else None, tpad)
                for r in range(n)
            ]
            for r, got in w.mine(outs[k]).items():
                what = f"e4m3={e4m3} T={T} R={R} H={H} topk={topk} rank {r}"
                w.check("moe", got, reference_scatter(combined, 0, True, r), what)
                # The documented promise: the bits of the unfused program.
                w.check("moe", got, w.mine(unfused[k])[r], what + " (psum_scatter(moe_combine(...)))")


def case_moe_plan(w: _Worker):
    """Run with JAX_ARX_FALLBACK=error. With the default settings the plan
    steps aside for the fused combine's unfused pair: the program holds
    jax_arx's psum_scatter and no fused call; ``stats()["plans"]`` counts
    each call traced, under the plan's reason (reported as ``plans``);
    nothing is a fallback (none counted, nothing logged, nothing raised);
    the results equal, bit for bit, the fused kernel's (run first, under
    MOE_FUSED) and the numpy reference."""
    import logging

    from jax_arx import config

    jax_arx, P = w.jax_arx, w.P
    n = w.world
    if config.load().fallback != "error":
        w.fail("moe_plan", "run with JAX_ARX_FALLBACK=error")
    rng = np.random.default_rng(11)
    cases = []
    for e4m3 in (False, True):
        for T, R, H, topk in MOE_SHAPES[:4]:  # topk up to 16: the fused kernel's
            T = T * n + 1
            cases.append((e4m3, T, R, H, topk, _moe_inputs(rng, w, T, R, H, topk, e4m3)))
    args = []
    for e4m3, *_, (ys, scales, poss, ws, shareds) in cases:
        args += [w.put(ys)] + ([w.put(scales)] if e4m3 else []) + [w.put(poss), w.put(ws), w.put(shareds)]

    def body(*flat):
        outs, i = [], 0
        for e4m3, *_ in cases:
            y, *rest = flat[i : i + (5 if e4m3 else 4)]
            i += 5 if e4m3 else 4
            scale = rest.pop(0) if e4m3 else None
            pos, wt, shared = rest
            outs.append(jax_arx.moe_combine_psum_scatter(y, pos, wt, shared, "sp", y_scale=scale))
        return tuple(outs)

    def program():  # a new jitted function: traced anew, under the current set-up
        return w.smap(_lift(body), (P("sp"),) * len(args), (P("sp"),) * len(cases))

    f = program()
    fused_calls = len(w.calls(f, *args, target="jax_arx_moe_combine_psum_scatter"))
    w.record(
        "moe_plan",
        None if fused_calls == len(cases) else f"with {MOE_FUSED}: {fused_calls} fused calls, expected {len(cases)}",
    )
    fused = [w.mine(out) for out in f(*args)]

    jax_arx.shutdown()
    jax_arx.initialize(w.mesh)  # the defaults: the plan decides
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("jax_arx").addHandler(handler)
    before = jax_arx.stats()
    try:
        g = program()
        text = g.lower(*args).as_text()
        traced = jax_arx.stats()
        outs = w.jax.block_until_ready(g(*args))  # every handler has run (the counters below)
    except jax_arx.JaxArxFallbackError as e:
        w.fail("moe_plan", f"the plan's unfused pair raised as a fallback: {e}")
        return
    finally:
        logging.getLogger("jax_arx").removeHandler(handler)
    lowered = {
        t: text.count(f"custom_call @{t}(") for t in ("jax_arx_moe_combine_psum_scatter", "jax_arx_psum_scatter")
    }
    w.record(
        "moe_plan",
        None
        if lowered == {"jax_arx_moe_combine_psum_scatter": 0, "jax_arx_psum_scatter": len(cases)}
        else f"by default the program lowered {lowered}; want the unfused pair's {len(cases)} psum_scatters",
    )
    op = "moe_combine_psum_scatter"
    was = before["plans"].get(op, {})
    plans = {k: v - was.get(k, 0) for k, v in traced["plans"].get(op, {}).items() if v != was.get(k, 0)}
    w.extra["plans"] = plans
    w.record(
        "moe_plan",
        None
        if sum(plans.values()) == len(cases) and set(traced["plans"]) == {op}
        else f"stats()['plans'] counted {traced['plans']} (before: {before['plans']}); want {len(cases)} for {op}",
    )
    w.record(
        "moe_plan",
        None
        if traced["fallbacks"] == before["fallbacks"] and not logged
        else f"a fallback: counted {traced['fallbacks']} (before: {before['fallbacks']}), logged {logged}",
    )
    ops = jax_arx.stats()["communicators"]["sp"]["ops"]
    local = len(w.jax.local_devices())
    w.record(
        "moe_plan",
        None
        if ops[op]["calls"] == 0 and ops["psum_scatter"]["calls"] == len(cases) * local
        else f"the endpoints ran {ops[op]['calls']} fused calls and {ops['psum_scatter']['calls']} psum_scatters; "
        f"want 0 and {len(cases) * local}",
    )
    for k, (e4m3, T, R, H, topk, (ys, scales, poss, ws, shareds)) in enumerate(cases):
        tpad = -(-T // n) * n
        combined = [
            reference_combine(ys[r], poss[r], ws[r], shareds[r], scales[r] if e4m3 else None, tpad) for r in range(n)
        ]
        for r, got in w.mine(outs[k]).items():
            what = f"e4m3={e4m3} T={T} R={R} H={H} topk={topk} rank {r}"
            w.check("moe_plan", got, reference_scatter(combined, 0, True, r), what)
            w.check("moe_plan", got, fused[k][r], what + " (the fused kernel's)")


FULL_CASES = ["first_use", "gather", "scatter", "sizes", "mixed", "loop", "python_loop", "grad", "moe"]
QUICK_CASES = ["first_use", "gather", "scatter", "mixed", "loop", "moe"]


def _suite_full(w):
    for case in (
        case_first_use,
        case_gather,
        case_scatter,
        case_sizes,
        case_mixed,
        case_loop,
        case_python_loop,
        case_grad,
        case_moe,
    ):
        w.timed(case)


def _suite_quick(w):
    w.timed(case_first_use)
    w.timed(case_gather, ("float32", "bfloat16", "int8"), shapes=((3, 5, 7),))
    w.timed(case_scatter, ("float32", "bfloat16"))
    w.timed(case_mixed, iters=5)
    w.timed(case_loop, steps=200)
    w.timed(case_moe, shapes=MOE_SHAPES[1:3])


def _suite_failures(w):
    """Run with JAX_ARX_TIMEOUT_S=3 and two processes."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    from jax_arx import _compat

    me = jax.process_index()
    out = {}

    def step(what):  # progress on stderr, so a slow or stuck rank shows where
        print(f"[failures] {time.monotonic():.3f} rank {me}: {what}", file=sys.stderr, flush=True)

    # Ranks that trace different programs: rank 0's first all_gather sets up
    # the bulk endpoints, which needs every process; rank 1 runs a psum that
    # rank 0 never joins. Both fail within the timeout, neither hangs.
    step("trace differs")
    x = w.put([np.ones((8,), np.float32) for _ in range(w.world)])
    op = jax_arx.all_gather if me == 0 else jax_arx.psum
    f = w.smap(_lift(lambda v: op(v, "sp")), P("sp"), P("sp"))
    report, start = {"error": "", "kind": ""}, time.monotonic()
    try:
        w.mine(f(x))
    except Exception as e:
        report["error"], report["kind"] = launched.error_text(e), type(e).__name__
        if me != 0:
            report["kind"] = launched.family(e) or report["kind"]
    report["seconds"] = time.monotonic() - start
    out["trace_differs"] = report
    step(f"trace differs done: {report['error'].strip()[:300]!r}")
    # Both ranks end that step before either shuts down (a bound no load reaches).
    _compat.distributed_client().wait_at_barrier("bulk_cases/trace_differs", 120_000)
    jax_arx.shutdown()
    jax_arx.initialize(w.mesh)

    # Ranks that issue different ops (the same bytes): an error, never a result.
    step("mismatch")
    # Each program is the collective alone (its own input, no slicing): on
    # GPUs, XLA's multi-process autotuning matches up what the processes
    # compile, and two programs with different fusions in them could wait on
    # each other in the compiler instead of in jax_arx.
    if me == 0:
        x = w.put([np.ones((2 * w.world, 8), np.float32) for _ in range(w.world)])
        f = w.smap(_lift(lambda v: jax_arx.psum_scatter(v, "sp", tiled=True)), P("sp"), P("sp"))
    else:
        x = w.put([np.ones((2, 8), np.float32) for _ in range(w.world)])
        f = w.smap(_lift(lambda v: jax_arx.all_gather(v, "sp", tiled=True)), P("sp"), P("sp"))
    out["mismatch"] = launched.mismatch_report(lambda: np.concatenate(list(w.mine(f(x)).values())), jax_arx)
    step(f"mismatch done: {out['mismatch']['error'].strip()[:300]!r}")

    # Fresh endpoints, then a peer that never calls.
    jax_arx.shutdown()
    step("shut down")
    jax_arx.initialize(w.mesh)
    step("initialized again")
    f = w.smap(_lift(lambda v: jax_arx.all_gather(v, "sp")), P("sp"), P("sp"))
    x = w.put([np.ones((64,), np.float32) for _ in range(w.world)])
    f = f.lower(x).compile()  # the call alone is timed, not its compilation
    # No result at all (an exception) is as good as NaN: nothing wrong was returned.
    out["missing_peer"] = launched.alone_call_report(
        lambda: {"nan": bool(np.isnan(list(w.mine(f(x)).values())[0]).all())},
        jax_arx,
        "bulk_cases/rank0_done",
        on_error={"nan": True},
    )
    return out


SUITES = {"full": _suite_full, "quick": _suite_quick, "moe_plan": case_moe_plan}


def run_worker(suite, suites=SUITES):
    """Runs worker suite ``suite`` on this process's devices, whatever the
    backend (tests/test_gpu_bulk.py runs the same cases on GPUs), and
    prints the RESULT line. ``suite``: "failures", or names of ``suites``
    joined by "+", run in that order in one launch."""
    w = _Worker()
    report = {"world": w.world, "local_devices": len(w.jax.local_devices()), "platform": w.jax.devices()[0].platform}
    if suite == "failures":
        report.update(_suite_failures(w))
    else:
        for name in suite.split("+"):
            suites[name](w)
        report.update(cases=w.cases, seconds=w.seconds, **w.extra)
    print(RESULT + json.dumps(report), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    run_worker(sys.argv[sys.argv.index("--worker") + 1])
