"""jax_arx.psum_add_norm on the CPU backend, with the real C++ core, across
processes (laid out as tests/test_psum_cpu.py: this file is its own worker,
launched under ``python -m jax_arx.launch``; each rank prints one
``RESULT {json}`` line, the tests assert on what every rank reports).

The reference is tests/norm_reference.py (numpy, independent of jax). Per
fused call, on every rank:

- ``hidden`` equals the numpy rank-order sum plus the residual bit for bit,
  and equals ``jax_arx.psum(x) + residual`` computed in the same program
  bit for bit;
- ``normed`` is within half an ulp of the dtype plus 4 float32 ulps of the
  row's largest value of the float64 formula, and equals the float32 model
  of ffi/base/norm.h's order bit for bit;
- a CRC of every result is the same on every rank (bit-identical results).

One launch per world and carrier runs every case (one program per dtype in
``norms``), so the suite costs three launches. The workers ask for the
fused host side (the ``norm_fused`` tuning): by default the plan steps
aside for psum then the add and the norm in jax, on the CPU as on GPUs
(ffi/comm/plan.cc, plan_add_norm), and it is the fused host side whose
contract these cases check.

- ``norms`` (worlds 2 and 3 over shm, 2 over tcp): every dtype, both kinds,
  with and without bias, shapes (1, W), (5, W), (2, 3, W) for W in 1, 7,
  40, 257, 4096 that fit the one-shot limit (``JAX_ARX_SLOT_BYTES=64K``);
  one program per dtype, every call lowered to ``jax_arx_psum_add_norm``.
- ``vmap``: jax.vmap over a leading batch axis (residual batched, and not)
  gives the bits of the unbatched calls row by row, in one fused call.
- ``grad``: jax.grad of sum(normed * c) + sum(hidden * c2) with respect to
  x and residual (float32, check_vma on and off) against jax.grad of the
  same function written without collectives on one device (rtol 1e-4,
  atol 1e-5 * max|ref|).
- ``fallback``: partials past the limit run the unfused formula with
  jax.lax.psum (no ``jax_arx_psum_add_norm`` in the lowering, counted in
  ``jax_arx.stats()["fallbacks"]``), whose sum (gloo's) has an order and
  roundings of its own: hidden within 1e-5 relative + 1e-6 (float32), or
  world ulps of sum |x_r| + 1 ulp of hidden (bfloat16); normed within the
  float64 formula of the hidden it returned: 1 ulp of the dtype plus 16
  float32 ulps of the row's largest value (jax's own reduction order), or
  for bfloat16 2^-8 of it (XLA norms the unrounded float32 hidden).

``test_bad_input`` runs in this process: bad arguments (shapes that do not
fit, a weight of the wrong width, an integer or mixed dtype, a bad kind or
eps) are errors naming the argument, before any collective.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import numpy as np
import pytest

import launched
import norm_reference as ref

THIS = os.path.abspath(__file__)
SLOT_BYTES = 64 * 1024
TARGET = "jax_arx_psum_add_norm"
WIDTHS = (1, 7, 40, 257, 4096)
LEADS = ((1,), (5,), (2, 3))
EPS = {"rms": 1e-6, "layer": 1e-5}  # rms: the default, not passed
CASES = ["norms", "vmap", "grad", "fallback"]


# shm at 2 ranks is the slow suite's: the fast tier has world 2 over tcp
# and world 3 over shm.
@pytest.mark.parametrize("transport,nprocs", [pytest.param("shm", 2, marks=pytest.mark.slow), ("shm", 3), ("tcp", 2)])
def test_norm_suite(core_built, tmp_path, transport, nprocs):
    results = launched.run_suite(
        THIS,
        "full",
        nprocs,
        transport,
        tmp_path,
        timeout=600,
        env={"JAX_ARX_SLOT_BYTES": str(SLOT_BYTES), "JAX_ARX_TIMEOUT_S": "20"},
    )
    launched.assert_all_correct(results, expect=CASES)
    assert all("digest" in r for r in results.values())


def test_bad_input():
    import jax.numpy as jnp

    import jax_arx

    f = jax_arx.psum_add_norm
    x, r, w = jnp.ones((2, 8), jnp.float32), jnp.ones((2, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 7\), x has \(2, 8\)"):
        f(x, jnp.ones((2, 7), jnp.float32), w, ())
    with pytest.raises(ValueError, match=r"residual has shape \(16,\)"):
        f(x, jnp.ones((16,), jnp.float32), w, ())
    with pytest.raises(ValueError, match=r"weight has shape \(7,\); it must be \(8,\)"):
        f(x, r, jnp.ones((7,), jnp.float32), ())
    with pytest.raises(ValueError, match=r"weight has shape \(2, 8\)"):
        f(x, r, jnp.ones((2, 8), jnp.float32), ())
    with pytest.raises(ValueError, match=r"bias has shape \(2, 8\)"):
        f(x, r, w, (), bias=jnp.ones((2, 8), jnp.float32))
    with pytest.raises(TypeError, match="x has dtype int32"):
        f(jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32), jnp.ones((8,), jnp.int32), ())
    with pytest.raises(TypeError, match="residual has dtype bfloat16"):
        f(x, jnp.ones((2, 8), jnp.bfloat16), w, ())
    with pytest.raises(TypeError, match="weight has dtype int32"):
        f(x, r, jnp.ones((8,), jnp.int32), ())
    with pytest.raises(TypeError, match="bias must be an array"):
        f(x, r, w, (), bias=[1.0] * 8)
    with pytest.raises(ValueError, match="x of shape"):
        f(jnp.ones((), jnp.float32), jnp.ones((), jnp.float32), w, ())
    with pytest.raises(ValueError, match="kind"):
        f(x, r, w, (), kind="foo")
    for eps in (-1, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            f(x, r, w, (), eps=eps)
    # axis_name=(): no sum, the formula on x itself.
    rng = np.random.default_rng(0)
    for dt in ref.dtypes().values():
        xs, rs = (rng.standard_normal((3, 40)).astype(dt) for _ in range(2))
        ws, bs = (1 + 0.5 * rng.standard_normal(40)).astype(dt), rng.standard_normal(40).astype(dt)
        for kind in ("rms", "layer"):
            normed, hidden = f(
                jnp.asarray(xs), jnp.asarray(rs), jnp.asarray(ws), (), kind=kind, bias=jnp.asarray(bs), eps=1e-5
            )
            want = ref.hidden([xs], rs, dt)
            assert np.asarray(hidden).tobytes() == want.tobytes(), (dt, kind)
            bad = ref.close_report(
                np.asarray(normed), ref.normed_f64(want, ws, bs, kind, 1e-5), dt, ulps=1, row_ulps=16
            )
            assert bad is None, (dt, kind, bad)


# --- the worker -------------------------------------------------------------------


class _Worker(launched.MeshWorker):
    def __init__(self):
        super().__init__("tp", tuning={"norm_fused": 1})  # the docstring: the fused host side
        self.crc = 0
        self.replicated = self.jax.sharding.NamedSharding(self.mesh, self.P())

    def put(self, g):
        """Rows of ``g`` split over the ranks."""
        return self.jax.make_array_from_callback(g.shape, self.sharded, lambda idx: g[idx])

    def rep(self, g):
        """``g`` on every rank."""
        return self.jax.make_array_from_callback(g.shape, self.replicated, lambda idx: g[idx])

    def shards(self, x):
        """This process's copies of ``x`` (a numpy array: itself)."""
        if isinstance(x, np.ndarray):
            return [x]
        return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]

    def bits(self, case, got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        bad = None
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            bad = (
                f"{what}: not bit for bit: got {got.ravel()[:4]}, want {want.ravel()[:4]} (shapes {got.shape}, "
                f"{want.shape}; {int((got != want).sum()) if got.shape == want.shape else '?'} differ)"
            )
        self.record(case, bad)
        self.crc = zlib.crc32(got.tobytes(), self.crc)

    def close(self, case, got, want, dtype, what, **tol):
        got = np.asarray(got)
        bad = ref.close_report(got, want, dtype, **tol)
        self.record(case, bad and f"{what}: {bad}")
        self.crc = zlib.crc32(got.tobytes(), self.crc)

    def fused(self, case, spec, data, normed, hidden, psum_hidden=None):
        """Every check of one fused call (see the module docstring) on the
        shards this process holds; ``psum_hidden``: jax_arx.psum(x) +
        residual from the same program, or None."""
        p, r, wt, b = data
        dt = ref.dtypes()[spec[1]]
        want_h = ref.hidden(p, r, dt)
        for got in self.shards(hidden):
            self.bits(case, got, want_h, f"hidden {spec} vs numpy")
        if psum_hidden is not None:
            for got, other in zip(self.shards(hidden), self.shards(psum_hidden), strict=True):
                self.bits(case, got, other, f"hidden {spec} vs jax_arx.psum(x) + residual")
        ref_n = ref.normed_f64(want_h, wt, b, spec[2], EPS[spec[2]])
        lanes = ref.normed_lanes(want_h, wt, b, spec[2], EPS[spec[2]])
        for got in self.shards(normed):
            self.close(case, got, ref_n, dt, f"normed {spec} vs float64")
            self.bits(case, got, lanes, f"normed {spec} vs the lane-order model")


def _fits(shape, dt):
    return int(np.prod(shape)) * dt.itemsize <= SLOT_BYTES


def norm_specs(name):
    dt = ref.dtypes()[name]
    return [
        (lead + (W,), name, kind, b)
        for lead in LEADS
        for W in WIDTHS
        for kind in ("rms", "layer")
        for b in (False, True)
        if _fits(lead + (W,), dt)
    ]


def _call(jax_arx, x, r, wt, b, kind):
    kw = {} if kind == "rms" else {"eps": EPS[kind]}  # rms: the default eps
    return jax_arx.psum_add_norm(x, r, wt, "tp", kind=kind, bias=b, **kw)


def _program(w, specs, data, with_psum=False):
    """One program of one call per spec: x's rows split over the ranks,
    the rest replicated; ``with_psum``: each call's jax_arx.psum(x) +
    residual too, a third result per spec. Returns (f, args)."""
    P = w.P
    per = 3 if with_psum else 2

    def body(*ops):
        out, i = [], 0
        for _, _, kind, has_bias in specs:
            x, r, wt = ops[i][0], ops[i + 1], ops[i + 2]
            b = ops[i + 3] if has_bias else None
            i += 4 if has_bias else 3
            out += list(_call(w.jax_arx, x, r, wt, b, kind))
            if with_psum:
                out.append(w.jax_arx.psum(x, "tp") + r)
        return tuple(out)

    args, in_specs = [], []
    for p, r, wt, b in data:
        extra = [] if b is None else [b]
        args += [w.put(p)] + [w.rep(a) for a in [r, wt] + extra]
        in_specs += [P("tp")] + [P()] * (2 + len(extra))
    return w.smap(body, tuple(in_specs), (P(),) * (per * len(specs))), args


def case_norms(w):
    for name in ref.dtypes():
        specs = norm_specs(name)
        data = [ref.inputs(w.world, s) for s in specs]
        f, args = _program(w, specs, data, with_psum=True)
        before = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
        calls = w.calls(f, *args, target=TARGET)
        after = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
        if len(calls) != len(specs) or after != before:
            w.fail("norms", f"{name}: {len(calls)} fused calls lowered for {len(specs)}, {after - before} fallbacks")
        outs = f(*args)
        for j, (spec, d) in enumerate(zip(specs, data, strict=True)):
            w.fused("norms", spec, d, outs[3 * j], outs[3 * j + 1], outs[3 * j + 2])


VMAP_SPECS = [
    ((2, 40), "float32", "rms", True),
    ((1, 257), "bfloat16", "layer", False),
    ((2, 7), "float16", "layer", True),
]
GRAD_SPECS = [
    ((3, 40), "float32", "rms", False),
    ((2, 257), "float32", "layer", True),
    ((1, 7), "float32", "layer", False),
    ((2, 3, 40), "float32", "rms", True),
]
FALLBACK_SPECS = [((5, 4096), "float32", "rms", True), ((2, 3, 6000), "bfloat16", "layer", False)]


def case_vmap(w, batch=3):
    """jax.vmap over a leading batch axis: one fused call, the bits of the
    unbatched calls row by row (and the reference's)."""
    for spec in VMAP_SPECS:
        _vmap_one(w, spec, batch)


def _vmap_one(w, spec, B):
    jax, jnp, P = w.jax, w.jax.numpy, w.P
    shape, name, kind, has_bias = spec
    parts, res, wt, b = ref.inputs(w.world, ((B, *shape), name, kind, has_bias))
    bb = b if has_bias else np.zeros(shape[-1], ref.dtypes()[name])

    def stack(outs, k):
        return jnp.stack([o[k] for o in outs])

    def body(x, r, wt, bb):
        x, bias = x[0], (bb if has_bias else None)

        def one(xi, ri):
            return _call(w.jax_arx, xi, ri, wt, bias, kind)

        batched = jax.vmap(one)(x, r)
        shared = jax.vmap(one, in_axes=(0, None))(x, r[0])  # the residual not batched
        rows = [one(x[i], r[i]) for i in range(B)]
        rows0 = [one(x[i], r[0]) for i in range(B)]
        return (*batched, *shared, stack(rows, 0), stack(rows, 1), stack(rows0, 0), stack(rows0, 1))

    f = w.smap(body, (P("tp"), P(), P(), P()), (P(),) * 8)
    args = (w.put(parts), w.rep(res), w.rep(wt), w.rep(bb))
    calls = w.calls(f, *args, target=TARGET)
    if len(calls) != 2 + 2 * B:
        w.fail("vmap", f"{spec}: {len(calls)} fused calls lowered, expected {2 + 2 * B}")
    outs = [w.shards(o)[0] for o in f(*args)]
    for k, what in enumerate(("batched normed", "batched hidden", "shared-residual normed", "shared-residual hidden")):
        w.bits("vmap", outs[k], outs[4 + k], f"{spec} {what} vs row by row")
    for k, r in ((0, res), (2, np.broadcast_to(res[0], res.shape))):
        w.fused("vmap", spec, (parts, r, wt, b), outs[k], outs[k + 1])


def _norm_jnp(jnp, h, wt, b, kind, eps):
    d = h - jnp.mean(h, -1, keepdims=True) if kind == "layer" else h
    y = d / jnp.sqrt(jnp.mean(d * d, -1, keepdims=True) + np.float32(eps)) * wt
    return y if b is None else y + b


def case_grad(w):
    """jax.grad with respect to x and residual against jax.grad of the same
    function written without collectives, on one device: the sum over
    ranks of each rank's loss, with the partials as rows of one array.
    Every spec in one program per check_vma (the loss is their sum, so each
    spec's gradient is its own): two compiles, not one per spec."""
    jax, jnp, P = w.jax, w.jax.numpy, w.P
    n = w.world
    datas, cs = [], []
    for spec in GRAD_SPECS:
        datas.append(ref.inputs(n, spec))
        rng = np.random.default_rng(zlib.crc32(repr(spec).encode()) + 1)
        cs.append([rng.standard_normal(spec[0]).astype(np.float32) for _ in range(2)])

    def whole(*ops):  # (parts, residual) per spec
        total = 0.0
        for k, ((_, _, kind, _), (_, _, wt, b), (c, c2)) in enumerate(zip(GRAD_SPECS, datas, cs, strict=True)):
            h = ops[2 * k].sum(0) + ops[2 * k + 1]
            total = total + n * ((_norm_jnp(jnp, h, wt, b, kind, EPS[kind]) * c).sum() + (h * c2).sum())
        return total

    flat = [a for p, r, _, _ in datas for a in (p, r)]
    argnums = tuple(range(len(flat)))
    want = [np.asarray(g) for g in jax.jit(jax.grad(whole, argnums=argnums))(*flat)]

    def body(*ops):
        out = []
        for k, ((_, _, kind, _), (_, _, wt, b), (c, c2)) in enumerate(zip(GRAD_SPECS, datas, cs, strict=True)):
            normed, hidden = _call(w.jax_arx, ops[2 * k][0], ops[2 * k + 1], wt, b, kind)
            out.append(((normed * c).sum() + (hidden * c2).sum()).reshape(1))
        return sum(out[1:], out[0])

    args = [w.put(a) if i % 2 == 0 else w.rep(a) for i, a in enumerate(flat)]
    for check_vma in (True, False):
        f = w.smap(body, (P("tp"), P()) * len(GRAD_SPECS), P("tp"), check_vma=check_vma)
        lowered = jax.jit(jax.grad(lambda *ops, f=f: f(*ops).sum(), argnums=argnums)).lower(*args)
        fused = lowered.as_text().count(f"custom_call @{TARGET}")
        if fused != len(GRAD_SPECS):
            w.fail("grad", f"check_vma={check_vma}: {fused} fused calls in the gradient for {len(GRAD_SPECS)} specs")
        got = lowered.compile()(*args)
        for i, (a, whole_g) in enumerate(zip(got, want, strict=True)):
            spec, what = GRAD_SPECS[i // 2], ("d/dx", "d/dresidual")[i % 2]
            for shard in a.addressable_shards:
                g, ref_s = np.asarray(shard.data), whole_g[shard.index]
                ok = np.allclose(g, ref_s, rtol=1e-4, atol=1e-5 * np.abs(ref_s).max())
                w.record(
                    "grad",
                    None
                    if ok
                    else f"{spec} check_vma={check_vma} {what}: max |diff| "
                    f"{np.abs(g - ref_s).max():.3g}, max |ref| {np.abs(ref_s).max():.3g}",
                )


def case_fallback(w):
    """Partials past the one-shot limit: the unfused formula, jax.lax.psum's."""
    for spec in FALLBACK_SPECS:
        _fallback_one(w, spec)


def _fallback_one(w, spec):
    p, r, wt, b = d = ref.inputs(w.world, spec)
    f, args = _program(w, [spec], [d])
    before = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
    text = f.lower(*args).as_text()
    after = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
    if TARGET in text or after <= before:
        w.fail("fallback", f"{spec}: fused call in the lowering: {TARGET in text}; fallbacks {before}->{after}")
    outs = w.together(f, *args)  # gloo: compiled first, started together
    dt = ref.dtypes()[spec[1]]
    want_h = ref.hidden(p, r, dt)
    for got in w.shards(outs[1]):
        if dt == np.float32:
            ok = np.allclose(got, want_h, rtol=1e-5, atol=1e-6)
        else:  # gloo's bf16 sum may round after each rank: world ulps of sum |x_r|, one of hidden
            tol = w.world * ref.ulp(np.abs(p.astype(np.float64)).sum(0), dt) + ref.ulp(want_h.astype(np.float64), dt)
            ok = bool((np.abs(got.astype(np.float64) - want_h.astype(np.float64)) <= tol).all())
        w.record("fallback", None if ok else f"{spec}: hidden far from the numpy sum")
    # XLA keeps the float32 sum + residual where the formula rounds it to a
    # 16-bit hidden (excess precision), so a 16-bit normed may be off by
    # that rounding carried through the norm: 2^-8 of the row's largest.
    row_ulps = 16 if dt == np.float32 else 2**15
    for got, h in zip(w.shards(outs[0]), w.shards(outs[1]), strict=True):
        bad = ref.close_report(got, ref.normed_f64(h, wt, b, spec[2], EPS[spec[2]]), dt, ulps=1, row_ulps=row_ulps)
        w.record("fallback", bad and f"{spec} normed: {bad}")


def _worker_main(argv):
    w = _Worker()
    for case in (case_norms, case_vmap, case_grad, case_fallback):
        w.timed(case)
    print(
        launched.RESULT + json.dumps({"world": w.world, "cases": w.cases, "digest": w.crc, "seconds": w.seconds}),
        flush=True,
    )


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main(sys.argv)


@pytest.mark.usefixtures("four_devices")
def test_steps_aside_where_the_plan_says_unfused(fake_core, lax_lowering, monkeypatch, caplog):
    """Where the plan says the fused kernels lose (by default, on GPUs and
    the CPU: ffi/comm/plan.cc plan_add_norm; here a stand-in plan), the
    call is jax_arx.psum, then the add and the norm in jax: no fused
    primitive, no fallback (nothing logged, JAX_ARX_FALLBACK=error allows
    it), the plan's reason counted for stats()["plans"], hidden the psum
    plus the residual bit for bit, normed the unfused formula's."""
    import logging

    import jax
    from jax.sharding import PartitionSpec as P

    import jax_arx
    from jax_arx import _comm, _policy

    # Here, not at the top: this file is also the workers' program, whose
    # processes take their devices from the launcher, not from stand_in_core.
    from stand_in_core import auto_mesh, inner_jaxpr, prim_names

    real_plan = _comm.Communicator.plan
    reason = "the fused norm measured slower (a test's plan)"

    def plan(self, op, nbytes):
        return (_policy.ALGORITHM_UNFUSED, reason) if op == "psum_add_norm" else real_plan(self, op, nbytes)

    monkeypatch.setattr(_comm.Communicator, "plan", plan)
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 40)).astype(np.float32)
    r, w, b = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32), None

    def body(xs, rs, ws):
        n, h = jax_arx.psum_add_norm(xs[0], rs, ws, "tp", kind="layer", eps=1e-5)
        return n[None], h[None], (jax_arx.psum(xs[0], "tp") + rs)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * 3))
    before = _policy.plan_counts().get("psum_add_norm", {}).get(reason, 0)
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = prim_names(inner_jaxpr(jax.make_jaxpr(f)(x, r, w)))
        normed, hidden, plain = (np.asarray(o) for o in f(x, r, w))
    assert "jax_arx_psum_add_norm" not in prims and {"jax_arx_psum", "jax_arx_psum_invariant"} & set(prims), prims
    assert not caplog.records, caplog.text
    assert _policy.plan_counts()["psum_add_norm"][reason] == before + 1
    for k in range(4):
        assert hidden[k].tobytes() == plain[0].tobytes(), k  # psum + residual, bit for bit
        assert normed[k].tobytes() == normed[0].tobytes(), k  # the same bits on every device
    bad = ref.close_report(normed[0], ref.normed_f64(hidden[0], w, b, "layer", 1e-5), np.float32)
    assert not bad, bad
