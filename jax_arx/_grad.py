"""The sums of the backward pass: jax's ``pvary``, transposed with jax_arx.

Under ``shard_map(check_vma=True)`` (the default) a value that does not vary
over a mesh axis (a replicated input or parameter, the result of a psum) is
made varying by jax's ``pvary`` where it meets one that does, as in
``x @ w_shard``. ``pvary`` moves no data; its transpose is the sum of the
cotangents over the axis. Those are the all-reduces of the backward pass
(Megatron's "f"): ``jax.grad`` of a model whose forward sums are
``jax_arx.psum`` has its backward sums there, since ``jax_arx.psum``'s own
transpose is ``pvary`` again. jax transposes ``pvary`` to its own psum;
jax_arx gives it a transpose rule that sums with ``jax_arx.psum`` over every
mesh axis ``jax_arx.initialize`` set up for the mesh being traced, one call
per axis in mesh order, and with ``jax.lax.psum`` over the others: where
jax_arx has none of the axes, or ``JAX_ARX_GRAD_SUMS=lax``, it is jax's own
rule, one psum over all the axes. A gradient's sum past jax_arx's envelope
falls back as any ``jax_arx.psum`` does (logged once, or raising with
``JAX_ARX_FALLBACK=error``), its message saying it is a gradient's.

The rule is jax's for every pvary of the process, whichever function wrote
the forward pass: jax_arx.initialize() is the user's choice of jax_arx for
those axes. It is read when the backward pass is traced, so a function
traced before keeps what it was traced with for as long as jax caches it.

``check_vma=False`` has no pvary: ``jax_arx.psum``'s transpose is
``jax_arx.psum`` (jax_arx/_psum.py), which covers the sums between layers,
but ``shard_map``'s own transpose sums the cotangents of its inputs that do
not vary over an axis (in_specs that do not name it) with ``jax.lax.psum``,
out of jax_arx's reach. docs/usage.md says what to do about them.
"""

from __future__ import annotations

import jax

from jax_arx import _compat, _policy, _registry, config as _config
from jax_arx._psum import psum

# Appended to a gradient sum's fallback message (jax_arx/_policy.py).
FALLBACK_NOTE = (
    "the sum of a gradient: the transpose of jax's pvary; JAX_ARX_GRAD_SUMS=lax leaves those to jax.lax.psum"
)


def _runs_axis(axis) -> bool:
    """Whether jax_arx set ``axis`` up for the mesh being traced: the axes
    whose gradient sums it takes. Any other (no communicator, or one of
    another mesh that reuses the name) is jax's, silently: nothing asked
    jax_arx to run it."""
    comm = _registry.communicator(axis)
    if comm is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) == (comm.mesh_axis_names, comm.mesh_shape)


def _pvary_transpose(ct, x, *, axes):
    # jax's rule: ct varies over `axes` and the result does not, one psum.
    if not any(_runs_axis(a) for a in axes) or _config.load().grad_sums == "lax":
        return (_compat.lax_psum_bind(ct, axes=tuple(axes), invariant=True),)
    # Summing over the axes one after the other is the same sum, and jax
    # orders `axes` as the mesh does, so every rank takes the same steps.
    with _policy.noting(FALLBACK_NOTE):
        for axis in axes:
            ct = psum(ct, axis) if _runs_axis(axis) else jax.lax.psum(ct, axis)
    return (ct,)


def install() -> None:
    """Makes ``_pvary_transpose`` the transpose of jax's pvary, for every
    function traced from now on (jax_arx.initialize() calls it; again is
    the same)."""
    _compat.override_linear_transpose(_compat.lax_pvary_p, _pvary_transpose)
