"""jax_arx.psum_add_norm on the CPU backend, with the real C++ core, across
processes (laid out as tests/test_psum_cpu.py: this file is its own worker,
launched under ``python -m jax_arx.launch``; each rank prints one
``RESULT {json}`` line, the tests assert on what every rank reports).

The reference is numpy (ml_dtypes for bfloat16), independent of jax:

    acc = float32 zeros; for r in ranks (mesh order): acc += x_r.astype(float32)
    hidden_ref = (acc.astype(dtype).astype(float32) + residual.astype(float32)).astype(dtype)

``hidden`` must equal it bit for bit. ``normed`` is compared with the
formula in float64 from ``hidden_ref`` as stored (eps taken as float32):

    rms:   h / sqrt(mean(h^2) + eps) * w (+ b)
    layer: (h - mean) / sqrt(mean((h - mean)^2) + eps) * w (+ b)

Tolerances (fused calls): bfloat16 / float16, |got - ref| <= 1 ulp of the
dtype at ref (np.spacing of |ref| rounded to the dtype; the fp32 result is
within ~1e-6 of ref, rounding it adds half an ulp) plus 1e-6 * max|ref| of
the row (layer's h - mean loses ~1e-7 * |mean| absolutely, which shows for
elements near the mean); float32, |got - ref| <= 1e-5 * |ref| + 1e-6 *
max|ref| of the row. (Measured at world 3: at most 0.50 of the tolerance
for bfloat16 / float16, 0.05 for float32.) A CRC of every fused result must
be the same on every rank (bit-identical results).

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
  world ulps of sum |x_r| + 1 ulp of hidden (bfloat16); normed, from its
  own hidden, within 1e-4 * |ref| + 1e-4 * max|ref| of the row (float32),
  or 1 ulp + 2e-2 * max|ref| of the row (bfloat16).

``test_bad_input`` runs in this process: bad arguments are errors naming
them, before any collective.
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import launched
import numpy as np
import pytest

THIS = os.path.abspath(__file__)
SLOT_BYTES = 64 * 1024
TARGET = "jax_arx_psum_add_norm"
WIDTHS = (1, 7, 40, 257, 4096)
LEADS = ((1,), (5,), (2, 3))
EPS = {"rms": 1e-6, "layer": 1e-5}  # rms: the default, not passed
CASES = ["norms", "vmap", "grad", "fallback"]


@pytest.mark.parametrize("transport,nprocs", [("shm", 2), ("shm", 3), ("tcp", 2)])
def test_norm_suite(core_built, tmp_path, transport, nprocs):
    results = launched.run_suite(THIS, "full", nprocs, transport, tmp_path, timeout=600,
                                 env={"JAX_ARX_SLOT_BYTES": str(SLOT_BYTES), "JAX_ARX_TIMEOUT_S": "20"})
    launched.assert_all_correct(results, expect=CASES)
    assert all("digest" in r for r in results.values())


def test_bad_input():
    import jax.numpy as jnp

    import jax_arx

    f = jax_arx.psum_add_norm
    x, r, w = jnp.ones((2, 8), jnp.float32), jnp.ones((2, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match="residual"):
        f(x, jnp.ones((2, 7), jnp.float32), w, ())
    with pytest.raises(ValueError, match="weight"):
        f(x, r, jnp.ones((7,), jnp.float32), ())
    with pytest.raises(ValueError, match="bias"):
        f(x, r, w, (), bias=jnp.ones((2, 8), jnp.float32))
    with pytest.raises(TypeError):
        f(jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32), jnp.ones((8,), jnp.int32), ())
    with pytest.raises(TypeError, match="residual"):
        f(x, jnp.ones((2, 8), jnp.bfloat16), w, ())
    with pytest.raises(ValueError, match="kind"):
        f(x, r, w, (), kind="foo")
    for eps in (-1, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            f(x, r, w, (), eps=eps)
    # axis_name=(): no sum, the formula on x itself.
    rng = np.random.default_rng(0)
    for dt in _dtypes().values():
        xs, rs = (rng.standard_normal((3, 40)).astype(dt) for _ in range(2))
        ws, bs = (1 + 0.5 * rng.standard_normal(40)).astype(dt), rng.standard_normal(40).astype(dt)
        for kind in ("rms", "layer"):
            normed, hidden = f(jnp.asarray(xs), jnp.asarray(rs), jnp.asarray(ws), (), kind=kind,
                               bias=jnp.asarray(bs), eps=1e-5)
            want = reference_hidden([xs], rs, dt)
            assert np.asarray(hidden).tobytes() == want.tobytes(), (dt, kind)
            bad = close_report(np.asarray(normed), reference_normed(want, ws, bs, kind, 1e-5), dt, ulps=2)
            assert bad is None, (dt, kind, bad)


# --- the reference ----------------------------------------------------------------

def _dtypes():
    import ml_dtypes

    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float16": np.dtype(np.float16)}


def reference_hidden(parts, residual, dtype):
    acc = np.zeros(residual.shape, np.float32)
    for p in parts:
        acc += p.astype(np.float32)
    return (acc.astype(dtype).astype(np.float32) + residual.astype(np.float32)).astype(dtype)


def reference_normed(hidden, weight, bias, kind, eps):
    """The formula in float64 from hidden as stored (not rounded)."""
    h = hidden.astype(np.float64)
    d = h - h.mean(-1, keepdims=True) if kind == "layer" else h
    y = d / np.sqrt((d * d).mean(-1, keepdims=True) + float(np.float32(eps))) * weight.astype(np.float64)
    return y + bias.astype(np.float64) if bias is not None else y


def _ulp(v, dt):
    """The spacing of dtype ``dt`` at |v| (rounded to it), as float64. Of
    |v|: numpy's float16 spacing of a negative power of two is the ulp
    below it, not that of the values that round to it."""
    return np.spacing(np.abs(v).astype(dt)).astype(np.float64)


def close_report(got, ref, dtype, *, ulps=1.0, rel=1e-5, floor=1e-6):
    """None when every element of ``got`` is within the module's tolerance
    of the float64 ``ref``, else what is wrong."""
    got64 = got.astype(np.float64)
    row_max = np.abs(ref).max(-1, keepdims=True)
    if dtype == np.float32:
        tol = rel * np.abs(ref) + floor * row_max
    else:
        tol = ulps * _ulp(ref, dtype) + floor * row_max
    err = np.abs(got64 - ref)
    bad = ~(err <= tol)
    if not bad.any():
        return None
    i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(tol, 1e-300), 0)), bad.shape)
    return (f"{int(bad.sum())} of {got.size} beyond tolerance; worst at {tuple(int(k) for k in i)}: "
            f"got {got64[i]!r}, ref {ref[i]!r}, tol {tol[i]:.3g}")


def inputs(world, spec):
    """Every process draws the same values; each rank's partial differs."""
    shape, name, kind, has_bias = spec
    dt = _dtypes()[name]
    rng = np.random.default_rng(zlib.crc32(repr(spec).encode()))
    parts = np.stack([(rng.standard_normal(shape) * 2).astype(dt) for _ in range(world)])
    residual = rng.standard_normal(shape).astype(dt)
    weight = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(dt)
    bias = rng.standard_normal(shape[-1]).astype(dt) if has_bias else None
    return parts, residual, weight, bias


# --- the worker -------------------------------------------------------------------

class _Worker(launched.MeshWorker):
    def __init__(self):
        super().__init__("tp")
        self.crc = 0
        self.replicated = self.jax.sharding.NamedSharding(self.mesh, self.P())

    def put(self, g):
        """Rows of ``g`` split over the ranks."""
        return self.jax.make_array_from_callback(g.shape, self.sharded, lambda idx: g[idx])

    def rep(self, g):
        """``g`` on every rank."""
        return self.jax.make_array_from_callback(g.shape, self.replicated, lambda idx: g[idx])

    def shards(self, x):
        return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]

    def bits(self, case, got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        bad = None
        if got.shape != want.shape or got.tobytes() != want.tobytes():
            bad = f"{what}: not bit for bit: got {got.ravel()[:4]}, want {want.ravel()[:4]} (shapes {got.shape}, " \
                  f"{want.shape}; {int((got != want).sum()) if got.shape == want.shape else '?'} differ)"
        self.record(case, bad)
        self.crc = zlib.crc32(got.tobytes(), self.crc)

    def close(self, case, got, ref, dtype, what, **tol):
        got = np.asarray(got)
        bad = close_report(got, ref, dtype, **tol)
        self.record(case, bad and f"{what}: {bad}")
        self.crc = zlib.crc32(got.tobytes(), self.crc)


def _fits(shape, dt):
    return int(np.prod(shape)) * dt.itemsize <= SLOT_BYTES


def norm_specs(name):
    dt = _dtypes()[name]
    return [(lead + (W,), name, kind, b) for lead in LEADS for W in WIDTHS for kind in ("rms", "layer")
            for b in (False, True) if _fits(lead + (W,), dt)]


def _call(jax_arx, x, r, wt, b, kind):
    kw = {} if kind == "rms" else {"eps": EPS[kind]}  # rms: the default eps
    return jax_arx.psum_add_norm(x, r, wt, "tp", kind=kind, bias=b, **kw)


def _program(w, specs, data, smap=None):
    """One program of one call per spec: x's rows split over the ranks,
    the rest replicated. Returns (f, args)."""
    P = w.P

    def body(*ops):
        out, i = [], 0
        for (_, _, kind, has_bias) in specs:
            x, r, wt = ops[i][0], ops[i + 1], ops[i + 2]
            b = ops[i + 3] if has_bias else None
            i += 4 if has_bias else 3
            out += list(_call(w.jax_arx, x, r, wt, b, kind))
        return tuple(out)

    args, in_specs = [], []
    for (p, r, wt, b) in data:
        extra = [] if b is None else [b]
        args += [w.put(p)] + [w.rep(a) for a in [r, wt] + extra]
        in_specs += [P("tp")] + [P()] * (2 + len(extra))
    return w.smap(body, tuple(in_specs), (P(),) * (2 * len(specs))), args


def _check_outputs(w, case, specs, data, outs, **tol):
    for j, (spec, (p, r, wt, b)) in enumerate(zip(specs, data, strict=True)):
        dt = _dtypes()[spec[1]]
        want_h = reference_hidden(p, r, dt)
        ref_n = reference_normed(want_h, wt, b, spec[2], EPS[spec[2]])
        for got in w.shards(outs[2 * j + 1]):
            w.bits(case, got, want_h, f"hidden {spec}")
        for got in w.shards(outs[2 * j]):
            w.close(case, got, ref_n, dt, f"normed {spec}", **tol)


def case_norms(w):
    for name in _dtypes():
        specs = norm_specs(name)
        data = [inputs(w.world, s) for s in specs]
        f, args = _program(w, specs, data)
        before = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
        calls = w.calls(f, *args, target=TARGET)
        after = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
        if len(calls) != len(specs) or after != before:
            w.fail("norms", f"{name}: {len(calls)} fused calls lowered for {len(specs)}, {after - before} fallbacks")
        _check_outputs(w, "norms", specs, data, f(*args))


VMAP_SPECS = [((2, 40), "float32", "rms", True), ((1, 257), "bfloat16", "layer", False),
              ((2, 7), "float16", "layer", True)]
GRAD_SPECS = [((3, 40), "float32", "rms", False), ((2, 257), "float32", "layer", True),
              ((1, 7), "float32", "layer", False), ((2, 3, 40), "float32", "rms", True)]
FALLBACK_SPECS = [((5, 4096), "float32", "rms", True), ((2, 3, 6000), "bfloat16", "layer", False)]


def case_vmap(w, batch=3):
    """jax.vmap over a leading batch axis: one fused call, the bits of the
    unbatched calls row by row (and the reference's)."""
    for spec in VMAP_SPECS:
        _vmap_one(w, spec, batch)


def _vmap_one(w, spec, B):
    jax, jnp, P = w.jax, w.jax.numpy, w.P
    shape, name, kind, has_bias = spec
    dt = _dtypes()[name]
    parts, res, wt, b = inputs(w.world, ((B, *shape), name, kind, has_bias))
    bb = b if has_bias else np.zeros(shape[-1], dt)

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
    for k, what in enumerate(("batched normed", "batched hidden", "shared-residual normed",
                              "shared-residual hidden")):
        w.bits("vmap", outs[k], outs[4 + k], f"{spec} {what} vs row by row")
    for k, r in ((0, res), (2, np.broadcast_to(res[0], res.shape))):
        want_h = reference_hidden(parts, r, dt)
        w.bits("vmap", outs[k + 1], want_h, f"{spec} hidden vs numpy")
        w.close("vmap", outs[k], reference_normed(want_h, wt, b, kind, EPS[kind]), dt, f"{spec} normed")


def _norm_jnp(jnp, h, wt, b, kind, eps):
    d = h - jnp.mean(h, -1, keepdims=True) if kind == "layer" else h
    y = d / jnp.sqrt(jnp.mean(d * d, -1, keepdims=True) + np.float32(eps)) * wt
    return y if b is None else y + b


def case_grad(w):
    """jax.grad with respect to x and residual against jax.grad of the same
    function written without collectives, on one device: the sum over
    ranks of each rank's loss, with the partials as rows of one array."""
    for spec in GRAD_SPECS:
        for check_vma in (True, False):
            _grad_one(w, spec, check_vma)


def _grad_one(w, spec, check_vma):
    jax, jnp, P = w.jax, w.jax.numpy, w.P
    n = w.world
    shape, _, kind, _ = spec
    parts, res, wt, b = inputs(n, spec)
    rng = np.random.default_rng(zlib.crc32(repr(spec).encode()) + 1)
    c, c2 = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)

    def whole(xs, r):
        h = xs.sum(0) + r
        return n * ((_norm_jnp(jnp, h, wt, b, kind, EPS[kind]) * c).sum() + (h * c2).sum())

    want = [np.asarray(g) for g in jax.jit(jax.grad(whole, argnums=(0, 1)))(parts, res)]

    def body(x, r):
        normed, hidden = _call(w.jax_arx, x[0], r, wt, b, kind)
        return ((normed * c).sum() + (hidden * c2).sum()).reshape(1)

    f = w.smap(body, (P("tp"), P()), P("tp"), check_vma=check_vma)

    def loss(x, r):
        return f(x, r).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    if TARGET not in grad.lower(w.put(parts), w.rep(res)).as_text():
        w.fail("grad", f"{spec}: the gradient's primal is not the fused call")
    got = grad(w.put(parts), w.rep(res))
    for a, ref, what in ((got[0], want[0], "d/dx"), (got[1], want[1], "d/dresidual")):
        for shard in a.addressable_shards:
            g, ref_s = np.asarray(shard.data), ref[shard.index]
            ok = np.allclose(g, ref_s, rtol=1e-4, atol=1e-5 * np.abs(ref_s).max())
            w.record("grad", None if ok else f"{spec} check_vma={check_vma} {what}: max |diff| "
                     f"{np.abs(g - ref_s).max():.3g}, max |ref| {np.abs(ref_s).max():.3g}")


def case_fallback(w):
    """Partials past the one-shot limit: the unfused formula, jax.lax.psum's."""
    for spec in FALLBACK_SPECS:
        _fallback_one(w, spec)


def _fallback_one(w, spec):
    p, r, wt, b = d = inputs(w.world, spec)
    f, args = _program(w, [spec], [d])
    before = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
    text = f.lower(*args).as_text()
    after = sum(w.jax_arx.stats()["fallbacks"].get("psum_add_norm", {}).values())
    if TARGET in text or after <= before:
        w.fail("fallback", f"{spec}: fused call in the lowering: {TARGET in text}; fallbacks {before}->{after}")
    outs = w.together(f, *args)  # gloo: compiled first, started together
    dt = _dtypes()[spec[1]]
    want_h = reference_hidden(p, r, dt)
    ref_n = reference_normed(want_h, wt, b, spec[2], EPS[spec[2]])
    for got in w.shards(outs[1]):
        if dt == np.float32:
            ok = np.allclose(got, want_h, rtol=1e-5, atol=1e-6)
        else:  # gloo's bf16 sum may round after each rank: world ulps of sum |x_r|, one of hidden
            tol = w.world * _ulp(np.abs(p.astype(np.float64)).sum(0), dt) + _ulp(want_h.astype(np.float64), dt)
            ok = bool((np.abs(got.astype(np.float64) - want_h.astype(np.float64)) <= tol).all())
        w.record("fallback", None if ok else f"{spec}: hidden far from the numpy sum")
    for got in w.shards(outs[0]):
        loose = 1e-4 if dt == np.float32 else 2e-2
        bad = close_report(got, ref_n, dt, ulps=1, rel=loose, floor=loose)
        w.record("fallback", bad and f"{spec} normed: {bad}")


def _worker_main(argv):
    w = _Worker()
    for case in (case_norms, case_vmap, case_grad, case_fallback):
        w.timed(case)
    print(launched.RESULT + json.dumps({"world": w.world, "cases": w.cases, "digest": w.crc,
                                        "seconds": w.seconds}), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main(sys.argv)
