"""jax_arx.psum's rules, in one process on 4 CPU devices (tests/stand_in_core.py).

- The primitive's typing (shape, dtype, weak type, varying manual axes) is
  compared with jax.lax.psum's under shard_map with check_vma True and
  False.
- ``test_rules_under_lax_lowering_*``: jax_arx's rules (binding, jax.grad,
  jax.jvp, jax.vmap, the jit cache) with its primitive lowered as jax's own
  all-reduce (the ``lax_lowering`` fixture), compared with jax.lax.psum.
  They compare jax with jax: they show the rules right, never the sums,
  which tests/test_psum_cpu.py and tests/test_core_cpu.py check with the
  real core against numpy.
- The fallback to jax.lax: each reason, its log line, JAX_ARX_FALLBACK.
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
from jax_arx import _comm, _compat, _registry
from stand_in_core import assert_bits_equal, auto_mesh, body_prims, inner_jaxpr, needs_4_devices, prim_names

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- typing: abstract evaluation and vma -----------------------------------------


def _types_side_by_side(mesh, check_vma, x, in_spec, axis="tp"):
    """The type of jax_arx.psum's and of jax.lax.psum's result, taken inside
    the same shard_map body."""
    seen = {}

    def body(x):
        seen["arx"] = jax.typeof(jax_arx.psum(x, axis))
        seen["lax"] = jax.typeof(jax.lax.psum(x, axis))
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=in_spec, check_vma=check_vma)
    jaxpr = jax.make_jaxpr(f)(x)
    return seen["arx"], seen["lax"], inner_jaxpr(jaxpr)


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(), (3,), (5, 7)])
def test_type_matches_lax_for_varying_input(mesh4, check_vma, dtype, shape):
    x = jnp.ones((4, *shape), dtype) if shape else jnp.ones((4,), dtype)
    arx, lax, body = _types_side_by_side(mesh4, check_vma, x, P("tp"))
    assert arx == lax
    assert arx.weak_type == lax.weak_type
    expected = "jax_arx_psum_invariant" if check_vma else "jax_arx_psum"
    assert prim_names(body)[0] == expected
    if check_vma:
        assert _compat.varying_axes(arx) == frozenset()


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_type_matches_lax_for_invariant_input(mesh4, check_vma):
    # A value not varying over the axis: jax inserts pvary (check_vma=True),
    # so the sum is size * x; the result types must agree either way.
    arx, lax, body = _types_side_by_side(mesh4, check_vma, jnp.ones((3,)), P())
    assert arx == lax and arx.weak_type == lax.weak_type
    if check_vma:
        assert prim_names(body)[:2] == ["pvary", "jax_arx_psum_invariant"]


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_weak_type_matches_lax(mesh4, check_vma):
    # A Python scalar argument is weakly typed; jax.lax.psum (0.10) keeps that
    # under check_vma=True and drops it under check_vma=False.
    arx, lax, _ = _types_side_by_side(mesh4, check_vma, 1.0, P())
    assert arx == lax and arx.weak_type == lax.weak_type


@needs_4_devices
def test_invariant_input_without_auto_pcast_is_the_same_type_error_as_lax(mesh4):
    def run(psum):
        f = jax.shard_map(lambda x: psum(x, "tp"), mesh=mesh4, in_specs=P(), out_specs=P(), check_vma=True)
        jax.make_jaxpr(f)(jnp.ones(3))

    jax.config.update("jax_auto_pcast", False)
    try:
        with pytest.raises(ValueError, match="variant->invariant") as lax_error:
            run(jax.lax.psum)
        with pytest.raises(ValueError, match="variant->invariant") as arx_error:
            run(jax_arx.psum)
    finally:
        jax.config.update("jax_auto_pcast", True)
    assert str(arx_error.value) == str(lax_error.value)


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_eval_shape_matches_lax(mesh4, check_vma):
    def make(psum):
        return jax.jit(
            jax.shard_map(
                lambda x: psum(x, "tp"),
                mesh=mesh4,
                in_specs=P("tp"),
                out_specs=P() if check_vma else P("tp"),
                check_vma=check_vma,
            )
        )

    x = jax.ShapeDtypeStruct((8, 3), jnp.bfloat16)
    assert jax.eval_shape(make(jax_arx.psum), x) == jax.eval_shape(make(jax.lax.psum), x)


@needs_4_devices
def test_pytree_and_axis_name_forms(mesh4):
    seen = {}

    def body(x):
        tree = {"a": x, "b": (x * 2, x.astype(jnp.bfloat16))}
        seen["str"] = jax_arx.psum(tree, "tp")
        seen["tuple"] = jax_arx.psum(x, ("tp",))
        seen["list"] = jax_arx.psum(x, ["tp"])
        seen["empty"], seen["x"] = jax_arx.psum(x, ()), x
        return x

    body_jaxpr = inner_jaxpr(
        jax.make_jaxpr(jax.shard_map(body, mesh=mesh4, in_specs=P("tp"), out_specs=P("tp")))(jnp.ones(8))
    )
    assert jax.tree.structure(seen["str"]) == jax.tree.structure({"a": 0, "b": (0, 0)})
    assert seen["str"]["b"][1].dtype == jnp.bfloat16
    # The pytree is one call with its three leaves as operands, in leaf order.
    calls = [e for e in body_jaxpr.eqns if e.primitive.name == "jax_arx_psum_invariant"]
    assert [len(e.invars) for e in calls] == [3, 1, 1]
    assert [v.aval.dtype for v in calls[0].outvars] == [jnp.float32, jnp.float32, jnp.bfloat16]
    assert seen["empty"] is seen["x"]  # no axis: the value itself, as jax.lax.psum gives it


# --- numerics, autodiff and batching against jax.lax.psum ---------------------------


def _pair(mesh, body_of, in_specs, out_specs, check_vma):
    """The same program with jax_arx.psum and with jax.lax.psum, jitted."""
    return [
        jax.jit(jax.shard_map(body_of(psum), mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))
        for psum in (jax_arx.psum, jax.lax.psum)
    ]


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rules_under_lax_lowering_values_match_lax(mesh4, lax_lowering, check_vma, dtype):
    arx, lax = _pair(mesh4, lambda psum: lambda x: psum(x, "tp"), P("tp"), P("tp"), check_vma)
    for n in (4, 4 * 7, 4 * 33):  # odd per-device element counts
        x = jnp.asarray(np.random.default_rng(n).normal(size=(n,)), dtype)
        np.testing.assert_array_equal(np.asarray(arx(x), np.float32), np.asarray(lax(x), np.float32))
    assert lax_lowering["n"] > 0


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("in_spec", [P("tp"), P()], ids=["varying", "invariant"])
def test_rules_under_lax_lowering_grad_matches_lax(mesh4, lax_lowering, check_vma, in_spec):
    def body_of(psum):
        def body(x, w):
            y = psum(jnp.sin(x) * w, "tp")
            return (y * y).sum(keepdims=True) + psum(x, "tp").sum(keepdims=True)

        return body

    arx, lax = _pair(mesh4, body_of, (in_spec, P()), P("tp"), check_vma)
    x = jnp.linspace(-1, 1, 8 if in_spec == P("tp") else 2)
    w = jnp.full(x.shape[0] // 4 if in_spec == P("tp") else x.shape[0], 0.5)
    for argnums in (0, 1, (0, 1)):
        g_arx = jax.grad(lambda x, w: arx(x, w).sum(), argnums=argnums)(x, w)
        g_lax = jax.grad(lambda x, w: lax(x, w).sum(), argnums=argnums)(x, w)
        jax.tree.map(np.testing.assert_allclose, g_arx, g_lax)


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_transpose_is_pvary_or_psum_like_lax(mesh4, check_vma):
    # check_vma=True: psum (varying -> invariant) transposes to pvary, which
    # moves no data; check_vma=False: psum transposes to psum.
    f = jax.shard_map(
        lambda x: jax_arx.psum(x, "tp"),
        mesh=mesh4,
        in_specs=P("tp"),
        out_specs=P() if check_vma else P("tp"),
        check_vma=check_vma,
    )
    x = jnp.ones(8)
    transpose = jax.linear_transpose(f, x)
    body = prim_names(inner_jaxpr(jax.make_jaxpr(transpose)(jax.eval_shape(f, x))))
    assert body == (["pvary"] if check_vma else ["jax_arx_psum"])


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_jvp_matches_lax(mesh4, lax_lowering, check_vma):
    arx, lax = _pair(mesh4, lambda psum: lambda x: psum(x * x, "tp"), P("tp"), P("tp"), check_vma)
    x, t = jnp.arange(8.0), jnp.ones(8)
    for a, b in zip(jax.jvp(arx, (x,), (t,)), jax.jvp(lax, (x,), (t,)), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_pytree_with_leaves_not_differentiated(mesh4, lax_lowering, check_vma):
    # One call sums leaves that depend on the differentiated input and
    # leaves that do not (constants of the linear program): only the former
    # have tangents and cotangents.
    def body_of(psum):
        return lambda x, c: psum({"a": x * 3, "b": c, "k": c * 0 + 1}, "tp")

    arx, lax = _pair(mesh4, body_of, (P("tp"), P("tp")), P() if check_vma else P("tp"), check_vma)
    x, c = jnp.linspace(-1, 1, 8), jnp.arange(8.0)
    loss = lambda f: lambda x, c: (jnp.sin(f(x, c)["a"]) * f(x, c)["b"]).sum()
    np.testing.assert_array_equal(jax.grad(loss(arx))(x, c), jax.grad(loss(lax))(x, c))
    for a, b in zip(jax.jvp(lambda x: arx(x, c), (x,), (x,)), jax.jvp(lambda x: lax(x, c), (x,), (x,)), strict=True):
        assert_bits_equal(a, b)
    t_arx, t_lax = [jax.linear_transpose(lambda x, f=f: f(x, c)["a"], x) for f in (arx, lax)]
    ct = jnp.ones(2 if check_vma else 8)
    assert_bits_equal(t_arx(ct), t_lax(ct))


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_vmap_inside_shard_map_decides_again(fake_core, lax_lowering, monkeypatch, check_vma):
    monkeypatch.setenv("JAX_ARX_SLOT_BYTES", "64")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)

    def body_of(psum):
        return lambda x: jax.vmap(lambda row: psum(row, "tp"), in_axes=1, out_axes=1)(x)

    out_spec = P(None, None) if check_vma else P(None, "tp")
    for rows, ours in ((4, True), (8, False)):  # per device: 4x4 f32 = 64 bytes fits, 8x4 does not
        arx, lax = _pair(mesh, body_of, P(None, "tp"), out_spec, check_vma)
        y = jnp.arange(rows * 16.0).reshape(rows, 16)
        body = inner_jaxpr(jax.make_jaxpr(arx)(y))
        assert any(n.startswith("jax_arx_psum") for n in prim_names(body)) == ours
        np.testing.assert_array_equal(arx(y), lax(y))


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_vmap_of_the_jitted_shard_map(mesh4, lax_lowering, check_vma):
    arx, lax = _pair(mesh4, lambda psum: lambda x: psum(x, "tp"), P("tp"), P() if check_vma else P("tp"), check_vma)
    z = jnp.arange(3 * 8.0).reshape(3, 8)
    np.testing.assert_array_equal(jax.vmap(arx)(z), jax.vmap(lax)(z))
    assert "jax_arx_psum" in str(jax.make_jaxpr(jax.vmap(arx))(z))


def test_vmap_axis_name_defers_to_lax(caplog):
    f = jax.vmap(lambda r: jax_arx.psum(r, "i"), axis_name="i")
    x = jnp.arange(12.0).reshape(3, 4)
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        np.testing.assert_array_equal(f(x), jax.vmap(lambda r: jax.lax.psum(r, "i"), axis_name="i")(x))
        assert "jax_arx" not in str(jax.make_jaxpr(f)(x))
    assert not caplog.records


@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter"])
def test_several_vmap_names_defer_to_lax_silently(monkeypatch, caplog, op):
    # Names bound by nested jax.vmap, no mesh axis among them: jax.lax's
    # collective (its result, or its error: jax 0.10 gathers and scatters
    # over one vmap name only), with no warning, and no JaxArxFallbackError
    # with JAX_ARX_FALLBACK=error (once an "unsupported multi-axis" fallback).
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")

    def outcome(fn):
        nested = jax.vmap(jax.vmap(lambda r: fn(r, ("i", "j")), axis_name="j"), axis_name="i")
        try:
            return np.asarray(nested(jnp.arange(2 * 3 * 6.0).reshape(2, 3, 6))), str(
                jax.make_jaxpr(nested)(jnp.zeros((2, 3, 6)))
            )
        except Exception as e:
            return f"{type(e).__name__}: {e}", ""

    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        (ours, jaxpr), (theirs, _) = outcome(getattr(jax_arx, op)), outcome(getattr(jax.lax, op))
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        np.testing.assert_array_equal(ours, theirs)
        assert "jax_arx" not in jaxpr
    assert not caplog.records


@needs_4_devices
def test_rules_under_lax_lowering_jit_cache_holds(mesh4, lax_lowering):
    f = jax.jit(jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=mesh4, in_specs=P("tp"), out_specs=P()))
    for _ in range(3):
        f(jnp.ones(8)).block_until_ready()
    assert lax_lowering["n"] == 1
    f(jnp.ones(12))  # a new shape lowers again
    assert lax_lowering["n"] == 2


@needs_4_devices
def test_rules_under_lax_lowering_two_axes_mesh_groups(mesh22, lax_lowering):
    arx, lax = _pair(mesh22, lambda psum: lambda x: psum(psum(x, "tp") * 2, "dp"), P("dp", "tp"), P(), True)
    x = jnp.arange(16.0).reshape(4, 4)
    np.testing.assert_array_equal(arx(x), lax(x))


@needs_4_devices
def test_constants_and_size_one_axes_are_left_to_lax(fake_core, caplog):
    mesh = auto_mesh((4, 1), ("tp", "one"))
    jax_arx.initialize(mesh)
    seen = {}

    def body(x):
        seen["const"] = jax_arx.psum(1.0, "tp")
        seen["one"] = jax_arx.psum(x, "one")
        return x

    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        body_jaxpr = inner_jaxpr(
            jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(jnp.ones(8))
        )
    assert not caplog.records
    assert "jax_arx" not in str(body_jaxpr)
    assert seen["const"] == 4.0
    assert all(a.comm_id != _comm.communicator_id(mesh, "one") for a in _registry._communicators.values())


def test_outside_shard_map_raises_like_lax():
    with pytest.raises(NameError, match="unbound axis name: tp"):
        jax.jit(lambda x: jax.lax.psum(x, "tp"))(jnp.ones(3))
    with pytest.raises(NameError, match=r"jax_arx.psum: axis name 'tp' is not bound here: the mesh's axes are \(\)"):
        jax.jit(lambda x: jax_arx.psum(x, "tp"))(jnp.ones(3))


@needs_4_devices
@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter"])
def test_an_axis_not_in_the_mesh_is_named(mesh4, op):
    # jax.lax fails here on a bare AssertionError; jax_arx names the axis and the mesh's.
    call = getattr(jax_arx, op)
    with pytest.raises(
        NameError,
        match=rf"jax_arx.{op}: axis name 'tpp' is not bound here: the mesh's axes are "
        r"\('tp',\), and the names bound where it is called are \('tp',\)",
    ):
        jax.make_jaxpr(
            jax.shard_map(lambda x: call(x, "tpp"), mesh=mesh4, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
        )(jnp.ones(8))


# --- fallback ---------------------------------------------------------------------


@needs_4_devices
def test_uninitialized_axis_falls_back_with_one_log_line(caplog):
    mesh = auto_mesh((4,), ("tp",))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        for _ in range(2):
            prims = body_prims(mesh, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8))
            assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
    assert [r.name for r in caplog.records] == ["jax_arx"]
    assert "mesh axis 'tp' has no jax_arx communicator: call jax_arx.initialize(mesh)" in caplog.records[0].message
    assert caplog.records[0].message.endswith("using jax.lax.psum")


@needs_4_devices
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.float64 if jax.config.jax_enable_x64 else jnp.uint8])
def test_unsupported_dtype_falls_back(mesh4, caplog, dtype):
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = body_prims(mesh4, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8, dtype))
    assert "jax_arx_psum_invariant" not in prims
    assert len(caplog.records) == 1 and "is not supported (float32, bfloat16 and float16 are)" in caplog.text


@needs_4_devices
@pytest.mark.parametrize(
    "variable,refused",
    [
        ("JAX_ARX_SLOT_BYTES", "exceeds the one-shot limit of 256 bytes; set JAX_ARX_SLOT_BYTES=272 on every process"),
        # Below the slot; on the CPU there is no two-shot past it.
        (
            "JAX_ARX_ONESHOT_MAX_BYTES",
            "exceeds JAX_ARX_ONESHOT_MAX_BYTES=256; set JAX_ARX_ONESHOT_MAX_BYTES=272 or unset it on every process",
        ),
    ],
    ids=["slot", "oneshot_max"],
)
def test_the_one_shot_limit_and_its_message(fake_core, monkeypatch, caplog, variable, refused):
    monkeypatch.setenv(variable, "256")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    psum = lambda x: jax_arx.psum(x, "tp")
    assert "jax_arx_psum_invariant" in body_prims(mesh, psum, jnp.ones(4 * 64))  # 256 bytes per device
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        assert "jax_arx_psum_invariant" not in body_prims(mesh, psum, jnp.ones(4 * 65))
        assert "jax_arx_psum_invariant" not in body_prims(mesh, psum, jnp.ones(4 * 100))
    assert len(caplog.records) == 1
    assert f"float32[65]{{V:tp}}: a partial of 260 bytes {refused}" in caplog.text
    assert _comm.communicator("tp").plan("psum", 256)[0] == 1  # one-shot
    assert _comm.communicator("tp").plan("psum", 257)[0] == 0


@needs_4_devices
def test_size_fallback_message_tells_the_whole_fix(fake_core, monkeypatch):
    # Past the send buffer too (defaults: 1 MiB slot, 4 MiB send): raising the
    # slot alone would fail config.load ("JAX_ARX_SEND_BYTES must be at least
    # JAX_ARX_SLOT_BYTES"). Doing exactly what the message says must work.
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    nbytes = 12 << 20
    algorithm, why = _comm.communicator("tp").plan("psum", nbytes)
    settings = dict(re.findall(r"(JAX_ARX_\w+)=(\w+)", why))
    assert algorithm == 0 and settings == {"JAX_ARX_SLOT_BYTES": "12MiB", "JAX_ARX_SEND_BYTES": "12MiB"}, why
    jax_arx.shutdown()
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert _comm.communicator("tp").plan("psum", nbytes)[0] == 1  # one-shot


@needs_4_devices
def test_several_axes_and_axis_index_groups_fall_back(mesh22, caplog):
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = body_prims(
            mesh22,
            lambda x: jax_arx.psum(x, ("dp", "tp")),
            jnp.ones((4, 4)),
            in_spec=P("dp", "tp"),
            out_spec=P("dp", "tp"),
        )
        assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
        prims = body_prims(
            mesh22,
            lambda x: jax_arx.psum(x, "tp", axis_index_groups=[[0, 1]]),
            jnp.ones((4, 4)),
            in_spec=P("dp", "tp"),
            out_spec=P("dp", "tp"),
            check_vma=False,
        )
        assert prims[0] == "psum" and not any("jax_arx" in p for p in prims)
    assert "a collective over several mesh axes at once ('dp', 'tp') is not supported" in caplog.text
    assert "axis_index_groups is not supported" in caplog.text


@needs_4_devices
def test_fallback_error_mode_raises(mesh4, monkeypatch):
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    with pytest.raises(
        jax_arx.JaxArxFallbackError, match=r"dtype int32 is not supported .*JAX_ARX_FALLBACK=error forbids"
    ):
        body_prims(mesh4, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8, jnp.int32))


@needs_4_devices
def test_another_mesh_with_the_same_axis_name_falls_back(mesh4, caplog):
    other = auto_mesh((2, 2), ("tp", "dp"))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = body_prims(
            other, lambda x: jax_arx.psum(x, "tp"), jnp.ones((4, 4)), in_spec=P("tp", "dp"), out_spec=P(None, "dp")
        )
    assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
    assert "is not the mesh jax_arx.initialize set axis 'tp' up for" in caplog.text


@needs_4_devices
def test_partially_manual_shard_map_falls_back(mesh22, caplog):
    f = jax.shard_map(
        lambda x: jax_arx.psum(x, "tp"), mesh=mesh22, in_specs=P(None, "tp"), out_specs=P(), axis_names={"tp"}
    )
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = str(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    assert "jax_arx_psum" not in text
    assert "not manual over mesh axes ['dp']" in caplog.text
