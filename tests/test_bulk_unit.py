"""Unit tests of the bulk collectives' Python layer (jax_arx/_bulk.py and the
policy it shares, jax_arx/_policy.py): all_gather, psum_scatter and the
fused MoE combine, in one process on 4 CPU devices over the stand-in core
(tests/stand_in_core.py: the real core's options and plan, no peers).

- Typing: all_gather's and psum_scatter's result types (shape, dtype,
  varying axes) over every axis, dimension and tiling equal jax.lax's in the
  same shard_map body, under check_vma True and False, and the body holds
  jax_arx's primitive (not a fallback).
- jax.vmap inside the shard_map, over several in_axes (the batch axis before
  and after the gathered or scattered one, tiled and stacked): shapes and
  values equal jax.lax's op applied to each example in turn, with jax_arx's
  primitive still in the program; jax.vmap of the jitted shard_map equals
  jax.lax's under the same vmap. Values: the primitives lowered as jax's
  own collectives (``bulk_lax_lowering``): the rules are under test here,
  the sums in tests/bulk_reference.py.
- Every fallback reason of each op: one log line per reason naming it and
  the jax.lax op used instead, and with JAX_ARX_FALLBACK=error a
  JaxArxFallbackError saying the same; the size envelope at and one past
  JAX_ARX_PREFILL_SLOT_BYTES (all_gather's lane is its input, psum_scatter's
  a world-th of it, the combine's a world-th of its padded rows); none at
  all with JAX_ARX_PREFILL_SLOT_BYTES=0.
- The MoE combine: by default the plan steps aside for its unfused pair
  (jax_arx's psum_scatter of ``moe_combine``'s rows), counted with the
  plan's reason and no fallback (nothing logged; JAX_ARX_FALLBACK=error
  raises nothing); with the ``moe_fused`` tuning the fused primitive within
  the envelope; its argument errors with the numbers in the message,
  ``padded_tokens`` checked, topk past 16 and H not a multiple of 8 run
  unfused; ``moe_combine`` (its reference and fallback) against numpy.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_arx
from jax_arx import _compat
from stand_in_core import auto_mesh, inner_jaxpr, needs_4_devices, prim_names

pytestmark = needs_4_devices

GATHER = "jax_arx_all_gather"
SCATTER = "jax_arx_psum_scatter"
MOE = "jax_arx_moe_combine_psum_scatter"
PREFILL = 256 << 10  # JAX_ARX_PREFILL_SLOT_BYTES where a test sets it


def _types(mesh, body_pair, x, check_vma):
    """The types of body_pair's (jax_arx, jax.lax) results in one body, and the body's primitives."""
    seen = {}

    def body(v):
        arx, lax = body_pair(v)
        seen["arx"], seen["lax"] = jax.typeof(arx), jax.typeof(lax)
        return v

    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=check_vma)
    prims = prim_names(inner_jaxpr(jax.make_jaxpr(f)(x)))
    return seen["arx"], seen["lax"], prims


def _prims(mesh, body, *xs, in_specs=None, axis_names=None):
    specs = in_specs or (P("tp"),) * len(xs)
    kw = {} if axis_names is None else {"axis_names": axis_names}
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp"), check_vma=False, **kw)
    return prim_names(inner_jaxpr(jax.make_jaxpr(f)(*xs)))


# --- typing against jax.lax --------------------------------------------------------


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    "axis,tiled",
    [(0, False), (0, True), (1, False), (1, True), (2, True), (3, False), (-1, True), (-1, False), (-4, False)],
)
def test_all_gather_type_matches_lax(mesh4, check_vma, axis, tiled):
    x = jnp.ones((4 * 3, 5, 7), jnp.bfloat16)
    arx, lax, prims = _types(
        mesh4,
        lambda v: (
            jax_arx.all_gather(v, "tp", axis=axis, tiled=tiled),
            jax.lax.all_gather(v, "tp", axis=axis, tiled=tiled),
        ),
        x,
        check_vma,
    )
    assert (arx.shape, arx.dtype, arx.weak_type) == (lax.shape, lax.dtype, lax.weak_type)
    assert _compat.varying_axes(arx) == _compat.varying_axes(lax)
    assert GATHER in prims


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize(
    "shape,dim,tiled",
    [
        ((8, 5, 7), 0, True),
        ((4, 5, 7), 0, False),
        ((3, 8, 7), 1, True),
        ((3, 4, 7), 1, False),
        ((3, 5, 4), -1, False),
        ((3, 5, 12), 2, True),
    ],
)
def test_psum_scatter_type_matches_lax(mesh4, check_vma, shape, dim, tiled):
    x = jnp.ones((4 * shape[0], *shape[1:]), jnp.float32)
    lax_dim = dim % len(shape)  # jax.lax's lowering takes no negative dimension; its typing does
    arx, lax, prims = _types(
        mesh4,
        lambda v: (
            jax_arx.psum_scatter(v, "tp", scatter_dimension=dim, tiled=tiled),
            jax.lax.psum_scatter(v, "tp", scatter_dimension=lax_dim, tiled=tiled),
        ),
        x,
        check_vma,
    )
    assert (arx.shape, arx.dtype, arx.weak_type) == (lax.shape, lax.dtype, lax.weak_type)
    assert _compat.varying_axes(arx) == _compat.varying_axes(lax)
    assert SCATTER in prims


def test_bad_axes_are_jax_lax_errors(mesh4):
    x = jnp.ones((4 * 3, 5), jnp.float32)
    with pytest.raises(Exception) as lax_error:
        _prims(mesh4, lambda v: jax.lax.all_gather(v, "tp", axis=3), x)
    with pytest.raises(type(lax_error.value)):
        _prims(mesh4, lambda v: jax_arx.all_gather(v, "tp", axis=3), x)
    with pytest.raises(Exception) as lax_error:
        _prims(mesh4, lambda v: jax.lax.psum_scatter(v, "tp", scatter_dimension=1), x)  # 5 is not a multiple of 4
    with pytest.raises(type(lax_error.value)):
        _prims(mesh4, lambda v: jax_arx.psum_scatter(v, "tp", scatter_dimension=1), x)


# --- vmap against jax.lax ---------------------------------------------------------------


def _vmapped_pair(mesh, op, in_axes, **kw):
    """jitted shard_maps over each device's block (leading axis dropped):
    jax_arx's op under jax.vmap, and the reference, jax.lax's op on each
    example in turn, stacked (jax's own batching rule is not the reference:
    jax 0.10's reduce_scatter batcher moves the batch axis the wrong way
    where the scattered axis is dropped before it)."""

    def shard(body):
        return jax.jit(
            jax.shard_map(lambda x: body(x[0])[None], mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
        )

    arx = shard(lambda b: jax.vmap(lambda v: getattr(jax_arx, op)(v, "tp", **kw), in_axes=in_axes)(b))
    lax = shard(
        lambda b: jnp.stack(
            [getattr(jax.lax, op)(jnp.take(b, i, axis=in_axes), "tp", **kw) for i in range(b.shape[in_axes])]
        )
    )
    return arx, lax


@pytest.mark.parametrize("in_axes", [0, 1, 2])
@pytest.mark.parametrize("axis,tiled", [(0, False), (0, True), (1, False), (1, True), (-1, False)])
def test_rules_under_lax_lowering_vmap_all_gather(mesh4, bulk_lax_lowering, in_axes, axis, tiled):
    x = jnp.arange(4 * 2 * 3 * 5, dtype=jnp.float32).reshape(4, 2, 3, 5)  # each device: [2, 3, 5]
    arx, lax = _vmapped_pair(mesh4, "all_gather", in_axes, axis=axis, tiled=tiled)
    got, want = arx(x), lax(x)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert GATHER in str(jax.make_jaxpr(arx)(x))
    assert bulk_lax_lowering["n"] >= 1


# (each device's block, in_axes, scatter dimension of one example, tiled): the
# batch axis before and after the scattered one, stacked and tiled.
VMAP_SCATTER = [
    ((3, 4, 5), 0, 0, False),
    ((4, 3, 5), 1, 0, False),
    ((8, 3, 5), 1, 0, True),
    ((5, 8, 4), 2, 1, True),
    ((5, 4, 3), 0, 0, True),
    ((3, 5, 4), 0, 1, False),
    ((4, 4, 3), 2, 1, False),
]


@pytest.mark.parametrize("block,in_axes,dim,tiled", VMAP_SCATTER)
def test_rules_under_lax_lowering_vmap_psum_scatter(mesh4, bulk_lax_lowering, block, in_axes, dim, tiled):
    x = jnp.arange(4 * np.prod(block), dtype=jnp.float32).reshape(4, *block) % 97
    arx, lax = _vmapped_pair(mesh4, "psum_scatter", in_axes, scatter_dimension=dim, tiled=tiled)
    got, want = arx(x), lax(x)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert SCATTER in str(jax.make_jaxpr(arx)(x))


def test_rules_under_lax_lowering_vmap_of_the_jitted_shard_map(mesh4, bulk_lax_lowering):
    def pair(op, **kw):
        return [
            jax.jit(
                jax.shard_map(
                    lambda v, fn=fn: fn(v, "tp", **kw), mesh=mesh4, in_specs=P("tp"), out_specs=P("tp"), check_vma=False
                )
            )
            for fn in (getattr(jax_arx, op), getattr(jax.lax, op))
        ]

    z = jnp.arange(3 * 32 * 5, dtype=jnp.float32).reshape(3, 32, 5)
    for (arx, lax), target in (
        (pair("all_gather", axis=1), GATHER),
        (pair("psum_scatter", scatter_dimension=0, tiled=True), SCATTER),
    ):
        got, want = jax.vmap(arx)(z), jax.vmap(lax)(z)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert target in str(jax.make_jaxpr(jax.vmap(arx))(z))


def test_vmap_batches_decide_again(fake_core, monkeypatch):
    # A batched input is bigger: the batcher asks the plan again. Each
    # example fits the envelope, 8 of them do not.
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", "64K")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    for batch, ours in ((1, True), (8, False)):
        x = jnp.ones((4, batch, 4096), jnp.float32)  # an example: 16 KiB per device, 64 KiB gathered
        body = lambda v: jax.vmap(lambda e: jax_arx.all_gather(e, "tp", tiled=True))(v[0])[None]
        assert (GATHER in _prims(mesh, body, x)) == ours, batch


# --- fallbacks: one log line per reason, or JaxArxFallbackError -----------------------------


def _falls_back(monkeypatch, caplog, trace, reason, lax_op, op=None, notice=False):
    """``trace()`` (it traces a program) falls back: the program holds no
    jax_arx primitive (``notice``, a fallback past the size envelope: but
    its notice, jax_arx/_notice.py), one log line (of ``op``'s, where given)
    says ``reason`` and names ``lax_op`` (a second trace logs nothing more);
    with JAX_ARX_FALLBACK=error it raises JaxArxFallbackError saying the same."""
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        caplog.clear()
        prims = trace()
        trace()
    ours = [p for p in prims if p.startswith("jax_arx_")]
    assert ours == (["jax_arx_fallback_notice"] if notice else []), prims
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "jax_arx" and (op is None or r.getMessage().startswith(f"jax_arx.{op}:"))
    ]
    assert len(lines) == 1, lines
    assert re.search(reason, lines[0]) and f"using {lax_op}" in lines[0], lines[0]
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    with pytest.raises(jax_arx.JaxArxFallbackError, match=reason) as e:
        trace()
    assert "JAX_ARX_FALLBACK=error" in str(e.value)
    monkeypatch.delenv("JAX_ARX_FALLBACK")
    return lines[0]


def _moe_args(T=6, R=10, H=128, topk=2, world=4):
    """Per-device MoE operands, stacked over the 4 devices."""
    rng = np.random.default_rng(1)
    return (
        jnp.asarray(rng.normal(size=(world, R, H)), jnp.bfloat16),
        jnp.asarray(rng.integers(0, R, size=(world, T, topk)), jnp.int32),
        jnp.asarray(rng.normal(size=(world, T, topk)), jnp.float32),
        jnp.asarray(rng.normal(size=(world, T, H)), jnp.bfloat16),
    )


def _moe_body(*v, axis="tp", **kw):
    y, pos, w, shared = (a[0] for a in v)
    return jax_arx.moe_combine_psum_scatter(y, pos, w, shared, axis, **kw)[None]


OPS = {
    "all_gather": (lambda x, axis="tp", **kw: jax_arx.all_gather(x, axis, tiled=True, **kw), "jax.lax.all_gather"),
    "psum_scatter": (
        lambda x, axis="tp", **kw: jax_arx.psum_scatter(x, axis, tiled=True, **kw),
        "jax.lax.psum_scatter",
    ),
}


@pytest.mark.parametrize("op", OPS)
def test_uninitialized_axis_falls_back(fake_core, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]
    mesh = auto_mesh((4,), ("tp",))
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh, fn, jnp.ones((16, 4))),
        r"mesh axis 'tp' has no jax_arx communicator: call jax_arx.initialize\(mesh\)",
        lax_op,
    )


@pytest.mark.parametrize(
    "op,dtype,why",
    [
        ("all_gather", jnp.int4, r"dtype int4 is not supported \(it is not whole bytes\)"),
        ("psum_scatter", jnp.int32, r"dtype int32 is not supported \(float32, bfloat16 and float16 are\)"),
        ("psum_scatter", jnp.float8_e4m3fn, r"dtype float8_e4m3fn is not supported"),
    ],
)
def test_unsupported_dtypes_fall_back(mesh4, monkeypatch, caplog, op, dtype, why):
    fn, lax_op = OPS[op]
    _falls_back(monkeypatch, caplog, lambda: _prims(mesh4, fn, jnp.ones((16, 4), dtype)), why, lax_op)


@pytest.mark.parametrize("op", OPS)
def test_axis_index_groups_fall_back(mesh4, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh4, lambda v: fn(v, axis_index_groups=[[0, 1], [2, 3]]), jnp.ones((16, 4))),
        "axis_index_groups is not supported",
        lax_op,
    )


@pytest.mark.parametrize("op", OPS)
def test_several_mesh_axes_fall_back(mesh22, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]
    trace = lambda: _prims(mesh22, lambda v: fn(v, axis=("dp", "tp")), jnp.ones((16, 4)), in_specs=(P(("dp", "tp")),))
    _falls_back(monkeypatch, caplog, trace, r"several mesh axes at once \('dp', 'tp'\) is not supported", lax_op)


@pytest.mark.parametrize("op", OPS)
def test_another_mesh_falls_back(mesh4, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]
    other = auto_mesh((2,), ("tp",), devices=jax.devices()[:2])
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(other, fn, jnp.ones((16, 4))),
        r"this shard_map's mesh \('tp': 2\) is not the mesh jax_arx.initialize set axis 'tp' up for",
        lax_op,
    )


@pytest.mark.parametrize("op", OPS)
def test_partially_manual_shard_map_falls_back(mesh22, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh22, fn, jnp.ones((16, 4)), axis_names={"tp"}),
        r"the shard_map is not manual over mesh axes \['dp'\]",
        lax_op,
    )


@pytest.mark.parametrize("op", OPS)
def test_shut_down_between_tracing_and_lowering_falls_back(mesh4, monkeypatch, caplog, op):
    fn, lax_op = OPS[op]

    def traced():
        f = jax.jit(jax.shard_map(lambda v: fn(v), mesh=mesh4, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
        return f.trace(jnp.ones((16, 4)))

    t = traced()
    jax_arx.shutdown()
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = t.lower().as_text()
    assert "custom_call @jax_arx_" not in text
    assert (
        f"was shut down (jax_arx.shutdown()) between tracing and lowering; call jax_arx.initialize(mesh) again; "
        f"using {lax_op}" in caplog.text
    )
    jax_arx.initialize(mesh4)
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    t = traced()
    jax_arx.shutdown()
    with pytest.raises(jax_arx.JaxArxFallbackError, match="between tracing and lowering"):
        t.lower()


@pytest.mark.parametrize(
    "op,per_device,lane",
    [
        # all_gather: the lane is its input, world of them fill the buffer.
        ("all_gather", PREFILL // 4 // 4, PREFILL // 4),
        # psum_scatter: its input fills the buffer, a world-th of it is the lane.
        ("psum_scatter", PREFILL // 4, PREFILL // 4),
    ],
)
def test_the_envelope_is_the_prefill_slot(fake_core, monkeypatch, caplog, op, per_device, lane):
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", str(PREFILL))
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    fn, lax_op = OPS[op]
    at = jnp.ones((4 * per_device,), jnp.float32)  # per_device floats on each device
    assert (GATHER if op == "all_gather" else SCATTER) in _prims(mesh, fn, at)
    past = jnp.ones((4 * (per_device + 4),), jnp.float32)  # 16 bytes more on each device
    line = _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh, fn, past),
        rf"jax_arx.{op}: float32\[{per_device + 4}\]\S*: {op} moves \d+ bytes per rank, \d+ for all 4 "
        rf"ranks, more than JAX_ARX_PREFILL_SLOT_BYTES={PREFILL}",
        lax_op,
        notice=True,
    )
    settings = dict(re.findall(r"(JAX_ARX_\w+)=(\w+)", line.split("; set ", 1)[1]))
    assert set(settings) == {"JAX_ARX_PREFILL_SLOT_BYTES"}, line
    # Doing what the message says runs it with jax_arx.
    jax_arx.shutdown()
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", settings["JAX_ARX_PREFILL_SLOT_BYTES"])
    jax_arx.initialize(mesh)
    assert (GATHER if op == "all_gather" else SCATTER) in _prims(mesh, fn, past)


def test_no_prefill_slot_runs_every_bulk_op_with_jax_lax(fake_core, monkeypatch, caplog):
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", "0")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = (
            _prims(mesh, OPS["all_gather"][0], jnp.ones((16,)))
            + _prims(mesh, OPS["psum_scatter"][0], jnp.ones((16,)))
            + _prims(mesh, _moe_body, *_moe_args())
            + _prims(mesh, lambda v: jax_arx.psum(v, "tp"), jnp.ones((16,)))
        )
    assert "jax_arx_psum" in prims  # psum is not a bulk op
    assert not {GATHER, SCATTER, MOE} & set(prims), prims
    for op in ("all_gather", "psum_scatter", "moe_combine_psum_scatter"):
        assert "more than JAX_ARX_PREFILL_SLOT_BYTES=0" in "\n".join(
            r.getMessage() for r in caplog.records if r.getMessage().startswith(f"jax_arx.{op}:")
        ), caplog.text


# --- the MoE combine ----------------------------------------------------------------------


def test_moe_steps_aside_for_the_unfused_pair_by_default(fake_core, monkeypatch, caplog):
    from jax_arx import _policy

    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", str(PREFILL))
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")  # the plan's choice is no fallback: nothing raises
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    plans, fallbacks = _policy.plan_counts(), _policy.fallback_counts()
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        prims = _prims(mesh, _moe_body, *_moe_args())
    assert SCATTER in prims and MOE not in prims, prims
    assert not caplog.records, caplog.text
    assert _policy.fallback_counts() == fallbacks
    was = plans.get("moe_combine_psum_scatter", {})
    counted = {
        k: n - was.get(k, 0) for k, n in _policy.plan_counts()["moe_combine_psum_scatter"].items() if n != was.get(k, 0)
    }
    ((reason, n),) = counted.items()
    assert n == 1 and "docs/performance.md" in reason and "the same bits" in reason, counted
    # Past the envelope it is a fallback as before, the pair's psum_scatter too.
    monkeypatch.delenv("JAX_ARX_FALLBACK")
    at = PREFILL // (2 * 128)
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh, _moe_body, *_moe_args(T=at + 1)),
        "moe_combine_psum_scatter moves",
        "jax.lax.psum_scatter",
        op="moe_combine_psum_scatter",
        notice=True,
    )


def test_moe_runs_fused_within_its_envelope(fake_core, monkeypatch, caplog):
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", str(PREFILL))
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh, _tuning={"moe_fused": 1})
    H = 128
    at = PREFILL // (2 * H)  # padded tokens whose bf16 rows fill the buffer: 1024
    assert MOE in _prims(mesh, _moe_body, *_moe_args(T=at))
    assert MOE in _prims(mesh, _moe_body, *_moe_args(T=at - 3))  # padded up to `at`
    assert MOE in _prims(mesh, _moe_body, *_moe_args(topk=16))
    # Past it, unfused: moe_combine's rows, too many for jax_arx.psum_scatter too.
    _falls_back(
        monkeypatch,
        caplog,
        lambda: _prims(mesh, _moe_body, *_moe_args(T=at + 1)),
        rf"moe_combine_psum_scatter moves {(at + 4) * H * 2 // 4} bytes per rank",
        "jax.lax.psum_scatter",
        op="moe_combine_psum_scatter",
        notice=True,
    )


@pytest.mark.parametrize(
    "shape,why",
    [
        (dict(topk=17), r"topk 17 is outside 1\.\.16"),
        (dict(H=12), "hidden size 12 is not a multiple of 8"),
    ],
)
def test_moe_outside_its_kernel_runs_unfused(mesh4, monkeypatch, caplog, shape, why):
    # Unfused: moe_combine's rows reduce-scattered by jax_arx.psum_scatter.
    trace = lambda: _prims(mesh4, _moe_body, *_moe_args(**shape))
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        assert SCATTER in trace() and MOE not in trace()
    assert len(caplog.records) == 1 and re.search(why, caplog.text), caplog.text
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    with pytest.raises(jax_arx.JaxArxFallbackError, match=why):
        trace()


@pytest.mark.parametrize(
    "padded,why",
    [
        (5, "padded_tokens 5 must be at least T = 6 and a multiple of the 4 devices along the axis"),
        (10, "padded_tokens 10 must be at least T = 6 and a multiple of the 4 devices along the axis"),
    ],
)
def test_moe_padded_tokens_are_checked(mesh4, padded, why):
    with pytest.raises(ValueError, match=why):
        _prims(mesh4, lambda *v: _moe_body(*v, padded_tokens=padded), *_moe_args(T=6))
    # At least T and a multiple of the devices: the result has padded / 4 rows per device.
    f = jax.shard_map(
        lambda *v: _moe_body(*v, padded_tokens=12),
        mesh=mesh4,
        in_specs=(P("tp"),) * 4,
        out_specs=P("tp"),
        check_vma=False,
    )
    assert jax.eval_shape(f, *_moe_args(T=6)).shape == (4, 3, 128)


def test_moe_argument_errors_name_the_shapes():
    y, pos = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32)
    w, shared = jnp.zeros((4, 2), jnp.float32), jnp.zeros((4, 128), jnp.bfloat16)
    moe = jax_arx.moe_combine_psum_scatter
    with pytest.raises(ValueError, match=r"y must be \[R, H\] and pos \[T, topk\]; got y \(8, 128, 1\), pos \(4, 2\)"):
        moe(y[..., None], pos, w, shared, "sp")
    with pytest.raises(ValueError, match=r"w must be \(4, 2\) and shared \(4, 128\); got w \(4, 3\)"):
        moe(y, pos, jnp.zeros((4, 3), jnp.float32), shared, "sp")
    with pytest.raises(ValueError, match=r"shared \(4, 128\); got w \(4, 2\), shared \(4, 64\)"):
        moe(y, pos, w, shared[:, :64], "sp")
    with pytest.raises(TypeError, match=r"pos is float32 \(want int32\)"):
        moe(y, pos.astype(jnp.float32), w, shared, "sp")
    with pytest.raises(
        TypeError,
        match=r"y is float32 \(want bfloat16\), w is bfloat16 \(want float32\); "
        r"float8_e4m3fn y needs y_scale",
    ):
        moe(y.astype(jnp.float32), pos, w.astype(jnp.bfloat16), shared, "sp")
    with pytest.raises(TypeError, match=r"y is float8_e4m3fn \(want bfloat16\)"):
        moe(y.astype(jnp.float8_e4m3fn), pos, w, shared, "sp")
    with pytest.raises(ValueError, match=r"needs H a multiple of 128 and y_scale float32 \(8, 1\)"):
        moe(y.astype(jnp.float8_e4m3fn), pos, w, shared, "sp", y_scale=jnp.zeros((8, 2), jnp.float32))


@pytest.mark.parametrize("e4m3", [False, True])
def test_moe_combine_is_the_documented_arithmetic(e4m3):
    """The plain-jax combine (the fused op's reference and fallback) computes
    the documented sum with full-precision float32 weights (and scales),
    clamps pos and zeroes the rows past T: the bits of the numpy reference."""
    import ml_dtypes

    from bulk_cases import reference_combine
    from bulk_reference import tie_token

    rng = np.random.default_rng(0)
    T, R, H, topk = 37, 50, 256, 5
    if e4m3:
        y = np.asarray(rng.normal(size=(R, H)) * 3, ml_dtypes.float8_e4m3fn)
        y_scale = rng.uniform(0.01, 1, size=(R, H // 128)).astype(np.float32)
    else:
        y, y_scale = rng.normal(size=(R, H)).astype(ml_dtypes.bfloat16), None
    pos = rng.integers(-3, R + 3, size=(T, topk)).astype(np.int32)
    w = rng.normal(size=(T, topk)).astype(np.float32)
    w[0] = 0.0  # an expert that does not count
    w[1] = w[1].astype(ml_dtypes.bfloat16).astype(np.float32)  # no low bits: lo = 0
    w[2] = np.float32(1) + np.float32(2**-23)  # only the last bit below hi
    shared = rng.normal(size=(T, H)).astype(ml_dtypes.bfloat16)
    if not e4m3:
        tie_token(y, pos, w, shared)
    got = jax.jit(lambda *a: jax_arx.moe_combine(*a[:4], y_scale=a[4], padded_tokens=40))(y, pos, w, shared, y_scale)
    want = reference_combine(y, pos, w, shared, y_scale, 40)
    assert got.shape == (40, H) and got.dtype == jnp.bfloat16
    assert np.asarray(got).tobytes() == want.tobytes()
    assert not np.asarray(got)[T:].astype(np.float32).any()
    if not e4m3:  # the token a single rounding of each term would get wrong
        assert (np.asarray(got)[0].astype(np.float32) == 1.421875).all()
        assert (want[0].astype(np.float32) == 1.421875).all()
