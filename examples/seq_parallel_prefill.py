"""Sequence-parallel transformer prefill through jax_arx.all_gather,
jax_arx.psum_scatter and the fused MoE combine.

Run it over N local processes (CPU by default):

    python -m jax_arx.launch -n 2 examples/seq_parallel_prefill.py

A small decoder prefills a prompt whose tokens are split over the mesh axis
"sp" (each rank holds T / n consecutive tokens of the residual stream).
Every block is Megatron's sequence-parallel pattern: all-gather the
normalized tokens along the sequence, run the block tensor-parallel (this
rank's attention heads / MLP columns / experts), and reduce-scatter the
block's partial output back to the sequence shards:

    attention  all_gather -> QKV of local heads, causal attention, out-proj -> psum_scatter
    MLP        all_gather -> up (local columns), GELU, down (local rows)      -> psum_scatter
    MoE        all_gather -> router, local experts on their tokens, shared expert (local columns)
               -> moe_combine_psum_scatter (the combine written straight into the reduce-scatter)

The program

1. runs the prefill with jax_arx and checks every collective of it bit for
   bit against a numpy reference computed from every rank's inputs to it
   (gathered separately): the gathered tokens, the float32 rank-order sum of
   the partials rounded once, and the combined MoE rows summed the same way;
2. runs the same model with jax.lax.all_gather / jax.lax.psum_scatter (and
   the combine followed by jax.lax.psum_scatter) and compares the output;
3. times the prefill with each, and all_gather + psum_scatter per call by
   size (K dependent pairs in one program, minus the same program without
   them; median of several runs).

Exit status 0 means every check passed. Options: --layers, --hidden, --tokens,
--heads, --ffn, --experts, --topk, --calls, --repeats, --sizes-kb.

On a machine with fewer cores than the ranks' compute threads plus proxies
(2 processes on a 2-core box), run with JAX_ARX_IDLE_SPIN_MS=0: the proxy
then naps as soon as it is idle instead of spinning for 200 ms after each
collective, which leaves XLA's compute threads the cores. Measured on a
2-core machine, 2 ranks, defaults: prefill step 112-116 ms with jax_arx
against 124-138 ms with jax.lax; with the default spin, 120-183 ms.
"""

import argparse
import sys

import numpy as np

import jax_arx

jax_arx.distributed_initialize()  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench_common import (  # noqa: E402  (beside this file)
    RATIO_NOTE,
    combine_rows,
    count,
    describe_run,
    per_call_us,
    rank_order_sum,
    synced_median_seconds,
    timing_default,
)
from jax_arx import moe_combine  # noqa: E402  (the plain-jax combine, for the jax.lax model)

AXIS = "sp"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="odd layers have an MLP, even ones a MoE")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="prompt length (split over the ranks)")
    p.add_argument(
        "--calls", type=int, help="dependent collective pairs per timed program (default 16; the CPU backend: 8)"
    )
    p.add_argument("--repeats", type=int, help="timed runs per figure, the median kept (default 5; the CPU backend: 3)")
    p.add_argument("--sizes-kb", default="64,256,1024,4096", help="per-rank slice sizes to time")
    return p.parse_args()


# ---- the model ---------------------------------------------------------------


def init_params(key, a):
    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)

    params = []
    for layer in range(a.layers):
        k = jax.random.split(jax.random.fold_in(key, layer), 8)
        p = dict(qkv=w(k[0], (a.hidden, 3, a.hidden), a.hidden), out=w(k[1], (a.hidden, a.hidden), a.hidden))
        if layer % 2 == 0:
            p.update(up=w(k[2], (a.hidden, a.ffn), a.hidden), down=w(k[3], (a.ffn, a.hidden), a.ffn))
        else:
            p.update(
                router=w(k[4], (a.hidden, a.experts), a.hidden),
                e_up=w(k[5], (a.experts, a.hidden, a.ffn), a.hidden),
                e_down=w(k[6], (a.experts, a.ffn, a.hidden), a.ffn),
                up=w(k[2], (a.hidden, a.ffn), a.hidden),
                down=w(k[3], (a.ffn, a.hidden), a.ffn),
            )
        params.append(p)
    return params


def param_specs(a):
    specs = []
    for layer in range(a.layers):
        s = dict(qkv=P(None, None, AXIS), out=P(AXIS, None), up=P(None, AXIS), down=P(AXIS, None))
        if layer % 2 == 1:
            s.update(router=P(), e_up=P(AXIS), e_down=P(AXIS))  # experts split over the ranks
        specs.append(s)
    return specs


def rms_norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def mm(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


class Collectives:
    """The three collectives a prefill step needs, by implementation
    ("jax_arx" or "lax"). With record, every call's inputs and output are
    kept (as (kind, inputs, output)) for the bit-for-bit check."""

    def __init__(self, kind, world, record=False):
        self.kind, self.world, self.record, self.log = kind, world, record, []

    def _note(self, what, inputs, out):
        if self.record:
            self.log.append((what, inputs, out))
        return out

    def gather(self, x):  # [T / n, H] -> [T, H]
        f = jax_arx.all_gather if self.kind == "jax_arx" else jax.lax.all_gather
        return self._note("gather", (x,), f(x, AXIS, tiled=True))

    def scatter(self, x):  # [T, H] partial -> [T / n, H] sum
        f = jax_arx.psum_scatter if self.kind == "jax_arx" else jax.lax.psum_scatter
        return self._note("scatter", (x,), f(x, AXIS, tiled=True))

    def moe(self, y, pos, w, shared):
        if self.kind == "jax_arx":
            return self._note("moe", (y, pos, w, shared), jax_arx.moe_combine_psum_scatter(y, pos, w, shared, AXIS))
        return self.scatter(moe_combine(y, pos, w, shared))


def block_moe(p, h, a, world):
    """This rank's experts on the tokens routed to them, for all T tokens of
    h [T, H]: the rows y, where each (token, k) finds its row (pos), and the
    routing weights w (zero for experts on other ranks)."""
    T = h.shape[0]
    e_local = a.experts // world
    first = jax.lax.axis_index(AXIS) * e_local
    logits = jnp.dot(h, p["router"], preferred_element_type=jnp.float32)
    top_w, top_e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), a.topk)  # [T, topk]
    # Normalized, and kept in bfloat16 precision as many MoE implementations
    # keep them: each weight times a bfloat16 row is then exact in float32, so
    # the numpy check below needs no fused multiply-add.
    top_w = (top_w / top_w.sum(axis=-1, keepdims=True)).astype(jnp.bfloat16)
    # Dense for clarity: every local expert on every token, [e_local * T, H],
    # then one row of zeros that pairs with experts elsewhere.
    up = jax.nn.gelu(jnp.einsum("th,ehf->etf", h, p["e_up"], preferred_element_type=jnp.float32)).astype(h.dtype)
    y = jnp.einsum("etf,efh->eth", up, p["e_down"], preferred_element_type=jnp.float32).astype(h.dtype)
    y = jnp.concatenate([y.reshape(e_local * T, -1), jnp.zeros((1, h.shape[1]), h.dtype)])
    local = (top_e >= first) & (top_e < first + e_local)
    pos = jnp.where(local, (top_e - first) * T + jnp.arange(T)[:, None], e_local * T).astype(jnp.int32)
    w = jnp.where(local, top_w, 0.0).astype(jnp.float32)
    return y, pos, w


def prefill(params, x, a, coll):
    """x: [T / n, H], this rank's tokens of the residual stream."""
    world = coll.world
    heads = a.heads // world
    for layer, p in enumerate(params):
        h = coll.gather(rms_norm(x))  # [T, H]
        T = h.shape[0]
        qkv = jnp.einsum("th,hcd->tcd", h, p["qkv"], preferred_element_type=jnp.float32).astype(h.dtype)
        q, k, v = (qkv[:, i].reshape(T, heads, -1) for i in range(3))
        s = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30)
        o = (
            jnp.einsum(
                "hts,shd->thd", jax.nn.softmax(s, axis=-1).astype(h.dtype), v, preferred_element_type=jnp.float32
            )
            .astype(h.dtype)
            .reshape(T, -1)
        )
        x = x + coll.scatter(mm(o, p["out"]))
        h = coll.gather(rms_norm(x))
        shared = mm(jax.nn.gelu(mm(h, p["up"])), p["down"])  # MLP, or the MoE's shared expert: a partial
        if layer % 2 == 0:
            x = x + coll.scatter(shared)
        else:
            y, pos, w = block_moe(p, h, a, world)
            x = x + coll.moe(y, pos, w, shared)
    return x


def make_prefill(mesh, a, kind, record=False):
    """The jitted prefill; with record it also returns every collective's
    inputs and output, each with a leading rank axis."""
    n_calls = 4 * a.layers
    out_specs = (P(AXIS), [(P(AXIS),) * 5] * n_calls) if record else P(AXIS)

    def body(params, x):
        coll = Collectives(kind, mesh.shape[AXIS], record)
        y = prefill(params, x, a, coll)
        if not record:
            return y
        # Stacked over the ranks by the out_spec: [n, ...] once gathered.
        log = [
            tuple(v[None] for v in (*inputs, out)) + (jnp.zeros((1,), jnp.int8),) * (4 - len(inputs))
            for _, inputs, out in coll.log
        ]
        return y, log

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(param_specs(a), P(AXIS)), out_specs=out_specs))


# ---- the reference -------------------------------------------------------------


def check_collectives(kinds, log):
    """Every recorded collective, on every rank, against numpy. Returns how
    many were checked."""
    every = lambda v: np.asarray(multihost_utils.process_allgather(v, tiled=True))  # noqa: E731  [n, ...]
    for i, (kind, entry) in enumerate(zip(kinds, log, strict=False)):
        arrays = [every(v) for v in entry]
        n = arrays[0].shape[0]
        out = arrays[4] if kind == "moe" else arrays[1]  # after the inputs; the rest is padding
        if kind == "gather":
            want = np.stack([np.concatenate(list(arrays[0]))] * n)
        elif kind == "scatter":
            want = np.stack(np.split(rank_order_sum(arrays[0]), n))
        else:
            rows = np.stack([combine_rows(*(a[r] for a in arrays[:4])) for r in range(n)])
            want = np.stack(np.split(rank_order_sum(rows), n))
        if out.tobytes() != want.tobytes():
            raise SystemExit(
                f"collective {i} ({kind}): differs from the numpy reference in "
                f"{int(np.sum(out.view(np.uint16) != want.view(np.uint16)))} of {want.size} elements"
            )
    return len(log)


# ---- timing ------------------------------------------------------------------


def pair_program(mesh, kind, calls):
    """K dependent all_gather + psum_scatter pairs (or, kind None, the same
    program without them)."""
    world = mesh.shape[AXIS]
    gather = {"jax_arx": jax_arx.all_gather, "lax": jax.lax.all_gather}.get(kind)
    scatter = {"jax_arx": jax_arx.psum_scatter, "lax": jax.lax.psum_scatter}.get(kind)

    def body(i, x):
        if gather is None:
            y = jnp.concatenate([x] * world) * world
            y = y[: x.shape[0]]
        else:
            y = scatter(gather(x, AXIS, tiled=True), AXIS, tiled=True)
        return (y * (1.0 / world)).astype(x.dtype)

    return jax.jit(
        jax.shard_map(lambda x: jax.lax.fori_loop(0, calls, body, x), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    )


def main():
    a = parse_args()
    a.calls, a.repeats = timing_default(a.calls, 16, 8), timing_default(a.repeats, 5, 3)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    n = mesh.shape[AXIS]
    rank0 = jax.process_index() == 0
    if a.heads % n or a.ffn % n or a.experts % n or a.tokens % n:
        raise SystemExit(f"--heads, --ffn, --experts and --tokens must divide by the {n} ranks")
    # The fused MoE combine even where the plan would step aside for its
    # unfused pair (slower today: docs/performance.md), so that the checks
    # below cover the fused kernel; a program of your own leaves it to the
    # plan (jax_arx.initialize(mesh)), with the same bits either way.
    jax_arx.initialize(mesh, _tuning={"moe_fused": 1})
    if rank0:
        print(
            f"seq_parallel_prefill: {describe_run(jax, jax_arx, AXIS)}; checking a prefill step, then timing",
            flush=True,
        )
    key = jax.random.key(0)
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params = jax.device_put(init_params(key, a), [{k: shard(v) for k, v in d.items()} for d in param_specs(a)])
    x = jax.device_put(
        (jax.random.normal(jax.random.fold_in(key, 99), (a.tokens, a.hidden))).astype(jnp.bfloat16), shard(P(AXIS))
    )

    # 1. Every collective of the jax_arx prefill, bit for bit.
    y_arx, log = make_prefill(mesh, a, "jax_arx", record=True)(params, x)
    jax_arx.check()
    kinds = [
        k for layer in range(a.layers) for k in ("gather", "scatter", "gather", "scatter" if layer % 2 == 0 else "moe")
    ]
    checked = check_collectives(kinds, log)
    hlo = make_prefill(mesh, a, "jax_arx").lower(params, x).as_text()
    counts = {
        t: hlo.count(f"custom_call @jax_arx_{t}(") for t in ("all_gather", "psum_scatter", "moe_combine_psum_scatter")
    }

    # 2. Against jax.lax's collectives.
    y_lax = make_prefill(mesh, a, "lax")(params, x)
    ga = np.asarray(multihost_utils.process_allgather(y_arx, tiled=True), np.float32)
    gb = np.asarray(multihost_utils.process_allgather(y_lax, tiled=True), np.float32)
    rel = float(np.linalg.norm(ga - gb) / max(np.linalg.norm(gb), 1e-30))
    if not rel < 2e-2:
        raise SystemExit(f"prefill through jax_arx differs from jax.lax: relative error {rel:.3g}")
    if rank0:
        print(
            f"{a.layers}-layer prefill of {a.tokens} tokens over {n} ranks "
            f"({count(counts['all_gather'], 'all_gather')}, {count(counts['psum_scatter'], 'psum_scatter')}, "
            f"{count(counts['moe_combine_psum_scatter'], 'fused MoE combine')} per "
            f"step): all {checked} bit for bit equal to the numpy reference on every rank; output vs the "
            f"same model on jax.lax collectives: relative difference {rel:.2e}"
        )

    # 3. Timing.
    rows = []
    pairs = lambda kind: pair_program(mesh, kind, a.calls)  # noqa: E731
    sizes = [int(s) for s in a.sizes_kb.split(",")]
    for i, kb in enumerate(sizes):
        if rank0:
            print(
                f"timing all_gather + psum_scatter at {kb} KB ({i + 1} of {len(sizes)}), jax_arx then jax.lax",
                flush=True,
            )
        elems = kb * 1024 // 2
        cols = 512 if elems % 512 == 0 else elems
        xs = jax.device_put(jnp.ones((n * (elems // cols), cols), jnp.bfloat16), shard(P(AXIS)))
        rows.append(
            (
                kb,
                per_call_us(pairs, "jax_arx", xs, a.calls, a.repeats),
                per_call_us(pairs, "lax", xs, a.calls, a.repeats),
            )
        )
    if rank0:
        print("timing the prefill step", flush=True)
    t_arx = synced_median_seconds(make_prefill(mesh, a, "jax_arx"), params, x, repeats=a.repeats)
    t_lax = synced_median_seconds(make_prefill(mesh, a, "lax"), params, x, repeats=a.repeats)
    jax_arx.check()
    if rank0:
        print(
            f"\nall_gather + psum_scatter per pair, bf16, {n} ranks ({jax.process_count()} processes, "
            f"{jax.default_backend()}), median of {a.repeats} runs of {a.calls} dependent pairs minus the same "
            "program without them:"
        )
        print(f"{'slice':>9} {'jax_arx':>12} {'jax.lax':>12} {'ratio':>7}")
        for kb, us_arx, us_lax in rows:
            ratio = us_arx / us_lax if us_lax > 0 else float("nan")
            print(f"{str(kb) + ' KB':>9} {us_arx:>9.0f} us {us_lax:>9.0f} us {ratio:>7.3f}")
        print(RATIO_NOTE)
        print(f"\nprefill step: jax_arx {t_arx * 1e3:.1f} ms, jax.lax {t_lax * 1e3:.1f} ms")
    jax_arx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
