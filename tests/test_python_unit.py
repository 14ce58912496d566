"""Unit tests of jax_arx's Python layer, in one process (the C++ module only for
its option parser and size plans: tests/stand_in_core.py).

- The primitive's typing (shape, dtype, weak type, varying manual axes) is
  compared with jax.lax.psum's under shard_map with check_vma True and
  False.
- The lowering: one side-effecting FFI call per psum (a pytree is one call
  with every leaf as an operand), each reading the result of the jax_arx
  call before it in its block, and of nested computations holding calls,
  so that XLA issues them in program order; distinct, stable site tags.
- ``test_rules_under_lax_lowering_*``: jax_arx's rules (binding, jax.grad,
  jax.jvp, jax.vmap, the jit cache, prefetch) with its primitive lowered as
  jax's own all-reduce (the ``lax_lowering`` fixture), compared with
  jax.lax.psum, on 4 CPU devices in one process. They compare jax with
  jax: they show the rules right, never the sums, which
  tests/test_psum_cpu.py and tests/test_core_cpu.py check with the real
  core against numpy.
- ``prefetch=``: the same bits with and without it (jit, grad, jvp, vmap);
  at most 8 arrays; lowered for CUDA (no GPU needed to lower) the call
  carries them last with a ``prefetch`` attribute, lowered for the CPU it
  does not; no cotangents, no call for the weights' tangents; dropped when
  vmap batches them and wherever jax.lax sums.
- initialize / shutdown / check run against a stand-in for ``jax_arx._core``
  (tests/stand_in_core.py) that checks what jax_arx hands it; the options
  and the size plans are the real core's.
- The launcher runs small programs in 2 processes, one of them through the
  jax.distributed key-value store rendezvous with the stand-in core.
"""

import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from stand_in_core import FAKE_CORE_SOURCE, auto_mesh, inner_jaxpr, needs_4_devices, prim_names

import jax_arx
from jax_arx import _carriers, _comm, _compat, config, errors, launch

REPO = pathlib.Path(__file__).resolve().parents[1]

# --- configuration -------------------------------------------------------------

def test_config_defaults():
    cfg = config.load({})
    assert cfg == config.Config()
    assert (cfg.timeout_s, cfg.idle_spin_ms, cfg.idle_nap_us) == (30.0, 200, 200)
    assert (cfg.slot_bytes, cfg.send_bytes) == (1 << 20, 4 << 20)
    assert (cfg.transport, cfg.fallback, cfg.on_failure, cfg.debug) == (None, "lax", "raise", False)


def test_config_parses_every_variable():
    cfg = config.load({
        "JAX_ARX_TIMEOUT_S": "2.5", "JAX_ARX_IDLE_SPIN_MS": "0", "JAX_ARX_IDLE_NAP_US": "50",
        "JAX_ARX_TRANSPORT": "TCP", "JAX_ARX_FALLBACK": "error", "JAX_ARX_ON_FAILURE": "abort",
        "JAX_ARX_SLOT_BYTES": "64KiB", "JAX_ARX_SEND_BYTES": "2M", "JAX_ARX_TCP_ADDR": "198.51.100.7",
        "NCCL_IB_HCA": "mlx5_0", "JAX_ARX_IB_GID_INDEX": "3", "JAX_ARX_DEBUG": "yes",
    })
    assert cfg.timeout_s == 2.5 and cfg.idle_spin_ms == 0 and cfg.idle_nap_us == 50
    assert cfg.transport == "tcp" and cfg.fallback == "error" and cfg.on_failure == "abort"
    assert cfg.slot_bytes == 65536 and cfg.send_bytes == 2 << 20
    assert cfg.tcp_addr == "198.51.100.7" and cfg.ib_hca == "mlx5_0" and cfg.ib_gid_index == 3 and cfg.debug
    assert config.load({"JAX_ARX_IB_HCA": "mlx5_1", "NCCL_IB_HCA": "mlx5_0"}).ib_hca == "mlx5_1"
    assert config.load({"JAX_ARX_TRANSPORT": ""}).transport is None  # empty means unset


def test_config_endpoint_options_are_strings_the_core_accepts():
    env = {"JAX_ARX_ON_FAILURE": "abort", "JAX_ARX_IB_GID_INDEX": "1", "JAX_ARX_IB_HCA": "mlx5_0",
           "JAX_ARX_ONESHOT_MAX_BYTES": "64K", "JAX_ARX_CUDA_DIRECT": "0", "JAX_ARX_CUDA_PEER_MEMORY": "1",
           "JAX_ARX_IB_TIMEOUT": "20", "JAX_ARX_PREFILL_SLOT_BYTES": "0"}
    cfg = config.load(env)
    options = cfg.endpoint_options("127.0.0.1", {"cuda_ll_max_bytes": 0, "cuda_chunk_bytes": 4096})
    assert all(isinstance(v, str) for v in options.values())
    # The real core's parser takes every one (it rejects unknown keys and bad values).
    core = _comm._core()
    ep = core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, options)
    ep.close()
    with pytest.raises(RuntimeError, match="unknown endpoint option 'cuda_pipeline'"):
        core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, dict(options, cuda_pipeline="1"))
    with pytest.raises(ValueError, match="_tuning key 'chunk' is not one of"):
        cfg.endpoint_options(None, {"chunk": 1})
    assert options["abort_on_failure"] == "1" and options["tcp_addr"] == "127.0.0.1"
    assert options["slot_bytes"] == "1048576" and float(options["timeout_s"]) == 30.0
    assert "tcp_addr" not in config.Config().endpoint_options(None)


def test_config_topology():
    assert config.load({}).topology == "mesh" and "topology" not in config.Config().endpoint_options(None)
    cfg = config.load({"JAX_ARX_TOPOLOGY": "Ring"})
    assert cfg.topology == "ring" and cfg.endpoint_options(None)["topology"] == "ring"
    # initialize's argument overrides the variable, either way.
    assert config.with_topology(cfg, None) is cfg
    assert config.with_topology(cfg, "mesh").topology == "mesh"
    assert config.with_topology(config.load({}), "RING").topology == "ring"
    for bad in ("star", "", 4, True):
        with pytest.raises(jax_arx.ConfigError, match=r"initialize\(topology=.* is not accepted: use one of 'mesh', "
                                                      r"'ring', or None for JAX_ARX_TOPOLOGY"):
            config.with_topology(cfg, bad)
    # The real core takes the option, and refuses what Python would not hand it.
    core = pytest.importorskip("jax_arx._core", reason="needs the built C++ module")
    core.Endpoint(1, 0, 0, 4, "tcp", "cpu", "t", b"s" * 32, cfg.endpoint_options(None)).close()
    with pytest.raises(RuntimeError, match="neither 'mesh' nor 'ring'"):
        core.Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, {"topology": "star"})
    with pytest.raises(RuntimeError, match=r"5 ranks; a ring \(JAX_ARX_TOPOLOGY=ring\) takes 2 to 4"):
        core.Endpoint(1, 0, 0, 5, "tcp", "cpu", "t", b"s" * 32, {"topology": "ring"})


@pytest.mark.parametrize("env,options", [
    ({}, {}),
    ({"JAX_ARX_CUDA_DIRECT": "0"}, {"cuda_direct": "0"}),
    ({"JAX_ARX_CUDA_DIRECT": "off"}, {"cuda_direct": "0"}),
    ({"JAX_ARX_CUDA_DIRECT": "1"}, {}),  # the default
    ({"JAX_ARX_CUDA_PEER_MEMORY": "1"}, {"cuda_peer_memory": "1"}),
    ({"JAX_ARX_CUDA_PEER_MEMORY": "no"}, {"cuda_peer_memory": "0"}),
    ({"JAX_ARX_CUDA_DIRECT": "false", "JAX_ARX_CUDA_PEER_MEMORY": "true"},
     {"cuda_direct": "0", "cuda_peer_memory": "1"}),
])
def test_cuda_settings_reach_the_core_as_it_reads_them(env, options):
    # The strings the core's parser reads (ffi/base/config.cc; tests/cpp/test_config.cc
    # checks what it makes of them), and the core takes them.
    got = config.load(env).endpoint_options(None)
    assert {k: v for k, v in got.items() if k.startswith("cuda_")} == options
    _comm._core().Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, got).close()


@pytest.mark.parametrize("tuning,error", [
    ({"cuda_chunk_bytes": 100}, r"cuda_chunk_bytes \(100\) must be a multiple of 16"),
    ({"cuda_ll_max_bytes": -2}, r"cuda_ll_max_bytes \(-2\) must be -1 \(built in\), 0 \(off\) or a size"),
])
def test_cuda_tuning_the_core_refuses(tuning, error):
    options = config.load({}).endpoint_options(None, tuning)
    with pytest.raises(RuntimeError, match=error):
        _comm._core().Endpoint(1, 0, 0, 2, "tcp", "cpu", "t", b"s" * 32, options)


@pytest.mark.parametrize("name,value,accepted", [
    ("JAX_ARX_TIMEOUT_S", "soon", "positive number"),
    ("JAX_ARX_TIMEOUT_S", "-1", "positive number"),
    ("JAX_ARX_IDLE_SPIN_MS", "1.5", "non-negative integer"),
    ("JAX_ARX_IDLE_NAP_US", "-3", "non-negative integer"),
    ("JAX_ARX_TRANSPORT", "rdma", "shm, tcp, verbs"),
    ("JAX_ARX_TOPOLOGY", "torus", "mesh, ring"),
    ("JAX_ARX_FALLBACK", "warn", "lax, error"),
    ("JAX_ARX_GRAD_SUMS", "off", "jax_arx, lax"),
    ("JAX_ARX_ON_FAILURE", "exit", "raise, abort"),
    ("JAX_ARX_SLOT_BYTES", "1MB", "binary suffix"),
    ("JAX_ARX_SLOT_BYTES", "100", "multiple of 16"),
    ("JAX_ARX_SEND_BYTES", "0", "multiple of 16"),
    ("JAX_ARX_TCP_ADDR", "myhost", "IPv4 address"),
    ("JAX_ARX_IB_GID_INDEX", "x", "non-negative integer"),
    ("JAX_ARX_DEBUG", "maybe", "use 1 or 0"),
    ("JAX_ARX_CUDA_DIRECT", "2", "use 1 or 0"),
    ("JAX_ARX_CUDA_PEER_MEMORY", "auto", "use 1 or 0"),
])
def test_config_rejects_bad_values_naming_the_variable(name, value, accepted):
    with pytest.raises(jax_arx.ConfigError, match=f"{name}='{value}' is not accepted.*{accepted}"):
        config.load({name: value})


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
        return jax.jit(jax.shard_map(lambda x: psum(x, "tp"), mesh=mesh4, in_specs=P("tp"),
                                     out_specs=P() if check_vma else P("tp"), check_vma=check_vma))

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

    body_jaxpr = inner_jaxpr(jax.make_jaxpr(jax.shard_map(body, mesh=mesh4, in_specs=P("tp"),
                                                           out_specs=P("tp")))(jnp.ones(8)))
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
    return [jax.jit(jax.shard_map(body_of(psum), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                  check_vma=check_vma))
            for psum in (jax_arx.psum, jax.lax.psum)]


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rules_under_lax_lowering_values_match_lax(mesh4, lax_lowering, check_vma, dtype):
    arx, lax = _pair(mesh4, lambda psum: (lambda x: psum(x, "tp")), P("tp"), P("tp"), check_vma)
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
    f = jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=mesh4, in_specs=P("tp"),
                      out_specs=P() if check_vma else P("tp"), check_vma=check_vma)
    x = jnp.ones(8)
    transpose = jax.linear_transpose(f, x)
    body = prim_names(inner_jaxpr(jax.make_jaxpr(transpose)(jax.eval_shape(f, x))))
    assert body == (["pvary"] if check_vma else ["jax_arx_psum"])


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_jvp_matches_lax(mesh4, lax_lowering, check_vma):
    arx, lax = _pair(mesh4, lambda psum: (lambda x: psum(x * x, "tp")), P("tp"), P("tp"), check_vma)
    x, t = jnp.arange(8.0), jnp.ones(8)
    for a, b in zip(jax.jvp(arx, (x,), (t,)), jax.jvp(lax, (x,), (t,))):
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
    loss = lambda f: (lambda x, c: (jnp.sin(f(x, c)["a"]) * f(x, c)["b"]).sum())
    np.testing.assert_array_equal(jax.grad(loss(arx))(x, c), jax.grad(loss(lax))(x, c))
    for a, b in zip(jax.jvp(lambda x: arx(x, c), (x,), (x,)), jax.jvp(lambda x: lax(x, c), (x,), (x,))):
        _assert_bits_equal(a, b)
    t_arx, t_lax = [jax.linear_transpose(lambda x, f=f: f(x, c)["a"], x) for f in (arx, lax)]
    ct = jnp.ones(2 if check_vma else 8)
    _assert_bits_equal(t_arx(ct), t_lax(ct))


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
    arx, lax = _pair(mesh4, lambda psum: (lambda x: psum(x, "tp")), P("tp"), P() if check_vma else P("tp"),
                     check_vma)
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
            return np.asarray(nested(jnp.arange(2 * 3 * 6.0).reshape(2, 3, 6))), str(jax.make_jaxpr(nested)(
                jnp.zeros((2, 3, 6))))
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
    arx, lax = _pair(mesh22, lambda psum: (lambda x: psum(psum(x, "tp") * 2, "dp")), P("dp", "tp"), P(), True)
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
        body_jaxpr = inner_jaxpr(jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("tp"),
                                                               out_specs=P("tp")))(jnp.ones(8)))
    assert not caplog.records
    assert "jax_arx" not in str(body_jaxpr)
    assert seen["const"] == 4.0
    assert all(a.comm_id != _comm.communicator_id(mesh, "one") for a in _comm._communicators.values())


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
    with pytest.raises(NameError, match=rf"jax_arx.{op}: axis name 'tpp' is not bound here: the mesh's axes are "
                                        r"\('tp',\), and the names bound where it is called are \('tp',\)"):
        jax.make_jaxpr(jax.shard_map(lambda x: call(x, "tpp"), mesh=mesh4, in_specs=P("tp"), out_specs=P("tp"),
                                     check_vma=False))(jnp.ones(8))


# --- fallback ---------------------------------------------------------------------

def _body_prims(mesh, body, x, in_spec=P("tp"), out_spec=P("tp"), check_vma=True):
    f = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
    return prim_names(inner_jaxpr(jax.make_jaxpr(f)(x)))


@needs_4_devices
def test_uninitialized_axis_falls_back_with_one_log_line(caplog):
    mesh = auto_mesh((4,), ("tp",))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        for _ in range(2):
            prims = _body_prims(mesh, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8))
            assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
    assert [r.name for r in caplog.records] == ["jax_arx"]
    assert "mesh axis 'tp' has no jax_arx communicator: call jax_arx.initialize(mesh)" in caplog.records[0].message
    assert caplog.records[0].message.endswith("using jax.lax.psum")


@needs_4_devices
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.float64 if jax.config.jax_enable_x64 else jnp.uint8])
def test_unsupported_dtype_falls_back(mesh4, caplog, dtype):
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = _body_prims(mesh4, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8, dtype))
    assert "jax_arx_psum_invariant" not in prims
    assert len(caplog.records) == 1 and "is not supported (float32, bfloat16 and float16 are)" in caplog.text


@needs_4_devices
@pytest.mark.parametrize("variable,refused", [
    ("JAX_ARX_SLOT_BYTES", "exceeds the one-shot limit of 256 bytes; set JAX_ARX_SLOT_BYTES=272 on every process"),
    # Below the slot; on the CPU there is no two-shot past it.
    ("JAX_ARX_ONESHOT_MAX_BYTES", "exceeds JAX_ARX_ONESHOT_MAX_BYTES=256; set JAX_ARX_ONESHOT_MAX_BYTES=272 or unset "
                                  "it on every process"),
], ids=["slot", "oneshot_max"])
def test_the_one_shot_limit_and_its_message(fake_core, monkeypatch, caplog, variable, refused):
    monkeypatch.setenv(variable, "256")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    psum = lambda x: jax_arx.psum(x, "tp")
    assert "jax_arx_psum_invariant" in _body_prims(mesh, psum, jnp.ones(4 * 64))  # 256 bytes per device
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        assert "jax_arx_psum_invariant" not in _body_prims(mesh, psum, jnp.ones(4 * 65))
        assert "jax_arx_psum_invariant" not in _body_prims(mesh, psum, jnp.ones(4 * 100))
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
        prims = _body_prims(mesh22, lambda x: jax_arx.psum(x, ("dp", "tp")), jnp.ones((4, 4)),
                            in_spec=P("dp", "tp"), out_spec=P("dp", "tp"))
        assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
        prims = _body_prims(mesh22, lambda x: jax_arx.psum(x, "tp", axis_index_groups=[[0, 1]]),
                            jnp.ones((4, 4)), in_spec=P("dp", "tp"), out_spec=P("dp", "tp"), check_vma=False)
        assert prims[0] == "psum" and not any("jax_arx" in p for p in prims)
    assert "a collective over several mesh axes at once ('dp', 'tp') is not supported" in caplog.text
    assert "axis_index_groups is not supported" in caplog.text


@needs_4_devices
def test_fallback_error_mode_raises(mesh4, monkeypatch):
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    with pytest.raises(jax_arx.JaxArxFallbackError,
                       match=r"dtype int32 is not supported .*JAX_ARX_FALLBACK=error forbids"):
        _body_prims(mesh4, lambda x: jax_arx.psum(x, "tp"), jnp.ones(8, jnp.int32))


@needs_4_devices
def test_another_mesh_with_the_same_axis_name_falls_back(mesh4, caplog):
    other = auto_mesh((2, 2), ("tp", "dp"))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = _body_prims(other, lambda x: jax_arx.psum(x, "tp"), jnp.ones((4, 4)),
                            in_spec=P("tp", "dp"), out_spec=P(None, "dp"))
    assert prims[0] == "psum_invariant" and not any("jax_arx" in p for p in prims)
    assert "is not the mesh jax_arx.initialize set axis 'tp' up for" in caplog.text


@needs_4_devices
def test_partially_manual_shard_map_falls_back(mesh22, caplog):
    f = jax.shard_map(lambda x: jax_arx.psum(x, "tp"), mesh=mesh22, in_specs=P(None, "tp"), out_specs=P(),
                      axis_names={"tp"})
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = str(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    assert "jax_arx_psum" not in text
    assert "not manual over mesh axes ['dp']" in caplog.text


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

    f = jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=P("tp"), out_specs=P() if check_vma else P("tp"),
                              check_vma=check_vma))
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
    for prev, (_, ops, _) in zip(calls, calls[1:]):
        assert ops[-1] == prev[0]  # each call reads the previous call's first result
    sites = [_site(line) for _, _, line in calls]
    assert len(set(sites)) == 4 and all(0 < s < 2**48 for s in sites)
    assert [_site(line) for _, _, line in lower()] == sites  # the same program, the same tags


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
    case, = re.findall(r"(%\w+) = \"stablehlo.case\"", text)
    call, = re.findall(r"(%\w+):2 = func.call @inner", text)
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

    return [jax.jit(jax.shard_map(body_of(psum), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                  check_vma=check_vma))
            for psum in (prefetching, plain)]


def _assert_bits_equal(a, b):
    def same(u, v):
        u, v = np.asarray(u), np.asarray(v)
        assert (u.dtype, u.shape, u.tobytes()) == (v.dtype, v.shape, v.tobytes()), (u, v)
    jax.tree.map(same, a, b)


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_prefetch_changes_no_value(mesh4, lax_lowering, check_vma):
    ws, w_specs = _weights(3)

    def body_of(psum):
        def body(x, tree, ws):
            # A pytree of several dtypes (one call), and a sum of a sum.
            y = psum({"a": jnp.sin(x) * ws[2][0, 0], "b": tree}, "tp", ws)
            z = psum(y["a"] * y["a"], "tp", ws)
            return (z.sum(keepdims=True) + y["b"]["c"].astype(jnp.float32).sum(keepdims=True)
                    + y["b"]["d"].sum(keepdims=True))
        return body

    out_spec = P("tp")
    specs = (P("tp"), {"c": P("tp"), "d": P("tp")}, w_specs)
    arx, plain = _with_and_without_prefetch(mesh4, body_of, specs, out_spec, check_vma)
    x = jnp.linspace(-1, 1, 8)
    tree = {"c": jnp.arange(12, dtype=jnp.bfloat16).reshape(4, 3), "d": jnp.linspace(0, 1, 4, dtype=jnp.float16)}
    _assert_bits_equal(arx(x, tree, ws), plain(x, tree, ws))
    assert "prefetch=4" in str(jax.make_jaxpr(arx)(x, tree, ws))  # ws and ws[0]
    # grad: with respect to x, to the weights that are prefetched (and used), to both.
    for argnums in (0, 2, (0, 2)):
        grads = [jax.jit(jax.grad(lambda x, tree, ws, f=f: f(x, tree, ws).sum(), argnums=argnums,
                                  allow_int=True))(x, tree, ws)
                 for f in (arx, plain)]
        _assert_bits_equal(*grads)
    # jvp, with tangents for x alone, the weights alone, and both.
    zero = lambda t: jax.tree.map(jnp.zeros_like, t)
    for tx, tws in ((x, zero(ws)), (zero(x), ws), (x, ws)):
        tws = [t if jnp.issubdtype(t.dtype, jnp.floating) else np.zeros(t.shape, jax.dtypes.float0) for t in tws]
        _assert_bits_equal(*[jax.jvp(lambda x, ws, f=f: f(x, tree, ws), (x, ws), (tx, tws)) for f in (arx, plain)])
    # vmap of the jitted shard_map: the weights batched (the hint dropped) or not.
    xs = jnp.stack([x, x * 2, -x])
    _assert_bits_equal(jax.vmap(arx, in_axes=(0, None, None))(xs, tree, ws),
                       jax.vmap(plain, in_axes=(0, None, None))(xs, tree, ws))
    wss = [jnp.stack([w, w]) for w in ws]
    _assert_bits_equal(jax.vmap(arx, in_axes=(None, None, 0))(x, tree, wss),
                       jax.vmap(plain, in_axes=(None, None, 0))(x, tree, wss))
    assert lax_lowering["n"] > 0


@needs_4_devices
@pytest.mark.parametrize("check_vma", [True, False])
def test_rules_under_lax_lowering_prefetch_vmap_inside_shard_map(mesh4, lax_lowering, check_vma):
    ws, w_specs = _weights(2)

    def body_of(psum):
        return lambda x, ws: jax.vmap(lambda row: psum(row, "tp", ws), in_axes=1, out_axes=1)(x)

    arx, plain = _with_and_without_prefetch(mesh4, body_of, (P(None, "tp"), w_specs),
                                            P(None, None) if check_vma else P(None, "tp"), check_vma)
    y = jnp.arange(4 * 16.0).reshape(4, 16)
    _assert_bits_equal(arx(y, ws), plain(y, ws))
    _assert_bits_equal(arx(y, ws), jax.jit(jax.shard_map(
        lambda x, ws: jax.vmap(lambda r: jax.lax.psum(r, "tp"), in_axes=1, out_axes=1)(x), mesh=mesh4,
        in_specs=(P(None, "tp"), w_specs), out_specs=P(None, None) if check_vma else P(None, "tp"),
        check_vma=check_vma))(y, ws))


@needs_4_devices
def test_prefetch_takes_at_most_8_arrays(mesh4):
    def lower(n):
        ws, specs = _weights(n)
        f = jax.jit(jax.shard_map(lambda x, ws: jax_arx.psum(x, "tp", prefetch=ws), mesh=mesh4,
                                  in_specs=(P("tp"), specs), out_specs=P()))
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

    f = jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=(P("tp"), P("tp"), P()),
                              out_specs=P() if check_vma else P("tp"), check_vma=check_vma))
    args = (jnp.ones(8, jnp.bfloat16), jnp.ones((8, 16), jnp.bfloat16), jnp.ones(5, jnp.float32))
    comm_id = _comm.communicator("tp").comm_id
    # The leaves, the dependency operands, then the prefetch operands, counted
    # by the attribute; the CPU handler takes the same call and ignores them.
    texts = {"cpu": f.lower(*args).as_text(), "cuda": _cuda_text(f, *args),
             "both": f.trace(*args).lower(lowering_platforms=("cpu", "cuda")).as_text()}
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
        return jax.jit(jax.shard_map(body, mesh=mesh4, in_specs=(P("tp"), P()), out_specs=P("tp"),
                                     check_vma=check_vma))

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
        got, want = [calls(jax.jit(jax.grad(lambda x, w, p=p: p(x, w).sum(), argnums=argnums)), x, w)
                     for p in (f, plain)]
        assert [pf for pf, _ in got] == [n == 2 for _, n in got]  # prefetch: x and the weights
        assert [pf for pf, _ in got] == (([True] if argnums != 0 else [])
                                         + ([False] if argnums != 1 or check_vma else []))
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
    f = jax.shard_map(lambda x, a, b: jax_arx.psum(x, "tp", prefetch=(a, b)), mesh=mesh4,
                      in_specs=(P("tp"), P(), P()), out_specs=P())
    # in_axes of (x, a, b), and how many of a, b the call prefetches.
    for in_axes, kept in (((0, None, None), 2), ((0, None, 0), 1), ((None, 0, None), 1), ((0, 0, 0), 0)):
        args = [jnp.ones((2, 8)) if in_axes[0] == 0 else jnp.ones(8)]
        args += [w_batched if a == 0 else w_shared for a in in_axes[1:]]
        (_, ops, line), = _ffi_calls(_cuda_text(jax.jit(jax.vmap(f, in_axes=in_axes)), *args))
        assert len(ops) == 1 + kept
        assert (f"prefetch = {kept} : i64" in line) if kept else ("prefetch" not in line)


@needs_4_devices
def test_prefetch_is_dropped_where_jax_lax_sums(mesh4, caplog):
    w = jnp.ones((4, 4))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = _body_prims(mesh4, lambda x: jax_arx.psum(x, "tp", prefetch=w * 2), jnp.ones(8, jnp.int32))
    assert "psum_invariant" in prims and not any("jax_arx" in p for p in prims)
    # A constant is no buffer of the program: nothing to prefetch.
    jaxpr = jax.make_jaxpr(jax.shard_map(lambda x: jax_arx.psum(x, "tp", prefetch=np.ones(3)), mesh=mesh4,
                                         in_specs=P("tp"), out_specs=P()))(jnp.ones(8))
    assert "prefetch=0" in str(jaxpr)
    # Where the lowering falls back (another device order), the weights go with the FFI call.
    reordered = auto_mesh((4,), ("tp",), devices=jax.devices()[::-1])
    f = jax.jit(jax.shard_map(lambda x, w: jax_arx.psum(x, "tp", prefetch=w), mesh=reordered,
                              in_specs=(P("tp"), P()), out_specs=P()))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = _cuda_text(f, jnp.ones(8), w)
    assert "jax_arx_psum" not in text and "all_reduce" in text


# --- initialize / shutdown / check -----------------------------------------------------

@needs_4_devices
def test_initialize_makes_one_endpoint_per_local_device_and_group(mesh22, fake_core):
    eps = fake_core.endpoints
    assert len(eps) == 8 and all(e.connected for e in eps)
    by_axis = {}
    for e in eps:
        by_axis.setdefault(e.comm_id, []).append(e)
    dp, tp = _comm.communicator("dp"), _comm.communicator("tp")
    assert set(by_axis) == {dp.comm_id, tp.comm_id} and dp.comm_id != tp.comm_id
    ids = np.asarray(mesh22.device_ids)  # [[0, 1], [2, 3]]
    # tp groups are rows, dp groups are columns; rank = position along the axis.
    got_tp = sorted((e.name, e.rank, e.device_ordinal) for e in by_axis[tp.comm_id])
    assert got_tp == [("tp[0]", 0, ids[0, 0]), ("tp[0]", 1, ids[0, 1]), ("tp[1]", 0, ids[1, 0]),
                      ("tp[1]", 1, ids[1, 1])]
    got_dp = sorted((e.name, e.rank, e.device_ordinal) for e in by_axis[dp.comm_id])
    assert got_dp == [("dp[0]", 0, ids[0, 0]), ("dp[0]", 1, ids[1, 0]), ("dp[1]", 0, ids[0, 1]),
                      ("dp[1]", 1, ids[1, 1])]
    assert all(e.world == 2 and e.transport == "shm" and e.platform == "cpu" for e in eps)
    secrets = {(e.comm_id, e.name): e.secret for e in eps}
    assert len(set(secrets.values())) == 4  # one per group
    assert all(e.secret == secrets[(e.comm_id, e.name)] for e in eps)
    assert all(e.options["slot_bytes"] == "1048576" for e in eps)


@needs_4_devices
def test_device_ordinal_is_what_xla_reports():
    # Measured (2 processes x 2 CPU devices): XLA's CPU DeviceOrdinal is the
    # global device id; see _compat.xla_device_ordinal.
    assert [_compat.xla_device_ordinal(d) for d in jax.local_devices()] == [d.id for d in jax.local_devices()]


@needs_4_devices
def test_communicator_id_is_deterministic_and_mesh_specific():
    a = auto_mesh((2, 2), ("dp", "tp"))
    b = auto_mesh((2, 2), ("dp", "tp"))
    c = auto_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[::-1])
    d = auto_mesh((4,), ("tp",))
    ids = [_comm.communicator_id(m, "tp") for m in (a, b, c, d)]
    assert ids[0] == ids[1] and len(set(ids)) == 3
    assert all(0 <= i < 2**63 for i in ids)


@needs_4_devices
def test_initialize_is_idempotent_and_rejects_a_new_mesh_for_a_known_axis(mesh4, fake_core):
    jax_arx.initialize(mesh4)
    jax_arx.initialize(auto_mesh((4,), ("tp",)))  # an equal mesh
    assert len(fake_core.endpoints) == 4
    with pytest.raises(jax_arx.InitializationError,
                       match=r"mesh axis 'tp' is already set up for another mesh .*Call jax_arx.shutdown\(\)"):
        jax_arx.initialize(auto_mesh((4,), ("tp",), devices=jax.devices()[::-1]))
    jax_arx.initialize(auto_mesh((4,), ("sp",)))  # a new axis name adds a communicator
    sp = _comm.communicator("sp")
    assert len(fake_core.endpoints) == 8 and sp.mesh_axis_names == ("sp",) and sp.mesh_shape == (4,)
    assert sorted(le.endpoint.rank for le in sp.endpoints) == [0, 1, 2, 3]


@needs_4_devices
@needs_4_devices
def test_shutdown_warning_keeps_jax_first_line_whole(mesh4, fake_core, monkeypatch, caplog):
    # A peer that never reaches shutdown(): jax's barrier error, whose first
    # line the warning quotes whole (it used to be cut at 200 characters,
    # mid-word), then this process's endpoints close anyway.
    first = ("DEADLINE_EXCEEDED: Barrier timed out. Id: jax_arx/1/shutdown. This usually happens because a task "
             "triggered the barrier too early or too slowly. Please look at the task logs (both timed out and "
             "first task) to debug further.")

    class Client:
        def wait_at_barrier(self, name, timeout_ms):
            raise RuntimeError(first + "\n# tasks that did not reach the barrier: /job:jax_worker/task:1")

    monkeypatch.setattr(_compat, "distributed_client", lambda: Client())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        jax_arx.shutdown()
    assert "not every process reached shutdown()" in caplog.text
    assert caplog.text.rstrip().endswith("jax said: " + first), caplog.text
    assert not fake_core.registered


def test_shutdown_then_initialize_again(mesh4, fake_core):
    comm_id = _comm.communicator("tp").comm_id
    generation = _comm._generation
    jax_arx.shutdown()
    assert all(e.closed for e in fake_core.endpoints) and not fake_core.registered
    assert _comm.communicator("tp") is None
    jax_arx.shutdown()  # idempotent
    jax_arx.initialize(mesh4)
    assert _comm.communicator("tp").comm_id == comm_id and _comm._generation == generation + 1
    assert len(fake_core.registered) == 4


@needs_4_devices
def test_initialize_uses_the_mesh_in_context(fake_core):
    mesh = auto_mesh((4,), ("tp",))
    with pytest.raises(jax_arx.InitializationError, match=r"pass it, jax_arx.initialize\(mesh\), or set it"):
        jax_arx.initialize()
    with jax.set_mesh(mesh):
        jax_arx.initialize()
    tp = _comm.communicator("tp")
    assert (tp.mesh_axis_names, tp.device_ids) == (("tp",), tuple(d.id for d in mesh.devices.flat))


@needs_4_devices
def test_initialize_topology(fake_core, monkeypatch):
    # The argument reaches every endpoint, and overrides JAX_ARX_TOPOLOGY.
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="ring")
    assert {e.options.get("topology") for e in fake_core.endpoints} == {"ring"}
    assert _comm.communicator("tp").topology == "ring"
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="ring")  # the same: nothing to do
    with pytest.raises(jax_arx.InitializationError, match=r"'tp' is already set up as a ring; this call asks for a "
                                                          r"mesh .*Call jax_arx.shutdown\(\)"):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    jax_arx.shutdown()
    monkeypatch.setenv("JAX_ARX_TOPOLOGY", "ring")
    jax_arx.initialize(auto_mesh((4,), ("tp",)), topology="mesh")
    assert all("topology" not in e.options for e in fake_core.endpoints[4:])
    jax_arx.shutdown()
    jax_arx.initialize(auto_mesh((2, 2), ("dp", "tp")))  # every axis a ring of 2
    assert {e.options.get("topology") for e in fake_core.endpoints[8:]} == {"ring"}
    with pytest.raises(jax_arx.ConfigError, match="topology='torus'"):
        jax_arx.initialize(auto_mesh((4,), ("sp",)), topology="torus")
    assert _comm.communicator("sp") is None


def test_a_ring_past_four_is_refused_before_anything_is_set_up():
    ring = config.Config(topology="ring")
    _comm._check_ring_size(ring, "tp", 4)
    _comm._check_ring_size(config.Config(), "tp", 8)  # a mesh of 8 is fine
    with pytest.raises(jax_arx.InitializationError,
                       match=r"axis 'tp' has 5 devices, but a ring .* takes 2 to 4: .*more than one relay. Cable "
                             r"the boxes through a switch and use topology='mesh'"):
        _comm._check_ring_size(ring, "tp", 5)


@needs_4_devices
def test_transport_override_and_tcp_address(fake_core, monkeypatch):
    monkeypatch.setenv("JAX_ARX_TRANSPORT", "tcp")
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert {(e.transport, e.options["tcp_addr"]) for e in fake_core.endpoints} == {("tcp", "127.0.0.1")}
    jax_arx.shutdown()
    monkeypatch.setenv("JAX_ARX_TCP_ADDR", "198.51.100.9")
    jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert {e.options["tcp_addr"] for e in fake_core.endpoints[4:]} == {"198.51.100.9"}


def test_choose_transport():
    cfg = config.Config()
    assert _carriers.choose_transport(cfg, ["a", "a", "a"]) == "shm"
    assert _carriers.choose_transport(cfg, ["a", "b"]) == "tcp"
    assert _carriers.choose_transport(config.Config(transport="tcp"), ["a", "a"]) == "tcp"
    assert _carriers.choose_transport(config.Config(transport="shm"), ["a", "b"]) == "shm"
    assert _carriers.host_identity() == _carriers.host_identity()


def test_default_tcp_addr():
    assert _carriers.default_tcp_addr(None) == "127.0.0.1"
    assert _carriers.default_tcp_addr("127.0.0.1:1234") == "127.0.0.1"
    assert _carriers.default_tcp_addr("localhost:1234") == "127.0.0.1"
    with pytest.raises(jax_arx.InitializationError, match="set JAX_ARX_TCP_ADDR"):
        _carriers.default_tcp_addr("no-such-host.invalid:1234")


@needs_4_devices
def test_initialize_without_the_core_says_how_to_build_it(monkeypatch):
    monkeypatch.setattr(_comm, "_core_module", None)
    monkeypatch.setattr(_comm, "_core_import_error", ImportError("No module named 'jax_arx._core'"))
    with pytest.raises(jax_arx.InitializationError, match=r"jax_arx._core could not be imported .*pip install \."):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert _comm.communicator("tp") is None
    assert jax_arx.check() is None  # nothing set up, nothing failed


@needs_4_devices
def test_endpoint_creation_failure_closes_what_was_made(fake_core):
    fake_core.fail_create_rank = 2
    with pytest.raises(jax_arx.InitializationError,
                       match=r"could not create the endpoint of axis 'tp' group 0 rank 2 .*no memory for the slots"):
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
    assert len(fake_core.endpoints) == 2 and all(e.closed for e in fake_core.endpoints)
    assert _comm.communicator("tp") is None


@needs_4_devices
def test_check_reports_failures(mesh4, fake_core):
    assert jax_arx.check() is None
    ep = fake_core.endpoints[1]
    fake_core.failed[(ep.comm_id, ep.device_ordinal)] = "communicator 'tp' rank 1 of 4: rank 3 sent nothing for 30 s"
    with pytest.raises(jax_arx.CollectiveError, match=r"a communicator has failed:\n  communicator 'tp' rank 1"):
        jax_arx.check()
    assert issubclass(jax_arx.CollectiveError, RuntimeError)
    fake_core.failed[(ep.comm_id, ep.device_ordinal)] = (
        "jax_arx: communicator 'tp' rank 1 of 4: collective #3 timed out after 30 s waiting for rank 3.")
    with pytest.raises(jax_arx.CollectiveTimeoutError, match="timed out after 30 s waiting for rank 3"):
        jax_arx.check()
    other = fake_core.endpoints[0]
    fake_core.failed[(other.comm_id, other.device_ordinal)] = (
        "jax_arx: communicator 'tp' rank 0 of 4: at collective #3 rank 2 issued a different collective (op...)")
    with pytest.raises(jax_arx.CollectiveError) as mixed:  # two kinds: the common base
        jax_arx.check()
    assert type(mixed.value) is jax_arx.CollectiveError and "2 communicators have failed" in str(mixed.value)


# The messages as jax raises them: the status, then the handler's message.
_TIMEOUT = ("INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: collective #7 timed out after 3 s waiting for rank 1. "
            "Last seq heard from each peer: r1=6.")
_MISMATCH = ("INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: at collective #1 rank 1 issued a different "
             "collective (op, dtype, element count or call site differ: descriptor 2c9453, this rank 70e6d4).")
_PEER_CLOSED = "INTERNAL: jax_arx: communicator 'tp' rank 0 of 2: tcp: rank 1 closed its connection (root 0)"
_TOO_BIG = ("INVALID_ARGUMENT: jax_arx.psum: 2097152 bytes exceed the one-shot limit of 1048576 bytes on "
            "communicator 'tp' rank 0 of 2 (JAX_ARX_SLOT_BYTES, ...)")
_NOT_SET_UP = ("INTERNAL: jax_arx: no communicator 42 on local device 0 in this process; call "
               "jax_arx.initialize(mesh) (after ...)")


@pytest.mark.parametrize("raised,message,expected", [
    (RuntimeError, _TIMEOUT, errors.CollectiveTimeoutError),
    (ValueError, _TIMEOUT, errors.CollectiveTimeoutError),  # jax raises some as ValueError
    (RuntimeError, _MISMATCH, errors.CollectiveMismatchError),
    (RuntimeError, _PEER_CLOSED, errors.EndpointFailedError),
    (ValueError, _TOO_BIG, errors.InvalidCallError),
    (RuntimeError, _NOT_SET_UP, errors.InitializationError),
])
def test_translated_raises_the_family_class(raised, message, expected):
    jax_runtime_error = type("JaxRuntimeError", (raised,), {})  # jax's own class is created in C++
    original = jax_runtime_error(message)
    with pytest.raises(expected) as got:
        with errors.translated():
            raise original
    assert type(got.value) is expected and isinstance(got.value, errors.JaxArxError)
    assert str(got.value) == message[message.index("jax_arx"):]  # the status prefix dropped, all else kept
    assert got.value.__cause__ is original
    if expected is errors.CollectiveTimeoutError:
        assert isinstance(got.value, TimeoutError) and isinstance(got.value, errors.CollectiveError)

    @errors.translated()
    def step():
        raise jax_runtime_error(message)

    with pytest.raises(expected):
        step()


def test_translated_leaves_other_errors_alone():
    for e in (RuntimeError("INTERNAL: some other library failed"), KeyError("jax_arx: not a runtime error"),
              jax_arx.ConfigError("JAX_ARX_TIMEOUT_S='x' is not a number")):
        with pytest.raises(type(e)) as got:
            with errors.translated():
                raise e
        assert got.value is e
    with errors.translated():
        pass


# --- launcher ------------------------------------------------------------------------

def test_split_argv():
    split = launch._split_argv
    assert split(["-n", "2", "s.py", "-n", "3"]) == (["-n", "2"], ["s.py", "-n", "3"])
    assert split(["-n2", "--cpu-devices=2", "s.py"]) == (["-n2", "--cpu-devices=2"], ["s.py"])
    assert split(["-n", "2", "-m", "pkg.mod", "--x"]) == (["-n", "2"], ["-m", "pkg.mod", "--x"])
    assert split(["-n", "2", "--", "-weird.py"]) == (["-n", "2"], ["-weird.py"])


def test_initialize_distributed_needs_all_or_none_of_the_variables(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert launch.initialize_distributed() is False
    assert jax_arx.distributed_initialize is launch.initialize_distributed
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID not set while JAX_NUM_PROCESSES"):
        launch.initialize_distributed()


def _launch(args, tmp_path, timeout=240):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "XLA_")) or k in ("JAX_PLATFORMS",)}
    # The installed jax_arx (with its C++ module), as the other multi-process
    # tests run it; tmp_path holds the programs and the stand-in core.
    env["PYTHONPATH"] = str(tmp_path)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jax_arx.launch", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.mark.slow
def _from_keyword(line, keywords):
    """`line` from the first of `keywords` in it (all of it if none is)."""
    at = [line.find(k) for k in keywords if k in line]
    return line[min(at):] if at else line


def test_launch_two_processes_psum_and_rendezvous(core_built, tmp_path):
    (tmp_path / "fake_core.py").write_text(FAKE_CORE_SOURCE)
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import sys
        import jax_arx
        assert jax_arx.distributed_initialize()
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        import fake_core
        jax_arx._comm._core_module = fake_core

        mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        f = jax.jit(jax.shard_map(lambda: jax.lax.psum(jax.lax.axis_index("dp") + 1.0, "dp"),
                                  mesh=mesh, in_specs=(), out_specs=P()))
        print("lax psum", float(f().addressable_data(0)))

        jax_arx.initialize(mesh)
        jax_arx.initialize(mesh)
        me = jax.process_index()
        for e in sorted(fake_core.endpoints, key=lambda e: (e.name, e.rank)):
            print("endpoint", e.name, e.rank, e.world, e.transport, e.device_ordinal, e.connected, e.secret.hex()[:8])

        # jax_arx's primitive across processes, lowered as jax's all-reduce.
        from jax_arx import _compat, _psum
        def lax_lowering(ctx, *xs, **params):
            leaves = xs[:len(xs) - params.get("prefetch", 0)]
            return _compat.lax_psum_lowering(ctx, leaves, axes=params["axes"])
        for prim in (_psum.psum_p, _psum.psum_invariant_p):
            _compat.register_lowering(prim, lax_lowering)
        g = jax.jit(jax.shard_map(lambda: jax_arx.psum(jax.lax.axis_index("dp") + 1.0, "dp"),
                                  mesh=mesh, in_specs=(), out_specs=P()))
        print("arx psum", float(g().addressable_data(0)), "jax_arx_psum_invariant" in str(jax.make_jaxpr(g)()))
        jax_arx.shutdown()
        jax_arx.initialize(mesh)  # a new generation of keys
        print("again", len(fake_core.registered))
        print("args", sys.argv[1:])
        jax_arx.shutdown()
        """))
    proc, _ = _launch(["-n", "2", "--cpu-devices", "2", str(script), "--flag", "x"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    for rank in (0, 1):
        # jax's own C++ log lines ("[Gloo] Rank 0 is connected ...") share the
        # process's stdout unsynchronised with Python's: a print may land in
        # the middle of one. Each of the script's lines starts at a keyword.
        mine = [_from_keyword(line[len(f"[rank {rank}] "):], ("lax psum", "arx psum", "endpoint ", "again ", "args "))
                for line in out if line.startswith(f"[rank {rank}] ")]
        assert "lax psum 3.0" in mine and "arx psum 3.0 True" in mine, (rank, mine, proc.stderr[-3000:])
        assert "again 4" in mine and "args ['--flag', 'x']" in mine, (rank, mine)
        endpoints = [line.split() for line in mine if line.startswith("endpoint")]
        # dp spans the processes (one rank each in 2 groups); tp stays in one (2 ranks of 1 group).
        assert sorted((e[1], e[2]) for e in endpoints) == (
            [("dp[0]", str(rank)), ("dp[1]", str(rank)), (f"tp[{rank}]", "0"), (f"tp[{rank}]", "1")])
        assert all(e[3:5] == ["2", "shm"] and e[6] == "True" for e in endpoints)
    # Both processes hold the same secret for each group of dp.
    secrets = {}
    for line in out:
        if " endpoint dp" in line:
            secrets.setdefault(line.split()[3], set()).add(line.split()[-1])
    assert len(secrets) == 2 and all(len(s) == 1 for s in secrets.values())


def test_launch_failing_rank_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        rank = int(os.environ["JAX_PROCESS_ID"])
        print("started", os.environ["JAX_NUM_PROCESSES"], os.environ["JAX_COORDINATOR_ADDRESS"].split(":")[0])
        if rank == 1:
            print("boom", file=sys.stderr)
            sys.exit(3)
        time.sleep(120)
        """))
    proc, elapsed = _launch(["-n", "2", "--grace-s", "0.5", str(script)], tmp_path)
    assert proc.returncode == 3
    assert elapsed < 30
    assert "[rank 0] started 2 127.0.0.1" in proc.stdout and "[rank 1] started 2 127.0.0.1" in proc.stdout
    assert "[rank 1] boom" in proc.stderr
    assert "[launch] rank 1 failed first (exited with status 3); stopping the other ranks in 0.5 s" in proc.stderr


@pytest.mark.slow
def test_launch_a_raising_rank_ends_the_job_within_seconds(tmp_path):
    # Rank 1 raises after jax_arx.initialize while rank 0 computes without
    # collectives: rank 1 must not wait at jax_arx's or jax's exit barriers
    # for rank 0, and the launcher names it and stops rank 0. Timed from the
    # raise (written down by rank 1), not from start-up, which load slows.
    (tmp_path / "fake_core.py").write_text(FAKE_CORE_SOURCE)
    raised_at = tmp_path / "raised_at"
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import jax_arx
        jax_arx.distributed_initialize()
        import jax
        import fake_core
        jax_arx._comm._core_module = fake_core
        mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        jax_arx.initialize(mesh)
        if jax.process_index() == 1:
            with open({str(raised_at)!r}, "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("rank 1 gives up")
        while True:  # rank 0: a long computation with no collective
            time.sleep(0.05)
        """))
    proc, _ = _launch(["-n", "2", "--cpu-devices", "1", str(script)], tmp_path)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ended - float(raised_at.read_text()) < 10, proc.stderr[-3000:]
    report = proc.stderr[proc.stderr.index("[launch] rank 1 failed first (exited with status 1)"):]
    assert "[launch]   RuntimeError: rank 1 gives up" in report, proc.stderr[-3000:]
    assert "[launch] rank 0" not in proc.stderr  # rank 0 was stopped, not reported as the failure


def test_launch_module_form(tmp_path):
    (tmp_path / "arx_launch_probe.py").write_text(
        "import os, sys\nprint('probe', os.environ['JAX_PROCESS_ID'], os.environ['PYTHONUNBUFFERED'], sys.argv[1:])\n")
    proc, _ = _launch(["-n", "3", "-m", "arx_launch_probe", "a", "-b"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        assert f"[rank {rank}] probe {rank} 1 ['a', '-b']" in proc.stdout
