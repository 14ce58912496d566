"""Every use of jax's private modules (``jax._src``) lives here.

jax_arx defines primitives the way jax's own collectives are defined
(``jax/_src/lax/parallel.py``), which needs jax internals: the primitive
machinery, autodiff and batching registries, the varying-manual-axes (vma)
type of values inside ``shard_map``, the lowering registry, and the
jax.distributed key-value store. Keeping them in one file means a new jax
release breaks jax_arx in one place, and that place says what it relied on.

Tested with jax 0.10.2; every name used here was checked to exist, with the
same signature, in the sources of jax 0.10.0 and 0.11.2 (the lowering helpers
added for the variadic psum against 0.10.0 and 0.10.2 only; the one
signature that differs is handled in ``_aval_to_ir_type``).
"""

from __future__ import annotations

import inspect
import os
from functools import partial
from typing import Any

import jax
from jax._src import (
    config as _jax_config,
    core as _core,
    dispatch as _dispatch,
    distributed as _distributed,
    source_info_util as _source_info_util,
)
from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir
from jax._src.lax import parallel as _parallel

# --- primitive machinery ----------------------------------------------------

Primitive = _core.Primitive
Tracer = _core.Tracer
NamedAxisEffect = _core.NamedAxisEffect
deflinear2 = _ad.deflinear2
Zero = _ad.Zero  # a symbolic zero cotangent
register_lowering = _mlir.register_lowering
# The impl of a collective outside any transformation: compile the single
# primitive and run it, as jax does for its own psum (which then complains
# about the unbound axis name, the right error for a psum outside shard_map).
apply_primitive = _dispatch.apply_primitive


def register_jvp(primitive, rule) -> None:
    """Registers ``rule(primals, tangents, **params)`` as the primitive's
    JVP, in place of the one ``deflinear2`` derives (jax_arx.psum's own
    skips zero tangents and drops its prefetch operands)."""
    _ad.primitive_jvps[primitive] = rule


def override_linear_transpose(primitive, rule) -> None:
    """Makes ``rule(ct, *args, **params)`` the transpose of a linear
    primitive (jax's own included), as ``deflinear2`` registers one: a
    symbolic zero cotangent never reaches it. The JVP stays as it is."""
    _ad.primitive_transposes[primitive] = partial(_ad.linear_transpose2, rule)


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


def lax_psum_lowering(ctx, xs, *, axes: tuple) -> list:
    """Lowers a sum over ``axes`` of each of ``xs`` (the operands of the
    lowering rule ``ctx`` belongs to) the way ``jax.lax.psum`` does: one XLA
    all-reduce each. Used where jax_arx falls back at lowering time. jax's
    rule takes one operand and depends only on its context and ``axes``; both
    psum primitives share it."""
    rule = _mlir._lowerings[lax_psum_p].rule
    out = []
    for x, aval_in, aval_out in zip(xs, ctx.avals_in, ctx.avals_out, strict=False):
        leaf_ctx = ctx.replace(avals_in=[aval_in], avals_out=[aval_out])
        out.extend(rule(leaf_ctx, x, axes=axes, axis_index_groups=None))
    return out


def lower_fun(fun, ctx, *operands) -> list:
    """Lowers the jax function ``fun`` (multiple results) in place of a
    primitive, with the primitive's lowering context ``ctx``: what a fused
    op falls back to at lowering time."""
    return _mlir.lower_fun(fun, multiple_results=True)(ctx, *operands)


def lax_psum_batcher(axis_data, vals_in, dims_in, *, axes: tuple, invariant: bool):
    """jax's batching rule for its psum, for a vmap over the reduced axis
    itself, where only jax knows what to do."""
    if invariant:
        return _batching.fancy_primitive_batchers[lax_psum_invariant_p](axis_data, vals_in, dims_in, axes=axes)
    return _batching.fancy_primitive_batchers[lax_psum_p](
        axis_data, vals_in, dims_in, axes=axes, axis_index_groups=None
    )


def lax_psum_bind(x, *, axes: tuple, invariant: bool):
    """Binds jax's own psum primitive of the given flavour directly, below
    ``jax.lax.psum``'s argument handling (for use inside rules)."""
    if invariant:
        return lax_psum_invariant_p.bind(x, axes=axes)
    return lax_psum_p.bind(x, axes=axes, axis_index_groups=None)


# jax's own all_gather and psum_scatter (reduce_scatter) primitives, for
# jax_arx.all_gather / psum_scatter (jax_arx/_bulk.py): their typing
# rules, batching rules and lowerings. Their params: all_gather_dimension /
# scatter_dimension, axis_name (a tuple), axis_index_groups, axis_size, tiled.
lax_all_gather_p = _parallel.all_gather_p
lax_reduce_scatter_p = _parallel.reduce_scatter_p


def lax_collective_abstract_eval(prim, aval, **params):
    """jax's abstract evaluation of its all_gather_p / reduce_scatter_p:
    the output type (shape, vma) and effects, shape errors included."""
    return prim.abstract_eval(aval, **params)


def lax_collective_lowering(prim, ctx, x, **params):
    """Lowers jax's all_gather_p / reduce_scatter_p with jax's own rule for
    this platform (an XLA collective). Used where jax_arx falls back at
    lowering time."""
    platforms = ctx.module_context.platforms
    entry = _mlir._platform_specific_lowerings[platforms[0]].get(prim) if len(platforms) == 1 else None
    return (entry or _mlir._lowerings[prim]).rule(ctx, x, **params)


def lax_collective_batcher(prim, axis_data, vals_in, dims_in, **params):
    """jax's batching rule for its all_gather_p / reduce_scatter_p (for a
    vmap over the collective's own axis, where only jax knows what to do)."""
    return _batching.fancy_primitive_batchers[prim](axis_data, vals_in, dims_in, **params)


def aval_like(aval, shape, dtype, varying: frozenset):
    """``aval`` with another shape and dtype, typed as varying over
    ``varying`` (the mesh axes): a collective's output type."""
    return aval.update(
        shape=tuple(shape), dtype=dtype, weak_type=False, manual_axis_type=aval.mat.update(varying=frozenset(varying))
    )


# --- varying manual axes (vma) ----------------------------------------------


def bound_axis_names() -> tuple:
    """The axis names collectives can name where this is traced: the
    manual mesh axes of the enclosing shard_maps and the names jax.vmap
    bound (jax's axis environment)."""
    return tuple(_core.unsafe_get_axis_names())


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


# jax's invariant -> varying cast (no data moves); its transpose is a psum.
# (pvary_p and ad.linear_transpose2, used by override_linear_transpose, are
# as here in jax 0.10.0 and 0.10.2.)
lax_pvary_p = _core.pvary_p


def pvary(x, axes: tuple):
    """Marks ``x`` as varying over ``axes`` (no data moves): jax's
    ``core.pvary``, whose transpose is jax's psum."""
    return _core.pvary(x, axes)


def pvary_to(x, axes: tuple):
    """What jax's collectives do to their input under ``check_vma``: a value
    not typed as varying over some of ``axes`` is made so (jax's
    ``insert_collective_pvary``); unchanged where check_vma is off or jax
    inserts no pvary by itself. The one copy every jax_arx op binds through."""
    if not (check_vma_enabled() and auto_pcast_enabled()):
        return x
    missing = tuple(a for a in axes if a not in varying_axes(jax.typeof(x)))
    return pvary(x, missing) if missing else x


def axes_tuple(axis_name) -> tuple:
    """``axis_name`` as jax.lax's collectives take it (one name, or a tuple
    or list of names), as a tuple."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def is_undefined_primal(x) -> bool:
    return _ad.is_undefined_primal(x)


# --- lowering ---------------------------------------------------------------

# The MLIR Python bindings jax lowers with (``ir.Operation``, ``ir.Value``,
# ``ir.InsertionPoint``, ...).
ir = _mlir.ir
ir_constant = _mlir.ir_constant  # a numpy array as a constant op's result


def ffi_custom_call(
    ctx,
    target: str,
    operands,
    *,
    attributes: dict[str, int | float],
    has_side_effect: bool,
    operand_output_aliases: dict[int, int] | None = None,
):
    """Emits a typed-FFI (api_version 4) custom call to ``target`` at the
    current insertion point, as ``jax.ffi.ffi_lowering`` does, but with
    operands beyond ``ctx.avals_in`` (of any type, passed as IR values):
    results are typed by ``ctx.avals_out``, every operand and result is laid
    out row-major, and ``attributes`` become int64 FFI attributes (a float:
    float32); ``operand_output_aliases`` maps an operand's index to the
    result that is its buffer. Returns the op's results."""
    result_types = [_aval_to_ir_type(ctx, a) for a in ctx.avals_out]

    def row_major(t):
        rank = ir.RankedTensorType(t).rank
        return tuple(range(rank - 1, -1, -1))

    op = _mlir.custom_call(
        target,
        result_types=result_types,
        operands=list(operands),
        backend_config={
            k: ir.FloatAttr.get(ir.F32Type.get(), v) if isinstance(v, float) else _mlir.i64_attr(v)
            for k, v in attributes.items()
        },
        has_side_effect=has_side_effect,
        operand_output_aliases=operand_output_aliases,
        api_version=4,
        operand_layouts=[row_major(v.type) for v in operands],
        result_layouts=[row_major(t) for t in result_types],
    )
    return list(op.results)


def _aval_to_ir_type(ctx, aval):
    # jax 0.10.0 takes the aval alone; 0.10.2 the module context first.
    if len(inspect.signature(_mlir.aval_to_ir_type).parameters) == 1:
        return _mlir.aval_to_ir_type(aval)
    return _mlir.aval_to_ir_type(ctx.module_context, aval)


def module_state(ctx, key: str, factory):
    """Per-module state for a lowering rule: an object made by ``factory()``
    the first time ``key`` is asked for while lowering this module, the same
    object afterwards. It lives in the module context's lowering cache, a
    dict that every context derived from the module's shares."""
    cache = ctx.module_context.cached_primitive_lowerings
    full_key = ("jax_arx", key)
    if full_key not in cache:
        cache[full_key] = factory()
    return cache[full_key]


def module_name(ctx) -> str:
    """The name of the module being lowered (``jit_<function>``): the same in
    every process that lowers the same program."""
    attr = ctx.module_context.module.operation.attributes["sym_name"]
    return ir.StringAttr(attr).value


def call_site(ctx, skip_dir: str) -> str:
    """Where the equation being lowered comes from, in terms that are the
    same in every process running the same program: jax's name stack (the
    functions and transformations it is nested in) and the innermost user
    frame outside ``skip_dir`` as file name (not path: installs differ
    between hosts), line and function. Frames further out are left out:
    they include whatever called the jitted function first, which may
    differ between processes."""
    frame = next(
        (f for f in _source_info_util.user_frames(ctx.traceback) if not f.file_name.startswith(skip_dir)), None
    )
    where = f"{os.path.basename(frame.file_name)}:{frame.start_line}:{frame.function_name}" if frame else ""
    return f"{ctx.name_stack}|{where}"


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
