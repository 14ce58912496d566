"""Tensor-parallel transformer decode step, all-reduced through jax_arx.

Run it over N local processes (CPU by default):

    python -m jax_arx.launch -n 2 examples/tp_decode.py
    python -m jax_arx.launch -n 2 examples/tp_decode.py --unfused   # to compare

A small decoder (attention with a KV cache and an MLP per layer) is sharded
Megatron-style over the mesh axis "tp": column-parallel QKV and up projections,
row-parallel attention-output and down projections, each followed by an
all-reduce of the [tokens, hidden] partial, the residual add and the RMSNorm
of the next block's input: one jax_arx.psum_add_norm each (``--unfused``:
jax_arx.psum, then the add and the norm in jax). The program

1. runs one decode step with jax_arx and checks every all-reduce bit for
   bit against the fp32 rank-order reference, computed here with numpy from
   every rank's partial (gathered separately), plus the residual (rounded
   once) where the call is fused;
2. runs the same step with jax.lax.psum and compares the logits;
3. times jax_arx.psum and jax.lax.psum per call at 8 KB to 512 KB, the same
   way for both in this run (K dependent calls in one jitted program, minus
   the same program without the collective; median of several runs), and
   times the whole decode step with each.

Exit status 0 means every check passed. Options: --layers, --hidden, --tokens,
--calls (K), --repeats, --sizes-kb, --unfused, --json.
"""

import argparse
import json
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
    count,
    describe_run,
    per_call_us,
    rank_order_sum,
    synced_median_seconds,
    timing_default,
)

AXIS = "tp"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4, help="decode batch: tokens per step")
    p.add_argument("--context", type=int, default=64, help="KV cache length")
    p.add_argument(
        "--calls", type=int, help="dependent collectives per timed program (default 200; the CPU backend: 50)"
    )
    p.add_argument("--repeats", type=int, help="timed runs per figure, the median kept (default 7; the CPU backend: 3)")
    p.add_argument("--sizes-kb", default="8,64,256,512")
    p.add_argument("--json", help="write the measurements to this file (rank 0)")
    p.add_argument(
        "--unfused",
        action="store_true",
        help="jax_arx.psum, then the residual add and the norm in jax, instead of jax_arx.psum_add_norm",
    )
    return p.parse_args()


# ---- the model ---------------------------------------------------------------


def init_params(key, layers, hidden, ffn, heads):
    """Full (unsharded) weights in bf16; shard_map splits them over tp."""

    def w(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)

    params = []
    for layer in range(layers):
        k = jax.random.fold_in(key, layer)
        kq, ko, ku, kd = jax.random.split(k, 4)
        params.append(
            dict(
                qkv=w(kq, (hidden, 3, hidden), hidden),  # column-parallel over the last dim (heads)
                out=w(ko, (hidden, hidden), hidden),  # row-parallel over the first dim
                up=w(ku, (hidden, ffn), hidden),  # column-parallel
                down=w(kd, (ffn, hidden), ffn),  # row-parallel
            )
        )
    return params


def param_specs(layers):
    return [
        dict(qkv=P(None, None, AXIS), out=P(AXIS, None), up=P(None, AXIS), down=P(AXIS, None)) for _ in range(layers)
    ]


def rms_norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def decode_step(params, x, kv, psum, heads_local, record, fused):
    """One decode step on one tp shard. x: [tokens, hidden] (replicated), kv:
    [layers, 2, context, hidden / tp] (this shard's heads). ``fused``: each
    all-reduce, its residual add and the norm after it are one
    jax_arx.psum_add_norm (``psum`` is then unused). Returns the new x and,
    when record is set, each all-reduce's partial, result (the sum, or the
    sum + residual where fused) and residual."""
    partials, reduced, residuals = [], [], []
    ones = jnp.ones((x.shape[-1],), x.dtype)  # rms_norm has no weight

    def add_norm(partial, residual):
        """(residual + the sum of partial, its rms_norm)."""
        if fused:
            h, out = jax_arx.psum_add_norm(partial, residual, ones, AXIS, eps=1e-6)
        else:
            summed = psum(partial, AXIS)
            out = residual + summed
            h = rms_norm(out)
        if record:
            partials.append(partial)
            reduced.append(out if fused else summed)
            residuals.append(residual)
        return out, h

    h = rms_norm(x)
    for layer, p in enumerate(params):
        qkv = jnp.einsum("th,hcd->tcd", h, p["qkv"], preferred_element_type=jnp.float32).astype(x.dtype)
        q, k_new, v_new = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        t, d = q.shape
        hd = d // heads_local
        k = jnp.concatenate([kv[layer, 0], k_new], axis=0).reshape(-1, heads_local, hd)
        v = jnp.concatenate([kv[layer, 1], v_new], axis=0).reshape(-1, heads_local, hd)
        qh = q.reshape(t, heads_local, hd)
        s = jnp.einsum("thd,shd->hts", qh, k, preferred_element_type=jnp.float32) / np.sqrt(hd)
        a = (
            jnp.einsum(
                "hts,shd->thd", jax.nn.softmax(s, axis=-1).astype(x.dtype), v, preferred_element_type=jnp.float32
            )
            .astype(x.dtype)
            .reshape(t, d)
        )
        attn = jnp.dot(a, p["out"], preferred_element_type=jnp.float32).astype(x.dtype)
        x, h = add_norm(attn, x)
        up = jax.nn.gelu(jnp.dot(h, p["up"], preferred_element_type=jnp.float32)).astype(x.dtype)
        down = jnp.dot(up, p["down"], preferred_element_type=jnp.float32).astype(x.dtype)
        x, h = add_norm(down, x)  # h: the next layer's input (after the last layer, unused)
    return x, partials, reduced, residuals


def make_step(mesh, layers, heads, psum, record, fused=False):
    tp = mesh.shape[AXIS]

    def shard_fn(params, x, kv):
        y, partials, reduced, residuals = decode_step(params, x, kv, psum, heads // tp, record, fused)
        # Partials vary over tp: stack them with a leading axis the out_spec splits.
        return y, [pp[None] for pp in partials], reduced, residuals

    n = 2 * layers if record else 0
    out_specs = (P(), [P(AXIS)] * n, [P()] * n, [P()] * n)
    f = jax.shard_map(
        shard_fn, mesh=mesh, in_specs=(param_specs(layers), P(), P(None, None, None, AXIS)), out_specs=out_specs
    )
    return jax.jit(f)


# ---- the reference -------------------------------------------------------------


def check_allreduces(partials, reduced, residuals, fused):
    """Every all-reduce result, on every local device of every process, equals
    the reference bit for bit (``fused``: the sum plus the residual, each
    rounded once). Returns how many all-reduces were checked."""
    for i, (part, out, res) in enumerate(zip(partials, reduced, residuals, strict=True)):
        every = np.asarray(multihost_utils.process_allgather(part, tiled=True))  # [ranks, tokens, hidden]
        ref = rank_order_sum(every)
        if fused:
            ref = (ref.astype(np.float32) + np.asarray(res.addressable_data(0)).astype(np.float32)).astype(ref.dtype)
        ref = ref.view(np.uint16)
        for shard in out.addressable_shards:
            got = np.asarray(shard.data).view(np.uint16)
            if got.tobytes() != ref.tobytes():
                raise SystemExit(
                    f"all-reduce {i} on {shard.device}: differs from the fp32 rank-order reference in "
                    f"{int(np.sum(got != ref))} of {ref.size} elements"
                )
    return len(reduced)


# ---- timing ------------------------------------------------------------------


def chain_program(mesh, psum, calls):
    """K dependent collectives (or, with psum=None, the same program without
    them) in one jitted program: the difference is the collectives' cost."""
    world = mesh.shape[AXIS]

    def body(i, x):
        y = psum(x, AXIS) if psum is not None else x * world
        return (y * (1.0 / world)).astype(x.dtype) + x[0, 0] * 0

    def shard_fn(x):
        return jax.lax.fori_loop(0, calls, body, x)

    return jax.jit(jax.shard_map(shard_fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def main():
    args = parse_args()
    args.calls, args.repeats = timing_default(args.calls, 200, 50), timing_default(args.repeats, 7, 3)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    tp = mesh.shape[AXIS]
    rank0 = jax.process_index() == 0
    if args.heads % tp or args.ffn % tp or args.hidden % args.heads:
        raise SystemExit(f"--heads ({args.heads}) and --ffn ({args.ffn}) must divide by tp={tp}")
    jax_arx.initialize(mesh)
    if rank0:
        print(f"tp_decode: {describe_run(jax, jax_arx, AXIS)}; checking a decode step, then timing", flush=True)

    key = jax.random.key(0)
    params = init_params(key, args.layers, args.hidden, args.ffn, args.heads)
    x = (jax.random.normal(jax.random.fold_in(key, 99), (args.tokens, args.hidden)) * 0.5).astype(jnp.bfloat16)
    kv = (jax.random.normal(jax.random.fold_in(key, 7), (args.layers, 2, args.context, args.hidden)) * 0.5).astype(
        jnp.bfloat16
    )
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params = jax.device_put(params, [{k: shard(v) for k, v in d.items()} for d in param_specs(args.layers)])
    x = jax.device_put(x, shard(P()))
    kv = jax.device_put(kv, shard(P(None, None, None, AXIS)))

    # 1. Every all-reduce of a decode step, bit for bit.
    fused = not args.unfused
    how = "jax_arx.psum_add_norm" if fused else "jax_arx.psum + add + norm"
    step_checked = make_step(mesh, args.layers, args.heads, jax_arx.psum, record=True, fused=fused)
    y_arx, partials, reduced, residuals = step_checked(params, x, kv)
    n_checked = check_allreduces(partials, reduced, residuals, fused)
    jax_arx.check()

    # 2. The same step through jax.lax.psum: NCCL/gloo may sum in another order,
    # so compare within bf16 rounding.
    y_lax = make_step(mesh, args.layers, args.heads, jax.lax.psum, record=False)(params, x, kv)[0]
    a = np.asarray(jax.device_get(y_arx), np.float32)
    b = np.asarray(jax.device_get(y_lax), np.float32)
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    if not rel < 2e-2:
        raise SystemExit(f"decode step through {how} differs from jax.lax.psum: relative error {rel:.3g}")
    if rank0:
        print(
            f"checked {count(n_checked, 'all-reduce')} ({how}) of a {args.layers}-layer decode step bit for bit "
            f"against the fp32 rank-order reference on every rank; logits vs jax.lax.psum: relative difference "
            f"{rel:.2e}"
        )

    # 3. Timing: per-call latency by size, then the whole decode step.
    rows = []
    chain = lambda psum: chain_program(mesh, psum, args.calls)  # noqa: E731
    sizes = [int(s) for s in args.sizes_kb.split(",")]
    for i, kb in enumerate(sizes):
        if rank0:
            print(
                f"timing the all-reduce at {kb} KB ({i + 1} of {len(sizes)}), jax_arx.psum then jax.lax.psum",
                flush=True,
            )
        n = kb * 1024 // 2
        cols = 1024 if n % 1024 == 0 else n
        xs = jax.device_put(jnp.ones((tp * (n // cols), cols), jnp.bfloat16), shard(P(AXIS)))
        us_arx = per_call_us(chain, jax_arx.psum, xs, args.calls, args.repeats)
        us_lax = per_call_us(chain, jax.lax.psum, xs, args.calls, args.repeats)
        rows.append(dict(kb=kb, jax_arx_us=us_arx, lax_us=us_lax))
    if rank0:
        print("timing the decode step", flush=True)
    step_arx = synced_median_seconds(
        make_step(mesh, args.layers, args.heads, jax_arx.psum, record=False, fused=fused),
        params,
        x,
        kv,
        repeats=args.repeats,
    )
    step_lax = synced_median_seconds(
        make_step(mesh, args.layers, args.heads, jax.lax.psum, record=False), params, x, kv, repeats=args.repeats
    )
    jax_arx.check()
    if rank0:
        backend = jax.default_backend()
        print(
            f"\nper-call all-reduce latency, bf16, {tp} ranks ({jax.process_count()} processes, {backend}), "
            f"median of {args.repeats} runs of {args.calls} dependent calls minus the same program without them:"
        )
        print(f"{'size':>8} {'jax_arx.psum':>14} {'jax.lax.psum':>14} {'ratio':>7}")
        for r in rows:
            ratio = r["jax_arx_us"] / r["lax_us"] if r["lax_us"] > 0 else float("nan")
            print(f"{str(r['kb']) + ' KB':>8} {r['jax_arx_us']:>11.1f} us {r['lax_us']:>11.1f} us {ratio:>7.3f}")
        print(RATIO_NOTE)
        print(
            f"\ndecode step ({count(args.layers, 'layer')}, {count(2 * args.layers, 'all-reduce')} of "
            f"{args.tokens * args.hidden * 2 // 1024} KB): jax_arx ({how}) {step_arx * 1e6:.0f} us, "
            f"jax.lax {step_lax * 1e6:.0f} us"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    dict(
                        rows=rows,
                        fused=fused,
                        step_us=dict(jax_arx=step_arx * 1e6, lax=step_lax * 1e6),
                        ranks=tp,
                        processes=jax.process_count(),
                        backend=backend,
                    ),
                    f,
                    indent=1,
                )
    jax_arx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
