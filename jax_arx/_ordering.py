"""How jax_arx's calls are lowered so that every rank issues them in the
same order: the one lowering function of every jax_arx collective
(``emit_ordered_call``) and the call-site tag every call carries.

"""

from __future__ import annotations

import hashlib
import itertools
import os

from jax_arx import _compat

# Each call takes the next sequence number of its endpoint, so every rank
# must issue the calls of a program in one order. XLA's CPU runtime does not
# run a program in program order: it runs each thunk (a kernel, a custom
# call, a whole loop, a whole conditional) as soon as the thunks that wrote
# the buffers it reads are done, several at once, in an order that can
# differ between processes. A custom call declares only the buffers it reads
# and writes, nothing that orders two independent ones. So jax_arx turns the
# order into data: a call reads (and ignores) results of the jax_arx calls
# before it, as trailing dependency operands, and XLA runs a reader after
# the writer. (The handler also holds the endpoint's lock for a whole call,
# so the leaves of one call, its operands in order, never race.)
#
# The dependencies are read off the IR under construction, where the call
# is emitted. Program order in a block is lowering order, which is jaxpr
# order: the same in every process.
#
# - A call depends on the first result of the last jax_arx call before it
#   in its block, and on each op after that one that contains jax_arx calls
#   (a loop, a conditional, a call of a nested jit or scan body, a
#   shard_map). By induction, the calls of a block form one chain.
# - An op that contains calls is depended on through a result computed
#   after the last call inside it: one whose yielded value is computed from
#   that call (`_ordering_value`). Where XLA inlines the op (functions,
#   shard_map bodies) that data path orders the inner call first; a loop or
#   conditional runs as one thunk, complete only when its body is.
#
# What this does not order: the first call inside a nested computation
# after the calls before the computation. jax lowers a loop, cond, scan or
# nested jit as a function of its operands (a loop or cond is built in a
# function of its own, then pasted into place), and a shard_map body as a
# region closed to values from outside, so nothing inside can read a value
# from around it; only the data it reads orders it. In a program where such
# a call and an earlier one are independent, XLA may start them in
# different orders on different ranks. The `site` tag makes that an error
# on every rank ("issued a different collective"), never a wrong sum; make
# one depend on the other's result to fix the order.
#
# The site tag identifies the call site: a hash of the module's name, the
# call's number among the module's jax_arx calls in lowering order, where
# in the user's code it comes from (`_compat.call_site`), the shapes and
# dtypes of its operands and the op's own attributes (the axis a bulk op
# gathers or scatters along), all the same in every process that runs the
# same program. It travels, with size and dtype, in the descriptor each
# rank sends; ranks that pair different calls get an error, even calls of
# two programs that happen to share a name, or that hold the same number
# of elements in another shape ((64, 2) against (2, 64)).

_LOOPS_AND_BRANCHES = ("stablehlo.while", "stablehlo.case", "stablehlo.if")
_TARGET_PREFIX = "jax_arx_"  # the FFI targets of every jax_arx collective


class _Analysis:
    """What one module's lowering learned about its ops (they do not change
    once built: every op before the insertion point is complete)."""

    def __init__(self):
        self.sites = itertools.count(1)
        self.blocks: dict = {}  # block -> _Block
        self.contains: dict = {}  # op -> whether it contains a jax_arx call
        self.values: dict = {}  # op -> its ordering value, or None
        self.functions: dict = {}  # function name -> whether its body contains a jax_arx call


class _Block:
    """A block's ops up to `seen` (jax appends ops, never inserts): its last
    jax_arx call, and the ops after it that contain calls."""

    def __init__(self):
        self.seen = 0
        self.last_call = None
        self.nested: list = []


def _analysis(ctx) -> _Analysis:
    return _compat.module_state(ctx, "psum_ordering", _Analysis)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def call_site_tag(ctx, *attributes) -> int:
    """The `site` attribute of the call being lowered (see above):
    ``attributes`` are the op's own, which must agree across ranks too."""
    n = next(_analysis(ctx).sites)
    operands = ";".join(f"{tuple(a.shape)}{a.dtype}" for a in ctx.avals_in)
    key = f"{_compat.module_name(ctx)}|{n}|{_compat.call_site(ctx, _PACKAGE_DIR)}|{operands}|{attributes}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 16  # 48 bits: the handler tags leaves as site * 64 + i


def emit_ordered_call(ctx, target: str, xs, attributes: dict[str, int | float], *, trailing=()):
    """Emits a side-effecting call of the FFI target ``target`` on operands
    ``xs`` at the end of the current block, reading, as dependency operands
    after them, results of the jax_arx calls before it (see the comment
    above), and then the operands ``trailing`` (psum's prefetch operands,
    which the handler finds at the end). Returns its results, typed by
    ``ctx.avals_out``. Every jax_arx collective lowers through here: they
    all take sequence numbers on the same endpoints, so they all join one
    chain."""
    a = _analysis(ctx)
    ip = _compat.ir.InsertionPoint.current
    ops = ip.block.operations
    if ip.ref_operation is None:
        # jax appends to a block: only the ops added since the last call
        # here are new. ops[i] walks the block in C++, cheaper than
        # iterating it in Python.
        b = a.blocks.setdefault(ip.block, _Block())
        new = (ops[i].operation for i in range(b.seen, len(ops)))
    else:  # inserting before an op: look at everything before it
        b, stop = _Block(), ip.ref_operation.operation
        new = itertools.takewhile(lambda op: op != stop, (op.operation for op in ops))
    for op in new:
        if _is_call(op):  # pasted in with a copy of a cached lowering
            b.last_call, b.nested = op, []
        elif _contains_call(op, ctx, a):
            b.nested.append(op)
    deps = []
    for op in ([b.last_call] if b.last_call is not None else []) + b.nested:
        v = _ordering_value(op, ctx, a)
        if v is not None and v not in deps and v not in xs:
            deps.append(v)
    results = _compat.ffi_custom_call(ctx, target, [*xs, *deps, *trailing], has_side_effect=True, attributes=attributes)
    if ip.ref_operation is None:
        b.last_call, b.nested, b.seen = results[0].owner.operation, [], len(ops)
    return results


def _is_call(op) -> bool:
    """Whether ``op`` is a jax_arx collective (any of its FFI targets)."""
    if op.name != "stablehlo.custom_call":
        return False
    return _compat.ir.StringAttr(op.attributes["call_target_name"]).value.startswith(_TARGET_PREFIX)


def _callee(op, ctx):
    """The body block of the function a func.call calls, or None."""
    name = _compat.ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    try:
        func = ctx.module_context.symbol_table[name]
    except KeyError:
        return None
    regions = func.operation.regions
    return regions[0].blocks[0] if len(regions) and len(regions[0].blocks) else None


def _contains_call(op, ctx, a: _Analysis) -> bool:
    """Whether ``op`` holds a jax_arx call in its regions or in a function
    it calls (at any depth)."""
    if not len(op.regions) and op.name != "func.call":
        return False
    if op in a.contains:
        return a.contains[op]
    ir = _compat.ir
    found = False

    def visit(o):
        nonlocal found
        if _is_call(o) or (o.name == "func.call" and _function_contains_call(o, ctx, a)):
            found = True
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    a.contains[op] = found
    return found


def _function_contains_call(call, ctx, a: _Analysis) -> bool:
    name = _compat.ir.FlatSymbolRefAttr(call.attributes["callee"]).value
    if name not in a.functions:
        a.functions[name] = False  # a recursive call finds nothing new
        body = _callee(call, ctx)
        a.functions[name] = body is not None and _contains_call(body.owner.operation, ctx, a)
    return a.functions[name]


def _ordering_value(op, ctx, a: _Analysis):
    """A result of ``op`` (a jax_arx call, or an op containing some) that is
    available only after every jax_arx call in it ran, or None."""
    if _is_call(op):
        return op.results[0]
    if op in a.values:
        return a.values[op]
    a.values[op] = None  # while computing (a function cannot reach itself)
    blocks = (
        [_callee(op, ctx)]
        if op.name == "func.call"
        else [r.blocks[len(r.blocks) - 1] for r in op.regions if len(r.blocks)]
    )
    results = list(op.results)
    tensor = {i for i, r in enumerate(results) if isinstance(r.type, _compat.ir.RankedTensorType)}
    good = None  # indices of results computed after the last call of every block that has one
    for block in blocks:
        if block is None:
            good = set()
            break
        ops = [o.operation for o in block.operations]
        yielded = list(ops[-1].operands) if ops else []
        if len(yielded) != len(results):
            continue  # not the block that makes the results (a loop's condition)
        last = next((o for o in reversed(ops) if _is_call(o) or _contains_call(o, ctx, a)), None)
        if last is None:
            continue
        target = last if _is_call(last) else _ordering_value(last, ctx, a)
        found = set() if target is None else {i for i, v in enumerate(yielded) if _reaches(v, target, block)}
        good = found if good is None else good & found
    good = sorted((good or set()) & tensor)
    value = results[good[0]] if good else None
    if value is None and op.name in _LOOPS_AND_BRANCHES and tensor:
        # XLA runs a loop or a conditional as one thunk: any result the body
        # writes is available only after the whole of it.
        if op.name == "stablehlo.while":
            body = op.regions[1].blocks[0]
            written = [
                i
                for i, v in enumerate(list(body.operations)[-1].operation.operands)
                if i in tensor and v != body.arguments[i]
            ]
            value = results[written[0]] if written else None
        else:
            value = results[min(tensor)]
    a.values[op] = value
    return value


def _reaches(value, target, block) -> bool:
    """Whether ``value`` is computed, within ``block``, from ``target`` (a
    value, or any result of an op)."""
    ir = _compat.ir
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(target, ir.Value) and v == target:
            return True
        owner = v.owner
        if isinstance(owner, ir.Block):
            continue  # an argument: from outside
        op = owner.operation
        if op in seen:
            continue
        seen.add(op)
        if op == target:
            return True
        if op.block != block:
            continue  # from an enclosing block: computed before `block` ran
        stack.extend(op.operands)
        if len(op.regions):
            # What ops nested in its regions use from this block.
            def visit(o):
                stack.extend(
                    x for x in o.operands if not isinstance(x.owner, ir.Block) and x.owner.operation.block == block
                )
                return ir.WalkResult.ADVANCE

            op.walk(visit)
    return False
