"""jax_arx.psum on the CPU backend, with the real C++ core, across processes.

Each test launches this file as a worker under ``python -m jax_arx.launch``
(``--worker SUITE``): every rank builds a 1-D mesh over all devices, runs a
suite of cases, and prints one ``RESULT {json}`` line; the test asserts on
what each rank reports. Per case a rank reports how many results it checked
and every mismatch; results are compared bit for bit with the reference
computed here with numpy (and ml_dtypes for bfloat16), independently of
jax and of jax_arx:

    acc = float32 zeros; for r in ranks (mesh order): acc += x_r.astype(float32)
    reference = acc.astype(dtype)      # numpy rounds to nearest even

and a CRC of all jax_arx results must be the same on every rank.

- ``full`` (2 and 3 processes, shm and tcp): bfloat16, float16 and float32;
  odd element counts; partials at and just past the one-shot limit
  (``JAX_ARX_SLOT_BYTES=64K`` here), the latter falling back to
  ``jax.lax.psum`` (gloo), whose result must be close to the numpy sum;
  programs with such a fallback are compiled first and started together on
  every process, since gloo's waits give up after a fixed time; a pytree
  psum (one call);
  mixed sizes and dtypes in one program; an input donated to the output;
  2000 dependent psums in a ``jax.lax.fori_loop``; 300 back-to-back jitted
  calls without waiting; psums in a ``jax.lax.scan``; six independent psums
  that XLA's CPU runtime would run in different orders on different ranks
  if jax_arx did not order them (they raced within 50 iterations before it
  did); ``jax.grad`` through jax_arx.psum against ``jax.grad`` of the same
  function written without collectives on one device (no reference uses a
  collective of jax's own); ``prefetch=`` (a pytree of weights, a hint for
  the CUDA handler that the CPU one never sees): the same bits as without it,
  under jit, grad and vmap, and no prefetch operands in the CPU call.
- ``quick`` (4 processes; 2 processes with 2 CPU devices each): a subset.
- ``failures`` (2 processes, ``JAX_ARX_TIMEOUT_S=3``): ranks that call psum
  with different sizes, or with as many elements in different shapes, get
  an error saying so, never a sum, and an all_gather on the same axis that
  ran before fails after it on every rank (the axis fails as one); then, after
  ``jax_arx.shutdown()`` and ``initialize()``, a peer that never calls makes
  rank 0's call fail within the timeout with an error naming rank 1, and
  ``jax_arx.check()`` raises it too.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise (failed in CI: tests/needs.py).
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


# --- the tests ----------------------------------------------------------------


@pytest.mark.parametrize("transport,nprocs", [("shm", 2), ("shm", 3), ("tcp", 2), ("tcp", 3)])
def test_full_suite(core_built, tmp_path, transport, nprocs):
    results = _run("full", nprocs, transport, tmp_path)
    launched.assert_all_correct(results, expect=FULL_CASES)


@pytest.mark.slow  # four processes on two cores: the fast tier stops at three
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_four_processes(core_built, tmp_path, transport):
    results = _run("quick", 4, transport, tmp_path)
    launched.assert_all_correct(results, expect=QUICK_CASES)


def test_two_processes_with_two_devices_each(core_built, tmp_path):
    results = _run("quick", 2, "shm", tmp_path, cpu_devices=2)
    launched.assert_all_correct(results, expect=QUICK_CASES)
    assert all(r["world"] == 4 and r["local_devices"] == 2 for r in results.values())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_failures_are_errors_not_sums(core_built, tmp_path, transport):
    results = _run("failures", 2, transport, tmp_path, env={"JAX_ARX_TIMEOUT_S": "3"})
    missing = launched.assert_failure_suite(results)
    for rank in (0, 1):  # the axis's bulk endpoints fail with its psum endpoints
        bulk = results[rank]["bulk_after"]
        assert results[rank]["bulk_before"] and not bulk["finite_result"], results[rank]
        assert "other communicator of its mesh axis" in bulk["error"], bulk
        assert "different collective" in bulk["error"] and bulk["kind"] == "CollectiveMismatchError", bulk
    for rank in (0, 1):  # the same element count in another shape
        shape = results[rank]["shape_mismatch"]
        assert not shape["finite_result"] and "different collective" in shape["error"], shape
        assert shape["kind"] == "CollectiveMismatchError", shape
    assert "rank 1" in missing["error"] and "timed out" in missing["error"], missing
    # What docs/usage.md and jax_arx.errors say the CPU backend raises:
    # jax's JaxRuntimeError where a compiled function's first run fails, a
    # plain ValueError where a later run does; translated() takes both.
    for rank in (0, 1):
        assert results[rank]["mismatch"]["error"].startswith("JaxRuntimeError: INTERNAL: jax_arx: "), results[rank]
    assert missing["error"].startswith("ValueError: INTERNAL: jax_arx: "), missing
    assert missing["kind"] == "CollectiveTimeoutError", missing
    assert results[1]["missing_peer"] == {"skipped": True}


# --- running workers ------------------------------------------------------------


def _run(suite, nprocs, transport, cwd, *, cpu_devices=1, env=None, timeout=300):
    return launched.run_suite(
        THIS,
        suite,
        nprocs,
        transport,
        cwd,
        cpu_devices=cpu_devices,
        timeout=timeout,
        env={"JAX_ARX_SLOT_BYTES": str(SLOT_BYTES), "JAX_ARX_TIMEOUT_S": "20", **(env or {})},
    )


# --- the worker -------------------------------------------------------------------


def reference_sum(partials, dtype):
    """The sum every rank must get: float32 accumulation in rank order,
    rounded once to ``dtype``. ``partials``: one row per rank."""
    acc = np.zeros(partials.shape[1:], np.float32)
    for row in partials:
        acc += row.astype(np.float32)
    return acc.astype(dtype)


class _Worker(launched.MeshWorker):
    """One rank's view over the "tp" axis, with a CRC of every jax_arx
    result it checked (ranks compare theirs: bit-identical results)."""

    def __init__(self):
        super().__init__("tp")
        self.crc = 0

    def put(self, g):
        """A global array, rows split over the ranks, from a numpy array every
        process computed alike."""
        return self.jax.make_array_from_callback(g.shape, self.sharded, lambda idx: g[idx])

    def shards(self, x):
        """This process's pieces of ``x``, by device."""
        return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]

    def check(self, case, got, want, what, ours=True):
        """Records whether ``got`` (one device's result) is bit for bit
        ``want``; adds jax_arx's results to the cross-rank CRC."""
        got = np.asarray(got)
        want = np.asarray(want, dtype=got.dtype).reshape(got.shape)
        bad = None
        if got.tobytes() != want.tobytes():
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            bad = (
                f"{what}: {int((got != want).sum())} of {got.size} elements differ, "
                f"max |diff| {float(np.nanmax(diff)) if diff.size else 0:.3g}"
            )
        self.record(case, bad)
        if ours:
            self.crc = zlib.crc32(got.tobytes(), self.crc)


def _dtypes():
    import ml_dtypes

    return {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def case_sizes(w: _Worker, dtype_names=("float32", "bfloat16", "float16")):
    """Odd counts and partials at and just past the one-shot limit, one
    program per dtype (so the psums in it are independent)."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(1)
    for name in dtype_names:
        dt = _dtypes()[name]
        limit = SLOT_BYTES // dt.itemsize
        counts = [1, 3, 7, 1001, 12345, limit, limit + 1]
        gs = [rng.normal(size=(w.world, n)).astype(np.float32).astype(dt) for n in counts]
        xs = [w.put(g) for g in gs]
        f = w.smap(lambda *xs: tuple(jax_arx.psum(x, "tp") for x in xs), (P("tp"),) * len(xs), (P(),) * len(xs))
        calls = w.calls(f, *xs, target="jax_arx_psum")
        if len(calls) != len(counts) - 1:  # every count but limit + 1 runs in jax_arx
            w.fail("sizes", f"{name}: {len(calls)} jax_arx calls for {len(counts) - 1} partials within the limit")
        outs = w.together(f, *xs)  # the partial past the limit is jax.lax.psum's: gloo
        for n, g, out in zip(counts[:-1], gs, outs, strict=False):  # the last past the limit: unchecked
            for got in w.shards(out):
                w.check("sizes", got, reference_sum(g, dt)[None], f"{name}[{n}]")
        # Just past the limit: the fallback's sum, which may add in another
        # order than rank order (to the dtype's rounding of numpy's).
        ref = reference_sum(gs[-1], dt)[None].astype(np.float32)
        for got in w.shards(outs[-1]):
            w.record(
                "sizes",
                None
                if np.allclose(got.astype(np.float32), ref, rtol=2e-2, atol=1e-2)
                else f"{name}[{limit + 1}]: the fallback is far from the numpy sum",
            )


def case_pytree(w: _Worker):
    """A pytree is one call with every leaf jax_arx runs as an operand; a
    leaf past the limit falls back on its own."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    dts = _dtypes()
    rng = np.random.default_rng(2)
    g = {
        "a": rng.normal(size=(w.world, 5)).astype(np.float32),
        "b": rng.normal(size=(w.world, 7)).astype(dts["bfloat16"]),
        "c": rng.normal(size=(w.world, 2, 3)).astype(np.float16),
        "d": rng.normal(size=(w.world, SLOT_BYTES // 4 + 1)).astype(np.float32),
    }
    x = jax.tree.map(w.put, g)
    f = w.smap(lambda t: jax_arx.psum(t, "tp"), (P("tp"),), P())
    calls = w.calls(f, x, target="jax_arx_psum")
    if len(calls) != 1 or calls[0].split("->")[-1].count("tensor<") != 3:
        w.fail("pytree", f"expected one jax_arx call with three results, got {calls}")
    out = w.together(f, x)  # leaf d is jax.lax.psum's: gloo
    for k in "abc":
        for got in w.shards(out[k]):
            w.check("pytree", got, reference_sum(g[k], g[k].dtype)[None], f"leaf {k}")
    ref_d = reference_sum(g["d"], np.float32)[None]
    for got in w.shards(out["d"]):
        w.record(
            "pytree",
            None
            if np.allclose(got, ref_d, rtol=1e-5, atol=1e-5)
            else "leaf d (jax.lax.psum's) is far from the numpy sum",
        )


def case_mixed(w: _Worker):
    """Sizes and dtypes mixed in one program, independent and dependent sums."""
    jax_arx, P = w.jax_arx, w.P
    dts = _dtypes()
    rng = np.random.default_rng(3)
    gs = [
        rng.normal(size=(w.world, 1001)).astype(np.float32),
        rng.normal(size=(w.world, 4097)).astype(dts["bfloat16"]),
        rng.normal(size=(w.world, 33)).astype(np.float16),
        rng.normal(size=(w.world, SLOT_BYTES // 4)).astype(np.float32),
    ]

    def body(a, b, c, d):
        sa = jax_arx.psum(a, "tp")
        return (
            sa,
            jax_arx.psum(b, "tp"),
            jax_arx.psum(c, "tp"),
            jax_arx.psum(d, "tp"),
            jax_arx.psum(sa * 2 + a * 0, "tp"),
        )  # depends on the first sum

    f = w.smap(body, (P("tp"),) * 4, (P(),) * 5)
    outs = f(*[w.put(g) for g in gs])
    refs = [reference_sum(g, g.dtype) for g in gs]
    refs.append(reference_sum(np.stack([refs[0] * np.float32(2)] * w.world), np.float32))
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        for got in w.shards(out):
            w.check("mixed", got, ref[None], f"output {i}")


def case_donated(w: _Worker):
    """The input buffer is donated to the output."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(4)
    g = rng.normal(size=(w.world, 4099)).astype(np.float32)
    f = w.smap(lambda x: jax_arx.psum(x, "tp"), P("tp"), P("tp"), check_vma=False, donate_argnums=0)
    x = w.put(g)
    compiled = f.lower(x).compile().as_text()
    if "input_output_alias" not in compiled:
        w.fail("donated", "XLA did not alias the donated input to the output")
    y = f(x)
    if not x.is_deleted():
        w.fail("donated", "the donated input was not consumed")
    for got in w.shards(y):
        w.check("donated", got, reference_sum(g, np.float32)[None], "donated")


def case_loop2000(w: _Worker, steps=2000):
    """2000 dependent psums in a fori_loop: each sums what the previous one
    returned (integers, so the reference is exact in any order)."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    n = 33
    g = np.random.default_rng(5).integers(0, 17, size=(w.world, n)).astype(np.float32)

    def body(x):
        r = jax.lax.axis_index("tp").astype(np.float32)

        def step(_, carry):
            c, _ = carry
            y = jax_arx.psum(c, "tp")
            return jax.numpy.mod(y + r + 1, 17), y

        return jax.lax.fori_loop(0, steps, step, (x, jax.numpy.zeros(x.shape, np.float32)))[1]

    out = w.smap(body, P("tp"), P())(w.put(g))
    c = g.copy()
    for _ in range(steps):
        y = reference_sum(c, np.float32)
        c = np.mod(y[None] + np.arange(w.world, dtype=np.float32)[:, None] + 1, 17).astype(np.float32)
    for got in w.shards(out):
        w.check("loop2000", got, y, f"after {steps} psums")


def case_python_loop(w: _Worker, calls=300):
    """Back-to-back jitted calls, two programs alternating over eight inputs,
    nothing waited for until the end."""
    jax_arx, P = w.jax_arx, w.P
    rng = np.random.default_rng(6)
    gs = [rng.normal(size=(w.world, 515)).astype(np.float32) for _ in range(8)]
    xs = [w.put(g) for g in gs]
    fs = [
        w.smap(lambda x: jax_arx.psum(x, "tp"), P("tp"), P()),
        w.smap(lambda x: jax_arx.psum(x * 2, "tp"), P("tp"), P()),
    ]
    outs = [fs[i % 2](xs[i % 8]) for i in range(calls)]
    refs = [[reference_sum(g * np.float32(k), np.float32) for g in gs] for k in (1, 2)]
    for i, out in enumerate(outs):
        for got in w.shards(out):
            w.check("python_loop", got, refs[i % 2][i % 8][None], f"call {i}")


def case_scan(w: _Worker):
    """psums in a jax.lax.scan body: a carried sum and a stacked output."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    steps, n = 16, 257
    g = np.random.default_rng(7).normal(size=(w.world, steps, n)).astype(np.float32)

    def body(x):
        def step(c, xt):
            s = jax_arx.psum(xt + c, "tp")
            return s, jax_arx.psum(xt, "tp")

        return jax.lax.scan(step, jax.numpy.zeros((n,), np.float32), x[0])

    carry, ys = w.smap(body, P("tp"), (P(), P()))(w.put(g))
    c = np.zeros(n, np.float32)
    want_ys = []
    for t in range(steps):
        want_ys.append(reference_sum(g[:, t], np.float32))
        c = reference_sum(g[:, t] + c, np.float32)
    for got in w.shards(carry):
        w.check("scan", got, c, "carry")
    for got in w.shards(ys):
        w.check("scan", got, np.stack(want_ys), "stacked outputs")


def case_independent6(w: _Worker, iters=50):
    """Six psums of distinct inputs that do not depend on each other, with
    buffers over 512 bytes and more than 8 thunks, so that XLA runs them
    concurrently: the inputs wait on busywork of six different lengths.
    Without jax_arx's ordering, ranks issued these in different orders
    within 50 iterations (with 2 and with 3 processes)."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    jnp = jax.numpy
    k, n = 6, 2048
    gs = [np.random.default_rng(10 + i).normal(size=(w.world, n)).astype(np.float32) for i in range(k)]

    def body(*xs):
        outs = []
        for i, x in enumerate(xs):
            h = x
            for _ in range(2 * (k - 1 - i)):
                h = jnp.sin(h) * 1.01 + jnp.cos(h[..., ::-1])
            outs.append(jax_arx.psum(x + 0 * h, "tp"))  # x, exactly, once the busywork is done
        return tuple(outs)

    f = w.smap(body, (P("tp"),) * k, (P(),) * k)
    xs = [w.put(g) for g in gs]
    refs = [reference_sum(g, np.float32)[None] for g in gs]
    for it in range(iters):
        for i, out in enumerate(f(*xs)):
            for got in w.shards(out):
                w.check("independent6", got, refs[i], f"iteration {it} psum {i}")


def case_grad(w: _Worker):
    """jax.grad through jax_arx.psum equals jax.grad of the same function
    written without collectives on one device (rank r's slice of x, the sums
    as sums over the rank axis): a reference that needs no collective of
    jax's own."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    jnp = jax.numpy
    n = w.world
    x = jnp.linspace(-1, 1, 2 * n, dtype=np.float32)
    wt = jnp.full((2,), 0.5, np.float32)

    def whole(x, wt):  # the sum over ranks of what each rank's body returns
        y = (jnp.sin(x.reshape(n, 2)) * wt).sum(0)
        return n * ((y * y).sum() + x.reshape(n, 2).sum(0).sum())

    ref = [np.asarray(g) for g in jax.jit(jax.grad(whole, argnums=(0, 1)))(x, wt)]
    for check_vma in (True, False):

        def body(x, wt):
            y = jax_arx.psum(jnp.sin(x) * wt, "tp")
            return (y * y).sum(keepdims=True) + jax_arx.psum(x, "tp").sum(keepdims=True)

        f = w.smap(body, (P("tp"), P()), P("tp"), check_vma=check_vma)
        got = jax.jit(jax.grad(lambda x, wt, f=f: f(x, wt).sum(), argnums=(0, 1)))(x, wt)
        for a, want, what in ((got[0], ref[0], "d/dx"), (got[1], ref[1], "d/dw")):
            for shard in a.addressable_shards:
                g = np.asarray(shard.data)
                w.record(
                    "grad",
                    None
                    if np.allclose(g, want[shard.index], rtol=1e-5, atol=1e-6)
                    else f"check_vma={check_vma} {what}: {g} != {want[shard.index]}",
                )


def case_prefetch(w: _Worker):
    """jax_arx.psum(..., prefetch=weights) is jax_arx.psum(...): the hint is
    for the CUDA handler; the call lowers the same on every platform (the
    weights are its last operands, counted by its `prefetch` attribute) and
    the CPU handler ignores them. The same bits with and without it, under
    jit, grad and vmap."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    jnp = jax.numpy
    dts = _dtypes()
    rng = np.random.default_rng(11)
    g = {
        "a": rng.normal(size=(w.world, 5)).astype(np.float32),
        "b": rng.normal(size=(w.world, 7)).astype(dts["bfloat16"]),
        "c": rng.normal(size=(w.world, 2, 3)).astype(np.float16),
    }
    # Weights the next layer would read: sharded over tp, and replicated.
    replicated = w.jax.sharding.NamedSharding(w.mesh, P())
    gw = [
        rng.normal(size=(w.world * 4, 16)).astype(dts["bfloat16"]),
        rng.integers(0, 9, size=(w.world, 33)).astype(np.int8),
        rng.normal(size=(64,)).astype(np.float32),
    ]
    ws = [w.put(gw[0]), w.put(gw[1]), jax.make_array_from_callback(gw[2].shape, replicated, lambda idx: gw[2][idx])]
    w_specs = [P("tp"), P("tp"), P()]
    x = jax.tree.map(w.put, g)

    def both(body, in_specs, out_specs, check_vma=True):
        """``body(..., prefetch)`` jitted with a prefetch tree and without."""
        return [
            w.smap(
                lambda *a, p=p: body(*a, prefetch={"w": a[-1], "w0": a[-1][0]} if p else None),
                in_specs,
                out_specs,
                check_vma=check_vma,
            )
            for p in (True, False)
        ]

    # jit, a pytree of three dtypes: one call of three results, with the four
    # weights as its prefetch operands.
    f, plain = both(lambda t, ws, prefetch: jax_arx.psum(t, "tp", prefetch=prefetch), (P("tp"), w_specs), P())
    calls = w.calls(f, x, ws, target="jax_arx_psum")
    if len(calls) != 1 or "prefetch = 4 : i64" not in calls[0] or calls[0].rsplit("->", 1)[-1].count("tensor<") != 3:
        w.fail("prefetch", f"expected one call of the three leaves with 4 prefetch operands, got {calls}")
    out, out_plain = f(x, ws), plain(x, ws)
    for k in g:
        for got, got_plain in zip(w.shards(out[k]), w.shards(out_plain[k]), strict=True):
            w.check("prefetch", got, reference_sum(g[k], g[k].dtype)[None], f"leaf {k}")
            w.check("prefetch", got, got_plain, f"leaf {k} vs without prefetch", ours=False)

    # grad, with respect to the input and to the weights (used, and prefetched).
    xg = w.put(rng.normal(size=(w.world, 6)).astype(np.float32))
    for check_vma in (True, False):

        def loss_body(x, ws, prefetch):
            y = jax_arx.psum(jnp.sin(x) * ws[2][0], "tp", prefetch=prefetch)
            return (y * y).sum(keepdims=True)

        f, plain = both(loss_body, (P("tp"), w_specs), P("tp"), check_vma=check_vma)
        grads = [
            jax.jit(jax.grad(lambda x, ws, h=h: h(x, ws).sum(), argnums=(0, 1), allow_int=True))(xg, ws)
            for h in (f, plain)
        ]
        for i, (a, b) in enumerate([(grads[0][0], grads[1][0]), (grads[0][1][2], grads[1][1][2])]):
            for got, got_plain in zip(w.shards(a), w.shards(b), strict=True):
                w.check(
                    "prefetch", got, got_plain, f"check_vma={check_vma} gradient {i} vs without prefetch", ours=False
                )  # gradients differ between ranks: not in the digest

    # vmap inside the shard_map: rows summed one by one, batched into one call.
    gv = rng.normal(size=(w.world * 3, 9)).astype(np.float32)
    f, plain = both(
        lambda v, ws, prefetch: jax.vmap(lambda r: jax_arx.psum(r, "tp", prefetch=prefetch))(v), (P("tp"), w_specs), P()
    )
    xv = w.put(gv)
    want = reference_sum(gv.reshape(w.world, 3, 9), np.float32)
    for got, got_plain in zip(w.shards(f(xv, ws)), w.shards(plain(xv, ws)), strict=True):
        w.check("prefetch", got, want, "vmap")
        w.check("prefetch", got, got_plain, "vmap vs without prefetch", ours=False)


FULL_CASES = [
    "sizes",
    "pytree",
    "mixed",
    "donated",
    "loop2000",
    "python_loop",
    "scan",
    "independent6",
    "grad",
    "prefetch",
]
QUICK_CASES = ["sizes", "mixed", "loop2000", "scan", "independent6"]


def _suite_full(w):
    for case in (
        case_sizes,
        case_pytree,
        case_mixed,
        case_donated,
        case_loop2000,
        case_python_loop,
        case_scan,
        case_independent6,
        case_grad,
        case_prefetch,
    ):
        w.timed(case)


def _suite_quick(w):
    w.timed(case_sizes, ("float32", "bfloat16"))
    w.timed(case_mixed)
    w.timed(case_loop2000, steps=500)
    w.timed(case_scan)
    w.timed(case_independent6, iters=20)


def _suite_failures(w):
    """Run with JAX_ARX_TIMEOUT_S=3 and two processes."""
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    me = jax.process_index()
    out = {}

    # A bulk collective on the axis first (its endpoints made and healthy).
    g = w.smap(lambda v: jax_arx.all_gather(v, "tp", tiled=True), P("tp"), P("tp"))
    y = w.put(np.ones((w.world, 8), np.float32))
    out["bulk_before"] = bool(np.isfinite(np.concatenate(w.shards(g(y)))).all())

    # Ranks that disagree on the size: an error, never a sum.
    n = 1000 + me
    x = jax.make_array_from_callback((w.world, n), w.sharded, lambda idx: np.ones((1, n), np.float32))
    f = w.smap(lambda v: jax_arx.psum(v, "tp"), P("tp"), P())
    out["mismatch"] = launched.mismatch_report(lambda: np.concatenate(w.shards(f(x))), jax_arx)
    # The axis fails as one (ffi/comm/endpoint.h, fail_together): the bulk
    # collective that ran before now fails too, on every rank.
    out["bulk_after"] = launched.mismatch_report(lambda: np.concatenate(w.shards(g(y))), jax_arx)

    # Ranks that hold as many elements in another shape ((64, 2) against
    # (2, 64)): an error, never an element-by-element sum.
    jax_arx.shutdown()
    jax_arx.initialize(w.mesh)
    shape = (64, 2) if me == 0 else (2, 64)
    x = jax.make_array_from_callback((w.world, *shape), w.sharded, lambda idx: np.ones((1, *shape), np.float32))
    f = w.smap(lambda v: jax_arx.psum(v, "tp"), P("tp"), P())
    out["shape_mismatch"] = launched.mismatch_report(lambda: np.concatenate(w.shards(f(x))), jax_arx)

    # Fresh endpoints, then a peer that never calls.
    jax_arx.shutdown()
    jax_arx.initialize(w.mesh)
    f = w.smap(lambda v: jax_arx.psum(v, "tp"), P("tp"), P())
    x = w.put(np.ones((w.world, 64), np.float32))
    f = f.lower(x).compile()  # the call alone is timed, not its compilation

    def alone():
        np.asarray(w.shards(f(x))[0])  # waits for the result (or raises)

    # Once on both ranks: a function that has run before fails through
    # jax's fast path, which raises its own type (docs/usage.md).
    alone()
    out["missing_peer"] = launched.alone_call_report(alone, jax_arx, "test_psum_cpu/rank0_done")
    return out


def _worker_main(argv):
    suite = argv[argv.index("--worker") + 1]
    w = _Worker()
    report = {"world": w.world, "local_devices": len(w.jax.local_devices())}
    if suite == "failures":
        report.update(_suite_failures(w))
    else:
        {"full": _suite_full, "quick": _suite_quick}[suite](w)
        report.update(cases=w.cases, digest=w.crc, seconds=w.seconds)
    print(RESULT + json.dumps(report), flush=True)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker_main(sys.argv)
