"""Every use of jax's private modules (``jax._src``) lives here.

jax_arx defines primitives the way jax's own collectives are defined
(``jax/_src/lax/parallel.py``), which needs jax internals: the primitive
machinery, autodiff and batching registries, the varying-manual-axes (vma)
type of values inside ``shard_map``, the lowering registry, and the
jax.distributed key-value store. Keeping them in one file means a new jax
release breaks jax_arx in one place, and that place says what it relied on.

Tested with jax 0.10.2; every name used here was checked to exist, with the
same signature, in the sources of jax 0.10.0 and 0.11.2.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import distributed as _distributed
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.lax import parallel as _parallel

# --- primitive machinery ----------------------------------------------------

Primitive = _core.Primitive
Tracer = _core.Tracer
NamedAxisEffect = _core.NamedAxisEffect
deflinear2 = _ad.deflinear2
register_lowering = _mlir.register_lowering
# The impl of a collective outside any transformation: compile the single
# primitive and run it, as jax does for its own psum (which then complains
# about the unbound axis name, the right error for a psum outside shard_map).
apply_primitive = _dispatch.apply_primitive


def register_batcher(primitive, rule) -> None:
    """Registers a batching rule that also receives the vmapped axis
    (``rule(axis_data, vals_in, dims_in, **params)``), like jax's
    collectives use: it needs ``axis_data.name`` to tell a vmap over the
    reduced axis from any other."""
    _batching.fancy_primitive_batchers[primitive] = rule


# jax's own psum primitives. jax_arx delegates to them whatever it does not
# run itself, and reuses their typing rules so its types are jax's types.
lax_psum_p = _parallel.psum_p  # check_vma=False: varying -> unknown
lax_psum_invariant_p = _parallel.psum_invariant_p  # check_vma=True: varying -> invariant


def lax_psum_abstract_eval(aval, axes: tuple, *, invariant: bool):
    """jax's own abstract evaluation of ``psum`` over ``axes``: the output
    type (shape, dtype, weak type, sharding, vma) and effects that
    ``jax.lax.psum`` gives this input, errors included."""
    if invariant:
        return lax_psum_invariant_p.abstract_eval(aval, axes=axes)
    return lax_psum_p.abstract_eval(aval, axes=axes, axis_index_groups=None)


def lax_psum_lowering(ctx, x, *, axes: tuple):
    """Lowers a sum over ``axes`` the way ``jax.lax.psum`` does (an XLA
    all-reduce). Used where jax_arx falls back at lowering time. The rule
    depends only on ``ctx`` and ``axes``, and both psum primitives share it."""
    return _mlir._lowerings[lax_psum_p].rule(ctx, x, axes=axes, axis_index_groups=None)


def lax_psum_batcher(axis_data, vals_in, dims_in, *, axes: tuple, invariant: bool):
    """jax's batching rule for its psum, for a vmap over the reduced axis
    itself, where only jax knows what to do."""
    if invariant:
        return _batching.fancy_primitive_batchers[lax_psum_invariant_p](
            axis_data, vals_in, dims_in, axes=axes)
    return _batching.fancy_primitive_batchers[lax_psum_p](
        axis_data, vals_in, dims_in, axes=axes, axis_index_groups=None)


def lax_psum_bind(x, *, axes: tuple, invariant: bool):
    """Binds jax's own psum primitive of the given flavour directly, below
    ``jax.lax.psum``'s argument handling (for use inside rules)."""
    if invariant:
        return lax_psum_invariant_p.bind(x, axes=axes)
    return lax_psum_p.bind(x, axes=axes, axis_index_groups=None)


# --- varying manual axes (vma) ----------------------------------------------

def check_vma_enabled() -> bool:
    """True inside ``shard_map(..., check_vma=True)`` (the default): values
    carry the set of mesh axes they vary over, and psum is typed as
    varying -> invariant."""
    return bool(_jax_config._check_vma.value)


def auto_pcast_enabled() -> bool:
    """True when jax inserts ``pvary`` by itself to make types match (so
    ``psum`` of a value that does not vary over the axis is ``size * x``
    rather than a type error)."""
    flag = getattr(_jax_config, "auto_pcast", None)
    return bool(flag.value) if flag is not None else True


def varying_axes(aval) -> frozenset:
    """The mesh axes a value is typed as varying over."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def unreduced_axes(aval) -> frozenset:
    """Mesh axes over which ``aval`` holds unreduced partial sums (and
    ``reduced`` ones): jax's psum treats such inputs specially."""
    mat = getattr(aval, "mat", None)
    if mat is None:
        return frozenset()
    return frozenset(getattr(mat, "unreduced", ())) | frozenset(getattr(mat, "reduced", ()))


def pvary(x, axes: tuple):
    """Marks ``x`` as varying over ``axes`` (no data moves): jax's
    ``core.pvary``, whose transpose is jax's psum."""
    return _core.pvary(x, axes)


def is_undefined_primal(x) -> bool:
    return _ad.is_undefined_primal(x)


# --- lowering context -------------------------------------------------------

def lowering_mesh_device_ids(ctx) -> tuple[int, ...] | None:
    """The flat device ids of the concrete mesh a ``shard_map`` body is
    being lowered for, or None when only an abstract mesh is known."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    mesh = getattr(axis_context, "mesh", None)
    if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh):
        return None
    try:
        return tuple(int(i) for i in mesh.device_ids.flat)
    except (AttributeError, ValueError):
        return None


# --- devices ----------------------------------------------------------------

def xla_device_ordinal(device) -> int:
    """The number XLA passes to an FFI handler as ``DeviceOrdinal`` when it
    runs on ``device``: how a handler tells which local device it runs on.

    - GPU: the StreamExecutor ordinal, i.e. the CUDA device index in this
      process, which jax exposes as ``device.local_hardware_id``.
    - CPU: the PjRt CPU client passes the device's global id
      (``device.id``), not its index among the local devices: measured with
      jaxlib 0.10.2 on 2 processes x 2 CPU devices, the ordinals were
      0, 1 in process 0 and 2048, 2049 in process 1.
    """
    if device.platform == "cpu":
        return int(device.id)
    if device.local_hardware_id is None:
        raise ValueError(f"{device} is not a device of this process")
    return int(device.local_hardware_id)


# --- jax.distributed --------------------------------------------------------

def distributed_client() -> Any | None:
    """jax.distributed's client (key-value store and barriers), or None
    when ``jax.distributed.initialize`` has not been called."""
    return _distributed.global_state.client


def coordinator_address() -> str | None:
    """The ``host:port`` of jax.distributed's coordinator, or None."""
    return _distributed.global_state.coordinator_address
