"""The bulk collectives' endpoints (jax_arx/_bulk_endpoints.py) and what the
fallback policy decides for them, against the stand-in core of
tests/stand_in_core.py (one process, 4 CPU devices; no C++ module needed
but for the plan, which the stand-in asks of the real core).

- Over verbs, as over shm and tcp, jax_arx runs all_gather, psum_scatter and
  the fused MoE combine (bf16 and e4m3; with the ``moe_fused`` tuning, or
  the plan would step aside for its unfused pair) itself: with JAX_ARX_FALLBACK=error
  every one traces to jax_arx's primitive, on the bulk communicator, whose
  endpoints are on the verbs carrier.
- initialize() makes endpoints without the bulk lanes; psum makes none; the
  first bulk collective makes one endpoint per device with the lanes (and
  the least the core takes for psum), once; shutdown() closes them and
  initialize() makes them again at once; with JAX_ARX_PREFILL_SLOT_BYTES=0
  or a size past it, none is made.

The multi-process side (real endpoints, /dev/shm, ranks that trace
different programs) is in tests/test_prefill_cpu.py.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_arx  # noqa: E402
from jax_arx import _bulk_endpoints, _comm, _policy, _registry  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 CPU devices (JAX_NUM_CPU_DEVICES=4)")

BULK_PRIMITIVES = {"jax_arx_all_gather", "jax_arx_psum_scatter", "jax_arx_moe_combine_psum_scatter"}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """None of the environment's settings."""
    for name in ("JAX_ARX_TRANSPORT", "JAX_ARX_PREFILL_SLOT_BYTES", "JAX_ARX_FALLBACK"):
        monkeypatch.delenv(name, raising=False)
    _policy._logged_reasons.clear()


@pytest.fixture
def mesh():
    return jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))


def _traced(mesh, body, *args):
    """The primitives of the shard_map body of ``body`` over ``args``, with
    their params."""
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    while jaxpr.eqns and jaxpr.eqns[0].primitive.name != "shard_map":
        inner = jaxpr.eqns[0].params["jaxpr"]
        jaxpr = getattr(inner, "jaxpr", inner)
    inner = jaxpr.eqns[0].params["jaxpr"]
    return [(e.primitive.name, e.params) for e in getattr(inner, "jaxpr", inner).eqns]


def _gather(v):
    return jax_arx.all_gather(v, "sp", tiled=True)


def _scatter(v):
    return jax_arx.psum_scatter(v, "sp", tiled=True)


def _moe(e4m3):
    def body(y, pos, w, shared):
        scale = jnp.ones((y.shape[0], y.shape[1] // 128), jnp.float32) if e4m3 else None
        y = y.astype(jnp.float8_e4m3fn) if e4m3 else y
        return jax_arx.moe_combine_psum_scatter(y, pos, w, shared, "sp", y_scale=scale)

    return body


def _moe_args():
    T, R, H, topk = 16, 8, 256, 2
    return (
        jnp.zeros((4 * R, H), jnp.bfloat16),
        jnp.zeros((4 * T, topk), jnp.int32),
        jnp.zeros((4 * T, topk), jnp.float32),
        jnp.zeros((4 * T, H), jnp.bfloat16),
    )


@pytest.mark.parametrize("transport", ["verbs", "tcp", "shm"])
def test_every_bulk_op_runs_with_jax_arx_over_every_carrier(fake_core, mesh, monkeypatch, transport):
    """The policy leaves nothing to jax.lax for the carrier: with
    JAX_ARX_FALLBACK=error a fallback would raise."""
    monkeypatch.setenv("JAX_ARX_TRANSPORT", transport)
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    jax_arx.initialize(mesh, _tuning={"moe_fused": 1})
    x = jnp.zeros((4 * 64, 8), jnp.bfloat16)
    traced = (
        _traced(mesh, _gather, x)
        + _traced(mesh, _scatter, x)
        + _traced(mesh, _moe(False), *_moe_args())
        + _traced(mesh, _moe(True), *_moe_args())
    )
    ran = [(name, params["comm_id"]) for name, params in traced if name in BULK_PRIMITIVES]
    assert [name for name, _ in ran] == ["jax_arx_all_gather", "jax_arx_psum_scatter"] + [
        "jax_arx_moe_combine_psum_scatter"
    ] * 2, traced
    bulk = _registry._bulk_communicators["sp"]
    assert {comm_id for _, comm_id in ran} == {bulk.comm_id}
    assert bulk.comm_id == _bulk_endpoints.bulk_id(_comm.communicator("sp").comm_id)
    assert {le.transport for le in bulk.endpoints} == {transport}
    assert {ep.transport for ep in fake_core.endpoints} == {transport}


def test_psum_makes_no_bulk_lanes_the_first_bulk_op_does_once(fake_core, mesh):
    jax_arx.initialize(mesh)
    psum_eps = list(fake_core.endpoints)
    assert len(psum_eps) == 4 and all(ep.options["bulk_lanes"] == "0" for ep in psum_eps)
    x = jnp.zeros((4 * 64,), jnp.float32)
    assert "jax_arx_psum_invariant" in [n for n, _ in _traced(mesh, lambda v: jax_arx.psum(v, "sp"), x)]
    assert fake_core.endpoints == psum_eps and "sp" not in _registry._bulk_communicators

    _traced(mesh, _gather, x)
    made = fake_core.endpoints[4:]
    comm_id = _bulk_endpoints.bulk_id(psum_eps[0].comm_id)
    assert len(made) == 4 and all(ep.comm_id == comm_id and ep.connected for ep in made)
    assert all(
        ep.options["bulk_lanes"] == "1"
        and ep.options["slot_bytes"] == ep.options["send_bytes"] == "16"
        and ep.options["bulk_bytes"] == psum_eps[0].options["bulk_bytes"]
        for ep in made
    )
    assert {ep.name for ep in made} == {"sp/bulk"}
    assert all(ep.secret != psum_eps[0].secret for ep in made)
    assert len({ep.secret for ep in made}) == 1  # the group's, derived

    _traced(mesh, _scatter, x)
    _traced(mesh, _moe(False), *_moe_args())
    assert len(fake_core.endpoints) == 8, "a later bulk collective made endpoints again"


def test_shutdown_closes_them_and_initialize_makes_them_again(fake_core, mesh):
    jax_arx.initialize(mesh)
    _traced(mesh, _gather, jnp.zeros((4 * 64,), jnp.float32))
    first = fake_core.endpoints[4:]
    jax_arx.shutdown()
    assert all(ep.closed for ep in fake_core.endpoints) and not _registry._bulk_communicators
    jax_arx.initialize(mesh)
    again = [ep for ep in fake_core.endpoints[8:] if ep.options["bulk_lanes"] == "1"]
    assert len(again) == 4 and all(ep.connected for ep in again), "initialize() did not make them again"
    assert {ep.comm_id for ep in again} == {first[0].comm_id}
    assert _comm.communicator_by_id(first[0].comm_id) is _registry._bulk_communicators["sp"]


@pytest.mark.parametrize("setting,shape", [("0", (4 * 64,)), ("1KiB", (4 * 1024,))])
def test_nothing_is_made_for_what_falls_back(fake_core, mesh, monkeypatch, caplog, setting, shape):
    """JAX_ARX_PREFILL_SLOT_BYTES=0 (the ops off), or a gather past it:
    jax.lax runs it, and no bulk endpoint is made for it."""
    monkeypatch.setenv("JAX_ARX_PREFILL_SLOT_BYTES", setting)
    jax_arx.initialize(mesh)
    names = [n for n, _ in _traced(mesh, _gather, jnp.zeros(shape, jnp.float32))]
    assert not BULK_PRIMITIVES & set(names), names
    assert "JAX_ARX_PREFILL_SLOT_BYTES" in caplog.text
    assert len(fake_core.endpoints) == 4 and not _registry._bulk_communicators


def test_a_failed_set_up_raises_and_leaves_nothing(fake_core, mesh):
    jax_arx.initialize(mesh)
    fake_core.fail_create_rank = 2
    with pytest.raises(
        jax_arx.InitializationError,
        match=r"jax_arx\.all_gather: could not create the endpoint of "
        r"axis 'sp' group 0 rank 2",
    ):
        _traced(mesh, _gather, jnp.zeros((4 * 64,), jnp.float32))
    assert not _registry._bulk_communicators
    assert all(ep.closed for ep in fake_core.endpoints[4:])
    fake_core.fail_create_rank = None
    _traced(mesh, _gather, jnp.zeros((4 * 64,), jnp.float32))  # traced again: made now
    assert "sp" in _registry._bulk_communicators
