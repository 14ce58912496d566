"""jax_arx.psum's lowering and its prefetch hint, in one process on 4 CPU
devices (tests/stand_in_core.py).

- One side-effecting FFI call per psum (a pytree is one call with every leaf
  as an operand), each reading the result of the jax_arx call before it in
  its block, and of nested computations holding calls, so that XLA issues
  them in program order; distinct, stable site tags.
- ``prefetch=``: the same bits with and without it (jit, grad, jvp, vmap);
  at most 8 arrays; lowered for CUDA (no GPU needed to lower) the call
  carries them last with a ``prefetch`` attribute, lowered for the CPU it
  does not; no cotangents, no call for the weights' tangents; dropped when
  vmap batches them and wherever jax.lax sums.
"""

import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_arx
from jax_arx import _comm
from stand_in_core import assert_bits_equal, auto_mesh, body_prims, needs_4_devices

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- lowering ------------------------------------------------------------------------


def _ffi_calls(text):
    """The jax_arx custom calls of a lowered module, in order: (name of the
    first result, operand names, the line)."""
    calls = []
    for line in text.splitlines():
        m = re.search(r"(%[\w]+)(:\d+)? = stablehlo.custom_call @jax_arx_psum\(([^)]*)\)", line)
        if m:
            first = m.group(1) + ("#0" if m.group(2) else "")
            calls.append((first, [o.strip() for o in m.group(3).split(",") if o.strip()], line))
    return calls


def _site(line):
    return int(re.search(r"site = (\d+) : i64", line).group(1))


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_lowers_to_one_side_effecting_ffi_call_per_psum(mesh4, check_vma):
    def body(x):
        return jax_arx.psum(x, "tp") + jax_arx.psum(x, "tp")  # two identical calls: both must stay

    f = jax.jit(
        jax.shard_map(body, mesh=mesh4, in_specs=P("tp"), out_specs=P() if check_vma else P("tp"), check_vma=check_vma)
    )
    calls = _ffi_calls(f.lower(jnp.ones(8, jnp.bfloat16)).as_text())
    assert len(calls) == 2
    comm_id = _comm.communicator("tp").comm_id
    for _, _, line in calls:
        assert "has_side_effect = true" in line
        assert f"comm_id = {comm_id} : i64" in line and "algorithm" not in line
    assert "(tensor<2xbf16>) -> tensor<2xbf16>" in calls[0][2]
    # The second reads the first's result (a dependency operand, after its input).
    assert calls[1][1] == ["%arg1", calls[0][0]]
    assert "(tensor<2xbf16>, tensor<2xbf16>) -> tensor<2xbf16>" in calls[1][2]
    assert _site(calls[0][2]) != _site(calls[1][2])


@needs_4_devices
def test_independent_psums_lower_to_a_chain_with_distinct_stable_sites(mesh4):
    def body(a, b, c, d):
        return tuple(jax_arx.psum(v * 2, "tp") for v in (a, b, c, d))

    def lower():
        f = jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=(P("tp"),) * 4, out_specs=(P(),) * 4))
        return _ffi_calls(f.lower(*[jnp.ones(8)] * 4).as_text())

    calls = lower()
    assert len(calls) == 4
    assert [len(ops) for _, ops, _ in calls] == [1, 2, 2, 2]
    for prev, (_, ops, _) in zip(calls, calls[1:], strict=False):
        assert ops[-1] == prev[0]  # each call reads the previous call's first result
    sites = [_site(line) for _, _, line in calls]
    assert len(set(sites)) == 4 and all(0 < s < 2**48 for s in sites)
    assert [_site(line) for _, _, line in lower()] == sites  # the same program, the same tags


@needs_4_devices
def test_the_site_tag_tells_shapes_of_one_size_apart(mesh4):
    # (64, 2) on one rank and (2, 64) on another hold as many elements of one
    # dtype at the same call site: only the tag keeps them from being summed
    # element by element (jax_arx/_ordering.py).
    def site(shape):
        f = jax.jit(jax.shard_map(lambda v: jax_arx.psum(v, "tp"), mesh=mesh4, in_specs=P("tp"), out_specs=P()))
        (call,) = _ffi_calls(f.lower(jnp.ones((4 * shape[0], shape[1]), jnp.float32)).as_text())
        return _site(call[2])

    assert site((64, 2)) != site((2, 64))
    assert site((64, 2)) == site((64, 2))  # the same program, the same tag


@needs_4_devices
def test_pytree_psum_lowers_to_one_call(mesh4):
    f = jax.jit(jax.shard_map(lambda t: jax_arx.psum(t, "tp"), mesh=mesh4, in_specs=(P("tp"),), out_specs=P()))
    tree = {"a": jnp.ones(8), "b": jnp.ones((4, 3), jnp.bfloat16), "c": jnp.ones(12, jnp.float16)}
    calls = _ffi_calls(f.lower(tree).as_text())
    assert len(calls) == 1 and len(calls[0][1]) == 3
    assert "-> (tensor<2xf32>, tensor<1x3xbf16>, tensor<3xf16>)" in calls[0][2]


@needs_4_devices
def test_a_psum_after_nested_computations_depends_on_their_last_calls(mesh4):
    ps = lambda v: jax_arx.psum(v, "tp")

    @jax.jit
    def inner(x):
        return x * 5, ps(x * 3)

    def body(x):
        a = ps(x)
        b = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, ps(c[1])), (0, x))[1]
        c = jax.lax.fori_loop(0, 3, lambda i, v: ps(v), x)
        d = jax.lax.cond(x[0] > 0, lambda: ps(x), lambda: x)
        e, f = inner(x)
        return a + b + c + d + e + f + ps(x + 1)

    g = jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    text = g.lower(jnp.ones(8)).as_text()
    calls = _ffi_calls(text)
    loops = re.findall(r"(%\w+):2 = stablehlo.while", text)
    (case,) = re.findall(r"(%\w+) = \"stablehlo.case\"", text)
    (call,) = re.findall(r"(%\w+):2 = func.call @inner", text)
    assert len(calls) == 6
    last = max(calls, key=lambda c: len(c[1]))
    # The first call, each loop's carried sum, the conditional's result and
    # the nested jit's psum result (its second result; its first is x * 5).
    assert last[1][1:] == [calls[0][0], loops[0] + "#1", loops[1] + "#1", case, call + "#1"]
    # Each nested computation's call is the first in its block: no dependency.
    assert sorted(len(ops) for _, ops, _ in calls) == [1, 1, 1, 1, 1, 6]


@needs_4_devices
def test_lowering_for_other_devices_falls_back(mesh4, caplog):
    reordered = auto_mesh((4,), ("tp",), devices=jax.devices()[::-1])
    f = jax.jit(jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=reordered, in_specs=P("tp"), out_specs=P()))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = f.lower(jnp.ones(8)).as_text()
    assert "jax_arx_psum" not in text and "all_reduce" in text
    assert "has devices (3, 2, 1, 0) where jax_arx.initialize set axis 'tp' up for devices (0, 1, 2, 3)" in caplog.text


@needs_4_devices
def test_a_psum_past_the_envelope_announces_its_fallback_before_the_all_reduce(fake_core, monkeypatch):
    """jax_arx/_notice.py: the notice is a jax_arx psum of one float32 (in
    the chain of jax_arx calls, marked notice = 1), whose tag carries the
    operand's shape; jax.lax's all-reduce reads arx_after's result, which
    waits for the notice (a data path: XLA's CPU runtime orders nothing else)."""
    monkeypatch.setenv("JAX_ARX_SLOT_BYTES", "64")
    mesh4 = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh4)

    def lowered(rows):
        f = jax.jit(jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=mesh4, in_specs=P("tp"), out_specs=P()))
        return f.lower(jnp.ones((4 * rows, 4), jnp.float32)).as_text()

    assert "notice = 1" not in lowered(4) and "arx_after" not in lowered(4)  # 64 bytes per device: jax_arx
    text = lowered(8)  # 128 bytes: jax.lax, after a notice
    (notice,) = _ffi_calls(text)
    assert "notice = 1" in notice[2] and "tensor<1xf32>" in notice[2]
    after = re.search(r"(%[\w]+) = stablehlo.custom_call @arx_after\(([^)]*)\)", text)
    assert after and notice[0] in after.group(2).split(", ")
    assert re.search(r"stablehlo.all_reduce\S*\(" + re.escape(after.group(1)) + r"\)", text), text
    # Another shape past the envelope: another notice, which a peer's does not match.
    assert _site(notice[2]) != _site(_ffi_calls(lowered(16))[0][2])


# --- prefetch: a hint for the CUDA handler, dropped everywhere else -------------------


def _weights(n=3):
    """Prefetch trees of ``n`` leaves (several dtypes), as global arrays and
    their in_specs: some sharded over tp, some replicated."""
    leaves = [jnp.ones((8, 3), jnp.bfloat16), jnp.arange(5, dtype=jnp.int8), jnp.full((4, 2), 0.5)]
    specs = [P("tp"), P(), P()]
    return [leaves[i % 3] * (i + 1) for i in range(n)], [specs[i % 3] for i in range(n)]


def _with_and_without_prefetch(mesh, body_of, in_specs, out_specs, check_vma):
    """The same program with a prefetch tree passed to every psum and
    without one, jitted. ``body_of(psum)`` builds a body of (x, ws)."""

    def prefetching(x, axis, ws):
        return jax_arx.psum(x, axis, prefetch={"w": ws, "first": ws[0]})

    def plain(x, axis, ws):
        return jax_arx.psum(x, axis)

    return [
        jax.jit(jax.shard_map(body_of(psum), mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))
        for psum in (prefetching, plain)
    ]


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_prefetch_changes_no_value(mesh4, lax_lowering, check_vma):
    ws, w_specs = _weights(3)

    def body_of(psum):
        def body(x, tree, ws):
            # A pytree of several dtypes (one call), and a sum of a sum.
            y = psum({"a": jnp.sin(x) * ws[2][0, 0], "b": tree}, "tp", ws)
            z = psum(y["a"] * y["a"], "tp", ws)
            return (
                z.sum(keepdims=True)
                + y["b"]["c"].astype(jnp.float32).sum(keepdims=True)
                + y["b"]["d"].sum(keepdims=True)
            )

        return body

    out_spec = P("tp")
    specs = (P("tp"), {"c": P("tp"), "d": P("tp")}, w_specs)
    arx, plain = _with_and_without_prefetch(mesh4, body_of, specs, out_spec, check_vma)
    x = jnp.linspace(-1, 1, 8)
    tree = {"c": jnp.arange(12, dtype=jnp.bfloat16).reshape(4, 3), "d": jnp.linspace(0, 1, 4, dtype=jnp.float16)}
    assert_bits_equal(arx(x, tree, ws), plain(x, tree, ws))
    assert "prefetch=4" in str(jax.make_jaxpr(arx)(x, tree, ws))  # ws and ws[0]
    # grad: with respect to x, to the weights that are prefetched (and used), to both.
    for argnums in (0, 2, (0, 2)):
        grads = [
            jax.jit(jax.grad(lambda x, tree, ws, f=f: f(x, tree, ws).sum(), argnums=argnums, allow_int=True))(
                x, tree, ws
            )
            for f in (arx, plain)
        ]
        assert_bits_equal(*grads)
    # jvp, with tangents for x alone, the weights alone, and both.
    zero = lambda t: jax.tree.map(jnp.zeros_like, t)
    for tx, tws in ((x, zero(ws)), (zero(x), ws), (x, ws)):
        tws = [t if jnp.issubdtype(t.dtype, jnp.floating) else np.zeros(t.shape, jax.dtypes.float0) for t in tws]
        assert_bits_equal(*[jax.jvp(lambda x, ws, f=f: f(x, tree, ws), (x, ws), (tx, tws)) for f in (arx, plain)])
    # vmap of the jitted shard_map: the weights batched (the hint dropped) or not.
    xs = jnp.stack([x, x * 2, -x])
    assert_bits_equal(
        jax.vmap(arx, in_axes=(0, None, None))(xs, tree, ws), jax.vmap(plain, in_axes=(0, None, None))(xs, tree, ws)
    )
    wss = [jnp.stack([w, w]) for w in ws]
    assert_bits_equal(
        jax.vmap(arx, in_axes=(None, None, 0))(x, tree, wss), jax.vmap(plain, in_axes=(None, None, 0))(x, tree, wss)
    )
    assert lax_lowering["n"] > 0


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_prefetch_vmap_inside_shard_map(mesh4, lax_lowering, check_vma):
    ws, w_specs = _weights(2)

    def body_of(psum):
        return lambda x, ws: jax.vmap(lambda row: psum(row, "tp", ws), in_axes=1, out_axes=1)(x)

    arx, plain = _with_and_without_prefetch(
        mesh4, body_of, (P(None, "tp"), w_specs), P(None, None) if check_vma else P(None, "tp"), check_vma
    )
    y = jnp.arange(4 * 16.0).reshape(4, 16)
    assert_bits_equal(arx(y, ws), plain(y, ws))
    assert_bits_equal(
        arx(y, ws),
        jax.jit(
            jax.shard_map(
                lambda x, ws: jax.vmap(lambda r: jax.lax.psum(r, "tp"), in_axes=1, out_axes=1)(x),
                mesh=mesh4,
                in_specs=(P(None, "tp"), w_specs),
                out_specs=P(None, None) if check_vma else P(None, "tp"),
                check_vma=check_vma,
            )
        )(y, ws),
    )


@needs_4_devices
def test_prefetch_takes_at_most_8_arrays(mesh4):
    def lower(n):
        ws, specs = _weights(n)
        f = jax.jit(
            jax.shard_map(
                lambda x, ws: jax_arx.psum(x, "tp", prefetch=ws), mesh=mesh4, in_specs=(P("tp"), specs), out_specs=P()
            )
        )
        return f.lower(jnp.ones(8), ws).as_text()

    assert "jax_arx_psum" in lower(8)
    with pytest.raises(ValueError, match=r"prefetch has 9 arrays; a call prefetches at most 8"):
        lower(9)
    with pytest.raises(ValueError, match="at most 8"):  # checked even where jax.lax sums
        jax.vmap(lambda r: jax_arx.psum(r, "i", prefetch=[r] * 9), axis_name="i")(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="prefetch takes arrays or pytrees of arrays, got a leaf of type str"):
        jax.vmap(lambda r: jax_arx.psum(r, "i", prefetch={"w": "weights"}), axis_name="i")(jnp.ones((2, 3)))


def _cuda_text(f, *args):
    """``f`` lowered for CUDA, which needs no GPU (only the lowering rules)."""
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_prefetch_lowers_to_the_same_operands_on_every_platform(mesh4, check_vma):
    def body(x, w, b):
        y = jax_arx.psum(x, "tp")
        return jax_arx.psum(x * 2, "tp", prefetch=(w, b)) + y

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh4,
            in_specs=(P("tp"), P("tp"), P()),
            out_specs=P() if check_vma else P("tp"),
            check_vma=check_vma,
        )
    )
    args = (jnp.ones(8, jnp.bfloat16), jnp.ones((8, 16), jnp.bfloat16), jnp.ones(5, jnp.float32))
    comm_id = _comm.communicator("tp").comm_id
    # The leaves, the dependency operands, then the prefetch operands, counted
    # by the attribute; the CPU handler takes the same call and ignores them.
    texts = {
        "cpu": f.lower(*args).as_text(),
        "cuda": _cuda_text(f, *args),
        "both": f.trace(*args).lower(lowering_platforms=("cpu", "cuda")).as_text(),
    }
    for platform, text in texts.items():
        calls = _ffi_calls(text)
        assert len(calls) == 2, platform
        assert "prefetch" not in calls[0][2]
        first, (_, ops, line) = calls[0][0], calls[1]
        assert "prefetch = 2 : i64" in line and "has_side_effect = true" in line
        assert len(ops) == 4 and ops[1] == first
        assert "(tensor<2xbf16>, tensor<2xbf16>, tensor<2x16xbf16>, tensor<5xf32>) -> tensor<2xbf16>" in line
        assert f"comm_id = {comm_id} : i64" in line
        assert "stablehlo.case" not in text  # no switch on the platform
    sites = {_site(_ffi_calls(t)[1][2]) for t in texts.values()}
    assert len(sites) == 1  # the same call site on every platform


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_prefetch_is_not_differentiated_through(mesh4, check_vma):
    def program(prefetch):
        def body(x, w):
            return (jax_arx.psum(jnp.sin(x), "tp", prefetch=w if prefetch else None) * w[0]).sum(keepdims=True)

        return jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=check_vma))

    def calls(f, *args):
        return [("prefetch = 1 : i64" in line, len(ops)) for _, ops, line in _ffi_calls(_cuda_text(f, *args))]

    f, plain = program(True), program(False)
    x, w = jnp.linspace(-1, 1, 8), jnp.full((3,), 0.5)
    # Reverse mode. The forward call runs when its value is needed (for the
    # gradient with respect to w), with the weights; a cotangent sum is a
    # jax_arx call without them: check_vma=False, x's (psum transposes to
    # psum); True, one in every case, the sum of pvary's transpose, which
    # jax_arx makes its own (jax_arx/_grad.py).
    for argnums in (0, 1, (0, 1)):
        got, want = [
            calls(jax.jit(jax.grad(lambda x, w, p=p: p(x, w).sum(), argnums=argnums)), x, w) for p in (f, plain)
        ]
        assert [pf for pf, _ in got] == [n == 2 for _, n in got]  # prefetch: x and the weights
        assert [pf for pf, _ in got] == (
            ([True] if argnums != 0 else []) + ([False] if argnums != 1 or check_vma else [])
        )
        assert len(got) == len(want)
    # Forward mode: the tangent's sum is a call of its own, without the weights, and
    # there is none for a tangent of the weights alone.
    for tx, calls_want in ((jnp.ones_like(x), [(True, 2), (False, 2)]), (None, [(True, 2)])):

        def jvp(x, w, tx=tx):
            if tx is None:
                return jax.jvp(lambda w: f(x, w), (w,), (jnp.ones_like(w),))
            return jax.jvp(f, (x, w), (tx, jnp.ones_like(w)))

        assert calls(jax.jit(jvp), x, w) == calls_want  # the tangent's call reads the first (ordering)


@needs_4_devices
def test_prefetch_batched_by_vmap_is_dropped(mesh4):
    w_shared, w_batched = jnp.ones((4, 8)), jnp.ones((2, 4, 8))
    f = jax.shard_map(
        lambda x, a, b: jax_arx.psum(x, "tp", prefetch=(a, b)), mesh=mesh4, in_specs=(P("tp"), P(), P()), out_specs=P()
    )
    # in_axes of (x, a, b), and how many of a, b the call prefetches.
    for in_axes, kept in (((0, None, None), 2), ((0, None, 0), 1), ((None, 0, None), 1), ((0, 0, 0), 0)):
        args = [jnp.ones((2, 8)) if in_axes[0] == 0 else jnp.ones(8)]
        args += [w_batched if a == 0 else w_shared for a in in_axes[1:]]
        ((_, ops, line),) = _ffi_calls(_cuda_text(jax.jit(jax.vmap(f, in_axes=in_axes)), *args))
        assert len(ops) == 1 + kept
        assert (f"prefetch = {kept} : i64" in line) if kept else ("prefetch" not in line)


@needs_4_devices
def test_prefetch_is_dropped_where_jax_lax_sums(mesh4, caplog):
    w = jnp.ones((4, 4))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = body_prims(mesh4, lambda x: jax_arx.psum(x, "tp", prefetch=w * 2), jnp.ones(8, jnp.int32))
    assert "psum_invariant" in prims and not any("jax_arx" in p for p in prims)
    # A constant is no buffer of the program: nothing to prefetch.
    jaxpr = jax.make_jaxpr(
        jax.shard_map(lambda x: jax_arx.psum(x, "tp", prefetch=np.ones(3)), mesh=mesh4, in_specs=P("tp"), out_specs=P())
    )(jnp.ones(8))
    assert "prefetch=0" in str(jaxpr)
    # Where the lowering falls back (another device order), the weights go with the FFI call.
    reordered = auto_mesh((4,), ("tp",), devices=jax.devices()[::-1])
    f = jax.jit(
        jax.shard_map(
            lambda x, w: jax_arx.psum(x, "tp", prefetch=w), mesh=reordered, in_specs=(P("tp"), P()), out_specs=P()
        )
    )
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = _cuda_text(f, jnp.ones(8), w)
    assert "jax_arx_psum" not in text and "all_reduce" in text
