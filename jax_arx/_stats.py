"""``jax_arx.stats()``: what jax_arx ran in this process, and what it left to
``jax.lax``. The counters live in the C++ endpoints (``Endpoint::Stats``,
ffi/comm/endpoint.h), the fallbacks and the plans' unfused pairs in
``_policy``."""

from __future__ import annotations

from jax_arx import _policy, _registry

OPS = ("psum", "all_gather", "psum_scatter", "moe_combine_psum_scatter")


def stats() -> dict:
    """What jax_arx has run in this process, per communicator and
    collective, and what it left to ``jax.lax``. Cheap, non-blocking and
    local: it reads counters; call it between steps, or after a failure.

    Returns a dict of plain Python values:

    .. code-block:: text

        {"communicators": {axis_name: {
             "transport": "shm" | "tcp" | "verbs",
             "world": ranks along the axis,
             "ops": {op: {"calls": n, "bytes": n, "failed": n,
                          "algorithms": {algorithm: n}}},
             "stalls": n,
             "relayed_puts": n,
             "endpoints": [{"rank", "group", "device", "ops", "stalls",
                            "last_stall", "relayed_puts", "failure"}]}},
         "fallbacks": {op: {reason: n}},
         "plans": {op: {reason: n}}}

    - ``communicators``: one entry per mesh axis ``jax_arx.initialize`` set
      up (and ``jax_arx.shutdown`` has not closed); its counters start at 0
      when it is set up. ``endpoints`` holds one entry per device of this
      process on the axis (one, with one device per process), by rank:
      ``group`` is its group's index among the axis's groups (the other
      axes' positions), ``device`` the jax device's ``str``. A
      communicator's ``ops``, ``stalls`` and ``relayed_puts`` are its
      endpoints' summed.
    - ``ops``: for each of ``psum``, ``all_gather``, ``psum_scatter``,
      ``moe_combine_psum_scatter``: ``calls``, the collectives whose handler
      ran (a psum of a pytree is one per leaf jax_arx sums; on GPUs, a
      program replayed from a CUDA graph runs no handler and is not
      counted; nor is a fallback's notice, the one-float psum a call past
      the size envelope sends before jax.lax runs it); ``bytes``, their
      bytes per rank (a psum's partial, an all_gather's input, a
      psum_scatter's or the combine's output);
      ``failed``, the calls whose handler failed (in ``calls`` too, but for
      one refused because another collective was running on the endpoint,
      which counts here only; the CPU backend: on GPUs a kernel's failure
      shows in ``failure`` only); ``algorithms``, the calls
      by the algorithm that ran them: ``one_shot``, ``two_shot`` (GPUs,
      past the one-shot limit), ``ll`` (GPUs, small psums with their flags in
      the data), ``bulk`` (the prefill ops), each listed once it has run.
    - ``stalls``: how many times the watchdog saw a collective make no
      progress for 2 s (a peer late, stopped or gone; not an error by
      itself), and ``last_stall`` the last such report, in words: what was
      under way and what each peer last sent; None before the first.
    - ``relayed_puts``: writes this rank forwarded for a neighbour (a ring
      of 4: ``JAX_ARX_TOPOLOGY=ring``); 0 elsewhere.
    - ``failure``: the endpoint's failure message (what ``jax_arx.check()``
      raises), or None while it is healthy.
    - The bulk collectives run on a second endpoint per device, made at the
      axis's first bulk call; its counters are in the same entry.
    - ``fallbacks``: per op, the calls that went to ``jax.lax`` instead,
      by the reason logged for them (the gradient sums of ``jax.grad`` count
      under ``psum``, their reason saying so). Counted when a call is
      traced (or lowered), not each time its compiled program runs; since
      jax_arx was imported. The calls jax_arx leaves to jax.lax silently
      (constants, axes of size 1, names bound by ``jax.vmap``) are not
      fallbacks.
    - ``plans``: per op, the calls the plan ran as their unfused pair
      instead of the fused op, by the plan's reason (which names the route
      and the measurement that chose it). Today only
      ``moe_combine_psum_scatter``: ``jax_arx.moe_combine`` then
      ``jax_arx.psum_scatter``, whose result is the fused op's, bit for bit
      (the ``psum_scatter`` is counted under ``ops`` as such). No fallback:
      not logged, not refused by ``JAX_ARX_FALLBACK=error``. Counted when a
      call is traced; since jax_arx was imported.
    """
    comms = {}
    for axis, comm in _registry.communicators().items():
        # The bulk collectives run on endpoints of their own, made at the
        # first bulk call (_bulk_endpoints): each counts as part of the
        # axis's endpoint on the same device.
        bulk = _registry.bulk_communicator(axis)
        bulk_of = {(le.group, le.rank): le for le in bulk.endpoints} if bulk else {}
        endpoints = []
        for le in sorted(comm.endpoints, key=lambda le: (le.group, le.rank)):
            raws = [e.endpoint.stats() for e in (le, bulk_of.get((le.group, le.rank))) if e is not None]
            endpoints.append(
                {
                    "rank": le.rank,
                    "group": le.group,
                    "device": str(le.device),
                    "ops": {op: _summed([_op(r["ops"][op]) for r in raws]) for op in OPS},
                    "stalls": sum(int(r["stalls"]) for r in raws),
                    "last_stall": next((r["last_stall"] for r in reversed(raws) if r["last_stall"]), None),
                    "relayed_puts": sum(int(r["relayed_puts"]) for r in raws),
                    "failure": next((r["failure"] for r in raws if r["failure"]), None),
                }
            )
        comms[axis] = {
            "transport": _registry.transport(axis),
            "world": comm.mesh_shape[comm.mesh_axis_names.index(axis)],
            "ops": {op: _summed([e["ops"][op] for e in endpoints]) for op in OPS},
            "stalls": sum(e["stalls"] for e in endpoints),
            "relayed_puts": sum(e["relayed_puts"] for e in endpoints),
            "endpoints": endpoints,
        }
    return {"communicators": comms, "fallbacks": _policy.fallback_counts(), "plans": _policy.plan_counts()}


def _op(raw: dict) -> dict:
    return {
        "calls": int(raw["calls"]),
        "bytes": int(raw["bytes"]),
        "failed": int(raw["failed"]),
        "algorithms": {name: int(n) for name, n in raw["algorithms"].items()},
    }


def _summed(ops: list[dict]) -> dict:
    out = {"calls": 0, "bytes": 0, "failed": 0, "algorithms": {}}
    for op in ops:
        for key in ("calls", "bytes", "failed"):
            out[key] += op[key]
        for name, n in op["algorithms"].items():
            out["algorithms"][name] = out["algorithms"].get(name, 0) + n
    return out
