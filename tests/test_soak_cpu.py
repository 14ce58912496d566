"""A soak of mixed collectives on the CPU backend with the real C++ core:
psum of several sizes and dtypes, all_gather, psum_scatter and the fused
MoE combine, one after the other in an order drawn by a seeded generator
(the same on every rank), each call with fresh inputs, checked bit for bit
against numpy (the references of tests/bulk_reference.py: the float32
rank-order sum from rank 0's element, rounded once), so every rank's
results are the same bits. Reducing inputs lead with signed zeros (-0.0 on
every rank must sum to -0.0).

Short in CI (``CALLS`` calls, about 20-40 s a test); long on demand:
``JAX_ARX_SOAK_CALLS=20000 pytest tests/test_soak_cpu.py``.

Needs jax_arx installed with its C++ module (``pip install .``); skipped
otherwise.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import launched

THIS = os.path.abspath(__file__)
CALLS = 300  # per test in CI; JAX_ARX_SOAK_CALLS overrides
ZEROS = 4  # leading elements of reducing inputs set to signed zeros


@pytest.fixture(scope="module")
def core_built(tmp_path_factory):
    reason = launched.core_is_installed(tmp_path_factory.mktemp("probe"))
    if reason:
        pytest.skip(reason)


def _calls() -> int:
    value = os.environ.get("JAX_ARX_SOAK_CALLS", "")
    if not value:
        return CALLS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"JAX_ARX_SOAK_CALLS={value!r}: use a positive number of calls")
    return int(value)


@pytest.mark.soak
@pytest.mark.parametrize("transport,nprocs", [("shm", 2), ("tcp", 3)])
def test_mixed_collectives_soak(core_built, tmp_path, transport, nprocs):
    calls = _calls()
    results = launched.run_suite(
        THIS,
        f"soak:{calls}",
        nprocs,
        transport,
        tmp_path,
        timeout=300 + calls // 10,
        env={"JAX_ARX_PREFILL_SLOT_BYTES": "256K", "JAX_ARX_TIMEOUT_S": "60"},
    )
    launched.assert_all_correct(results, expect=["soak"])
    for rank, r in results.items():
        assert r["calls"] == calls and sum(r["by_program"].values()) == calls, (rank, r)
        # Every program ran (the draw is the same on every rank).
        assert len(r["by_program"]) == len(_programs(nprocs, None)) or calls < 100, (rank, r["by_program"])


# --- the programs --------------------------------------------------------------------


def _programs(world, jax_arx):
    """name -> (inputs: [(per-rank shape, dtype name)], body on the
    unstacked values, references: fn(parts by input, rank) -> [arrays]).
    Reducing inputs take signed zeros (_signed_zeros)."""
    from bulk_cases import reference_gather, reference_scatter, reference_sum

    def psum(shape, dt):
        return ([(shape, dt)], lambda x: (jax_arx.psum(x, "sp"),), lambda parts, r: [reference_sum(parts[0])])

    def gather(shape, dt, axis, tiled):
        return (
            [(shape, dt)],
            lambda x: (jax_arx.all_gather(x, "sp", axis=axis, tiled=tiled),),
            lambda parts, r: [reference_gather(parts[0], axis, tiled)],
        )

    def scatter(shape, dt, dim, tiled):
        return (
            [(shape, dt)],
            lambda x: (jax_arx.psum_scatter(x, "sp", scatter_dimension=dim, tiled=tiled),),
            lambda parts, r: [reference_scatter(parts[0], dim, tiled, r)],
        )

    def mixed():
        # Independent calls of three kinds in one program (jax_arx orders them).
        shapes = [((100,), "float32"), ((10, 3), "bfloat16"), ((world * 16,), "float16")]

        def body(a, b, c):
            return (
                jax_arx.psum(a, "sp"),
                jax_arx.all_gather(b, "sp", axis=1),
                jax_arx.psum_scatter(c, "sp", tiled=True),
            )

        return (
            shapes,
            body,
            lambda parts, r: [
                reference_sum(parts[0]),
                reference_gather(parts[1], 1, False),
                reference_scatter(parts[2], 0, True, r),
            ],
        )

    return {
        "psum f32[1]": psum((1,), "float32"),
        "psum f32[1000]": psum((1000,), "float32"),
        "psum f32[16384]": psum((16384,), "float32"),
        "psum bf16[33]": psum((33,), "bfloat16"),
        "psum bf16[4097]": psum((4097,), "bfloat16"),
        "psum f16[7, 3]": psum((7, 3), "float16"),
        "psum f16[2048]": psum((2048,), "float16"),
        "all_gather f32[64] tiled": gather((64,), "float32", 0, True),
        "all_gather bf16[3, 5] axis 1": gather((3, 5), "bfloat16", 1, False),
        "all_gather int8[1001] tiled": gather((1001,), "int8", 0, True),
        "psum_scatter f32 tiled": scatter((world * 256,), "float32", 0, True),
        "psum_scatter bf16 dimension 1": scatter((5, world, 33), "bfloat16", 1, False),
        "psum_scatter f16 tiled": scatter((world * 8, 4), "float16", 0, True),
        "moe_combine_psum_scatter": "moe",
        "mixed": mixed(),
    }


# --- the worker ----------------------------------------------------------------------


def _signed_zeros(parts):
    """Sets the first elements of every rank's part: element 0 -0.0
    everywhere (the sum is -0.0), element 1 -0.0 on rank 0 only (+0.0)."""
    for r, p in enumerate(parts):
        flat = p.reshape(-1)
        flat[:ZEROS] = 0
        flat[0] = -0.0
        if r == 0 and flat.size > 1:
            flat[1] = -0.0
    return parts


def _suite_soak(calls):
    import bulk_cases as prefill

    w = prefill._Worker()
    jax_arx, P = w.jax_arx, w.P
    programs = _programs(w.world, jax_arx)
    dts = prefill._dtypes()
    compiled = {}
    order = np.random.default_rng(2026)  # the same draw on every rank
    names = list(programs)
    by_program: dict[str, int] = {}
    T, R, H, topk = 3 * w.world + 1, 9, 128, 4
    for call in range(calls):
        name = names[order.integers(len(names))]
        by_program[name] = by_program.get(name, 0) + 1
        rng = np.random.default_rng([7, call])  # every rank makes every rank's inputs
        if programs[name] == "moe":
            ys, _, poss, ws, shareds = prefill._moe_inputs(rng, w, T, R, H, topk, e4m3=False)
            args = [w.put(ys), w.put(poss), w.put(ws), w.put(shareds)]
            if name not in compiled:
                compiled[name] = w.smap(
                    prefill._lift(lambda y, p, wt, s: jax_arx.moe_combine_psum_scatter(y, p, wt, s, "sp")),
                    (P("sp"),) * 4,
                    P("sp"),
                )
            tpad = -(-T // w.world) * w.world
            combined = [
                prefill.reference_combine(ys[r], poss[r], ws[r], shareds[r], None, tpad) for r in range(w.world)
            ]
            wants = lambda r, combined=combined: [prefill.reference_scatter(combined, 0, True, r)]  # noqa: E731
            outs = (compiled[name](*args),)
        else:
            inputs, body, refs = programs[name]
            parts = []
            for shape, dt in inputs:
                p = [prefill.random_array(rng, shape, dts[dt]) for _ in range(w.world)]
                parts.append(_signed_zeros(p) if dt in ("float32", "bfloat16", "float16") else p)
            if name not in compiled:
                compiled[name] = w.smap(prefill._lift(body), (P("sp"),) * len(inputs), (P("sp"),) * len(refs(parts, 0)))
            outs = compiled[name](*[w.put(p) for p in parts])
            wants = lambda r, parts=parts, refs=refs: refs(parts, r)  # noqa: E731
        for k, out in enumerate(outs):
            for r, got in w.mine(out).items():
                w.check("soak", got, wants(r)[k], f"call {call} {name} output {k} rank {r}")
    return {"cases": w.cases, "calls": calls, "by_program": by_program}


if __name__ == "__main__" and "--worker" in sys.argv:
    suite, _, n = sys.argv[sys.argv.index("--worker") + 1].partition(":")
    print(launched.RESULT + json.dumps({"soak": _suite_soak}[suite](int(n))), flush=True)
