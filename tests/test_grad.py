"""jax.grad's sums on jax_arx (jax_arx/_grad.py).

A two-layer tensor-parallel model: ``x`` and ``g`` replicated, the weights
split over "tp", two ``psum`` in the forward pass. Under
``shard_map(check_vma=True)`` its backward pass sums the cotangents of the
two replicated values that meet split weights (``x``, and the first
layer's sum): jax's ``pvary``, transposed.

- In one process with 4 CPU devices and the stand-in core of
  tests/stand_in_core.py: which primitive runs each sum of the backward pass
  (jax_arx's, with check_vma on; jax's with ``JAX_ARX_GRAD_SUMS=lax``, on
  axes jax_arx does not run, and, with check_vma off, the sums of
  shard_map's replicated inputs), one call per axis for a value replicated
  over two, and a gradient's fallback message.
- Across 2 processes with the real C++ core (``--worker``): the gradients
  equal jax.lax's bit for bit (2 ranks: one addition, the same in any
  order), and the compiled program's sums are jax_arx's custom calls.
"""

import json
import logging
import os
import re
import sys

import numpy as np
import pytest

import launched

if "--worker" not in sys.argv:
    # 4 CPU devices (stand_in_core, a plugin of conftest.py, sets them before
    # jax starts; otherwise the in-process tests skip); fake_core is its fixture.
    from stand_in_core import auto_mesh, needs_4_devices
else:
    needs_4_devices = pytest.mark.skip("the worker runs no test")

THIS = os.path.abspath(__file__)
ARGS = 6  # x, w1, w2, g, w3, w4


def _specs(P):
    return (P(), P(None, "tp"), P("tp", None), P(), P(None, "tp"), P("tp", None))


def _model(jax, psum, mesh, check_vma):
    """The summed loss of the model, as a function of its six arguments,
    written with ``psum`` (jax_arx.psum or jax.lax.psum)."""
    jnp, P = jax.numpy, jax.sharding.PartitionSpec

    def body(x, w1, w2, g, w3, w4):
        y = psum(jnp.tanh(x @ w1) @ w2, "tp") * g  # x meets w1: pvary(x)
        out = psum(jnp.tanh(y @ w3) @ w4, "tp")  # y meets w3: pvary(y)
        return (out * out).sum(keepdims=True)

    f = jax.shard_map(body, mesh=mesh, in_specs=_specs(P), out_specs=P(), check_vma=check_vma)
    return lambda *a: f(*a).sum()


def _args(world, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(4, 16), (16, 8 * world), (8 * world, 16), (16,), (16, 8 * world), (8 * world, 16)]
    return [(rng.normal(size=s) * 0.5).astype(np.float32) for s in shapes]


# --- in one process, with the stand-in core -------------------------------------


def _count(text, prim):
    """How many equations of ``prim`` a printed jaxpr has (nested ones too)."""
    return len(re.findall(rf"= {prim}\[", text))


def _grad_jaxpr(jax, loss, world=4):
    return str(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(ARGS))))(*_args(world)))


@needs_4_devices
def test_backward_sums_are_jax_arx_with_check_vma(fake_core, monkeypatch):
    import jax

    import jax_arx

    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    # Two sums forward, two backward: all jax_arx's.
    text = _grad_jaxpr(jax, _model(jax, jax_arx.psum, mesh, True))
    assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (4, 0), text
    # Whichever psum wrote the forward pass: the backward sums are pvary's.
    text = _grad_jaxpr(jax, _model(jax, jax.lax.psum, mesh, True))
    assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (2, 2), text
    monkeypatch.setenv("JAX_ARX_GRAD_SUMS", "lax")
    text = _grad_jaxpr(jax, _model(jax, jax_arx.psum, mesh, True))
    assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (2, 2), text


@needs_4_devices
def test_without_check_vma_shard_maps_input_sums_stay_jax(fake_core):
    # Documented (docs/usage.md): jax_arx.psum transposes to jax_arx.psum,
    # but shard_map's transpose sums its replicated inputs' cotangents (x, g)
    # with jax.lax.psum.
    import jax

    import jax_arx

    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)
    text = _grad_jaxpr(jax, _model(jax, jax_arx.psum, mesh, False))
    assert (_count(text, "jax_arx_psum"), _count(text, "psum")) == (4, 2), text


@needs_4_devices
def test_axes_jax_arx_does_not_run_keep_jax_sums_silently(fake_core, caplog):
    import jax

    import jax_arx

    unseen = auto_mesh((4,), ("tp",))  # no communicator for it
    with caplog.at_level(logging.DEBUG, logger="jax_arx"):
        text = _grad_jaxpr(jax, _model(jax, jax.lax.psum, unseen, True))
        assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (0, 4), text
        # Another mesh that reuses the name of an axis jax_arx runs.
        jax_arx.initialize(auto_mesh((4,), ("tp",)))
        other = auto_mesh((2, 2), ("tp", "dp"))
        f = jax.shard_map(
            lambda x, w: (x * w).sum(keepdims=True),
            mesh=other,
            in_specs=(jax.P("tp", "dp"), jax.P()),
            out_specs=jax.P("tp", "dp"),
        )
        text = str(jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))(np.ones((4, 4)), np.ones(2)))
        assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (0, 1), text
    assert caplog.records == []


@needs_4_devices
def test_a_value_replicated_over_two_axes_is_summed_per_axis(fake_core):
    import jax

    import jax_arx

    mesh = auto_mesh((2, 2), ("dp", "tp"))
    jax_arx.initialize(mesh)
    f = jax.shard_map(
        lambda x, w: (jax.numpy.sin(x) * w).sum(keepdims=True),
        mesh=mesh,
        in_specs=(jax.P("dp", "tp"), jax.P()),
        out_specs=jax.P("dp", "tp"),
    )
    text = str(jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))(np.ones((4, 6)), np.ones(3)))
    # w is pvary'd over both axes; its cotangent is summed over "dp", then "tp".
    assert re.findall(r"jax_arx_psum_invariant\[\s*axes=\('(\w+)',\)", text) == ["dp", "tp"], text
    assert _count(text, "psum_invariant") == 0, text


@needs_4_devices
def test_a_gradient_sum_past_the_envelope_falls_back_saying_so(fake_core, monkeypatch, caplog):
    import jax

    import jax_arx
    from jax_arx import _policy

    _policy._logged_reasons.clear()
    monkeypatch.setenv("JAX_ARX_SLOT_BYTES", "256")
    mesh = auto_mesh((4,), ("tp",))
    jax_arx.initialize(mesh)

    def grad():  # traced anew each time (jax caches traces of one function)
        f = jax.shard_map(
            lambda x, w: (x * w).sum(keepdims=True), mesh=mesh, in_specs=(jax.P("tp"), jax.P()), out_specs=jax.P("tp")
        )
        return jax.grad(lambda x, w: f(x, w).sum(), argnums=1)

    x, w = np.ones((4, 128), np.float32), np.ones(128, np.float32)  # w's cotangent: 512 bytes
    with caplog.at_level(logging.WARNING, logger="jax_arx"):
        text = str(jax.make_jaxpr(grad())(x, w))
    assert (_count(text, "jax_arx_psum_invariant"), _count(text, "psum_invariant")) == (0, 1), text
    assert len(caplog.records) == 1, caplog.text
    assert "the sum of a gradient: the transpose of jax's pvary; JAX_ARX_GRAD_SUMS=lax" in caplog.text
    monkeypatch.setenv("JAX_ARX_FALLBACK", "error")
    with pytest.raises(jax_arx.JaxArxFallbackError, match=r"exceeds the one-shot limit.*the sum of a gradient"):
        jax.make_jaxpr(grad())(x, w)


# --- across processes, with the real core ----------------------------------------


@pytest.fixture(scope="module")
def core_built(tmp_path_factory):
    reason = launched.core_is_installed(tmp_path_factory.mktemp("probe"))
    if reason:
        pytest.skip(reason)


def test_gradients_equal_lax_bit_for_bit_with_jax_arx_sums(core_built, tmp_path):
    results = launched.run_suite(THIS, "grad", 2, "shm", tmp_path, env={"JAX_ARX_TIMEOUT_S": "60"})
    for rank, r in results.items():
        # Per program: (jax_arx custom calls, XLA all-reduces) in its lowering.
        assert r["sums"] == {
            "arx, check_vma": [4, 0],  # two forward, two backward: all jax_arx's
            "lax, check_vma": [0, 4],  # the reference: jax.lax.psum, JAX_ARX_GRAD_SUMS=lax
            "arx, no check_vma": [4, 2],  # shard_map's sums of x's and g's cotangents stay jax's
            "lax, no check_vma": [0, 6],  # jax.lax.psum transposes to jax.lax.psum
        }, (rank, r["sums"])
        assert r["checked"] == 2 * ARGS and r["bad"] == [], (rank, r["bad"])


def _worker_grad():
    w = launched.MeshWorker("tp")
    jax, jax_arx, P = w.jax, w.jax_arx, w.P
    from jax_arx import _compat

    args = [
        jax.device_put(a, jax.sharding.NamedSharding(w.mesh, s))
        for a, s in zip(_args(w.world, seed=1), _specs(P), strict=True)
    ]
    report = {"sums": {}, "checked": 0, "bad": []}
    for check_vma in (True, False):
        grads = {}
        for name, psum, grad_sums in (("arx", jax_arx.psum, "jax_arx"), ("lax", jax.lax.psum, "lax")):
            # Traced and compiled under the setting (it is read when the
            # backward pass is traced); run together, for gloo's waits.
            os.environ["JAX_ARX_GRAD_SUMS"] = grad_sums
            f = jax.jit(jax.grad(_model(jax, psum, w.mesh, check_vma), argnums=tuple(range(ARGS))))
            text = f.lower(*args).as_text()
            key = f"{name}, {'check_vma' if check_vma else 'no check_vma'}"
            report["sums"][key] = [text.count("custom_call @jax_arx_psum"), len(re.findall(r"all_reduce", text))]
            compiled = f.lower(*args).compile()
            _compat.distributed_client().wait_at_barrier(f"test_grad/{key}", 600_000)
            grads[name] = compiled(*args)
        del os.environ["JAX_ARX_GRAD_SUMS"]
        for i, (a, b) in enumerate(zip(grads["arx"], grads["lax"], strict=True)):
            got = [np.asarray(s.data) for s in a.addressable_shards]
            want = [np.asarray(s.data) for s in b.addressable_shards]
            report["checked"] += 1
            if any(g.tobytes() != v.tobytes() for g, v in zip(got, want, strict=True)) or not all(
                np.isfinite(g).all() for g in got
            ):
                report["bad"].append(
                    f"check_vma={check_vma} argument {i}: "
                    f"max |diff| {max(float(np.abs(g - v).max()) for g, v in zip(got, want, strict=True))}"
                )
    jax_arx.shutdown()
    return report


if __name__ == "__main__" and "--worker" in sys.argv:
    print(launched.RESULT + json.dumps(_worker_grad()), flush=True)
