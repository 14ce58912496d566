"""A fallback's notice: a call that ``jax.lax`` runs because its operand is
outside the plan's envelope on this rank tells its peers so first, over
jax_arx's own channel, before jax.lax's collective starts.

Ranks running one program may still size an operand differently (a batch
or a sequence length of their own). A rank within the envelope runs
jax_arx's collective and waits for its peers up to the timeout; a rank
outside it would enter jax.lax's collective (gloo on the CPU, NCCL on
GPUs), which waits for the others without bound. With the notice, the rank
outside the envelope first issues a jax_arx psum of one float32 zero whose
call-site tag (``_ordering.call_site_tag``) names the call and its operand's
shape and dtype. At that sequence number a peer that runs jax_arx's
collective sees a different collective and raises a mismatch on every rank
(comm/wait.h), and the notice itself fails the same way, so the jax.lax
collective never starts. A bulk collective's notice is a psum too, on the
axis's psum communicator: a fallback makes no bulk endpoints (whose lanes
pin memory), so a peer running jax_arx's all_gather there waits on the bulk
communicator and this rank on the psum one, and both give up within the
timeout, each naming the other. Ranks that all fell back with the same
operand send equal notices, which complete in a few microseconds, and then
run jax.lax's collective; ranks that fell back with operands of different
sizes send different notices, and raise instead of handing jax.lax
collectives that disagree.

The order: jax.lax's collective reads ``announce``'s result, which the
``arx_after`` target returns as its operand's own buffer (aliased) once the
notice's result is in. XLA's CPU runtime runs independent ops at once and
orders them only by the buffers they share, so only such a data path makes
the notice come first.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from jax_arx import _compat, _ordering, _policy

PSUM_TARGET = "jax_arx_psum"  # the notice is a psum, on the psum communicator's sequence
AFTER_TARGET = "arx_after"  # y = x once the dependency operands are in (ffi/xla/handlers_host.cc)
# A notice's psum carries the attribute notice = 1: stats() leaves it out of
# the psum calls (ffi/xla/handlers.h), and a lowering's reader tells it
# from the program's own sums by it.


def announce(x, decision, op: _policy.Op):
    """``x``, after a notice that this call of ``op`` falls back to jax.lax,
    where ``decision`` is a ``_policy.Notice``; else ``x`` itself."""
    if not isinstance(decision, _policy.Notice) or not isinstance(x, _compat.Tracer):
        return x
    return notice_p.bind(x, comm_id=decision.comm_id, op=op.name)


def _notice_lowering(ctx, x, *, comm_id, op):
    if _policy.lowering_refusal(ctx, comm_id, ("notice",)) is not None:
        return [x]  # the axis was shut down since tracing: nobody to tell
    # The tag: the call site, and (through ctx.avals_in) the operand's shape
    # and dtype, so that ranks whose fallbacks differ in size disagree too.
    site = _ordering.call_site_tag(ctx, "fallback notice", op)
    one = jax.core.ShapedArray((1,), np.float32)
    zero = _compat.ir_constant(np.zeros(1, np.float32))
    (done,) = _ordering.emit_ordered_call(
        ctx.replace(avals_in=[one], avals_out=[one]), PSUM_TARGET, [zero], dict(comm_id=comm_id, site=site, notice=1)
    )
    return _compat.ffi_custom_call(
        ctx, AFTER_TARGET, [x, done], attributes={}, has_side_effect=False, operand_output_aliases={0: 0}
    )


def _notice_jvp(primals, tangents, **params):
    # The tangent's collective, and the cotangent's (the transpose is the
    # identity), get no notice of their own: they are the same size on
    # every rank exactly when the primal's are, whose notice fails a program
    # whose ranks straddle. What that leaves unordered: a tangent or
    # cotangent sum that depends on no value computed after the notice (a
    # linear program's), which XLA may start first.
    return notice_p.bind(primals[0], **params), tangents[0]


def _notice_batcher(axis_data, vals_in, dims_in, **params):
    return notice_p.bind(vals_in[0], **params), dims_in[0]


notice_p = _compat.Primitive("jax_arx_fallback_notice")
notice_p.def_impl(partial(_compat.apply_primitive, notice_p))
notice_p.def_abstract_eval(lambda aval, **params: aval)
# cacheable=False: as psum's (jax_arx/_psum.py), the rule runs for every call.
_compat.register_lowering(notice_p, _notice_lowering, cacheable=False)
_compat.deflinear2(notice_p, lambda ct, x, **params: [ct])
_compat.register_jvp(notice_p, _notice_jvp)
_compat.register_batcher(notice_p, _notice_batcher)
