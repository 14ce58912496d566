"""Per-call latency of jax_arx.psum_add_norm against the unfused decode step
it replaces (jax_arx.psum, then the residual add and the norm in jax), by
rows of hidden size 4096 bf16 (8 KB to 512 KB per call), on each route.
Run it under the launcher, one process per rank:

    python -m jax_arx.launch -n 2 examples/bench_norm.py --out bench_out
    # the CPU backend, small sizes (a win is not required there)
    JAX_PLATFORMS=cpu python -m jax_arx.launch -n 2 examples/bench_norm.py --rows 1,8 --routes shm

Every result is checked first: the fused hidden equals the unfused one bit
for bit, and normed is within 2 units in the last place of bf16 of it
(the two compute the norm's sums in different orders). Method
(bench_common.median_seconds): K dependent calls inside one jitted program
(the next call's partial is this one's normed), the median of --samples
samples of --reps runs, divided by K. On one GPU, start CUDA MPS first
(the ranks' kernels then run at once); the routes that need no NVLink are
timed as they run.

Routes (--routes): ``gpu`` (GPU inboxes), ``host`` (inboxes in pinned host
memory: JAX_ARX_CUDA_PEER_MEMORY=0), ``proxy`` (JAX_ARX_CUDA_DIRECT=0: the
verbs route's steps over shm), ``shm`` (the CPU backend's). Prints a table
on rank 0 and writes ``bench_norm.json`` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROUTES = {"gpu": {}, "host": {"JAX_ARX_CUDA_PEER_MEMORY": "0"}, "proxy": {"JAX_ARX_CUDA_DIRECT": "0"}, "shm": {}}
HIDDEN = 4096


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64", help="rows per call, comma-separated")
    ap.add_argument("--routes", default=None, help="comma-separated: gpu,host,proxy (GPU), shm (CPU)")
    ap.add_argument("--kind", default="rms", choices=("rms", "layer"))
    ap.add_argument("--k", type=int, default=16, help="dependent calls per program")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for bench_norm.json")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_arx
    from bench_common import median_seconds

    jax_arx.distributed_initialize()
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    P = jax.P
    platform = jax.devices()[0].platform
    routes = (args.routes or ("shm" if platform == "cpu" else "gpu,host,proxy")).split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    rank0 = jax.process_index() == 0
    results = []
    for route in routes:
        for key in set().union(*[set(e) for e in ROUTES.values()]):
            os.environ.pop(key, None)
        os.environ.update(ROUTES[route])
        jax_arx.initialize(mesh)
        for rows in rows_list:
            rng = np.random.default_rng(rows)
            x = jax.device_put(rng.standard_normal((jax.device_count(), rows, HIDDEN)).astype(jnp.bfloat16),
                               jax.NamedSharding(mesh, P("tp")))
            res = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.bfloat16)
            w = jnp.asarray(1 + 0.1 * rng.standard_normal(HIDDEN), jnp.bfloat16)

            def fused(p, r, w):
                return jax_arx.psum_add_norm(p, r, w, "tp", kind=args.kind)

            def unfused(p, r, w):
                h = jax_arx.psum(p, "tp") + r
                f = h.astype(jnp.float32)
                if args.kind == "layer":
                    f = f - jnp.mean(f, -1, keepdims=True)
                y = f * jax.lax.rsqrt(jnp.mean(f * f, -1, keepdims=True) + 1e-6) * w.astype(jnp.float32)
                return y.astype(h.dtype), h

            def program(step, k):
                @jax.jit
                @jax.shard_map(mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P("tp")))
                def f(x, r, w):
                    p, h = x[0], r
                    for _ in range(k):
                        n, h = step(p, h, w)
                        p = n * jnp.bfloat16(0.5)  # the next layer's partial
                    return n[None], h[None]
                return f

            one_f, one_u = program(fused, 1)(x, res, w), program(unfused, 1)(x, res, w)
            hf, hu = np.asarray(one_f[1].addressable_data(0)), np.asarray(one_u[1].addressable_data(0))
            nf = np.asarray(one_f[0].addressable_data(0)).astype(np.float32)
            nu = np.asarray(one_u[0].addressable_data(0)).astype(np.float32)
            ulp = np.spacing(np.abs(nu).astype(jnp.bfloat16)).astype(np.float32)
            ok = hf.tobytes() == hu.tobytes() and bool(np.all(np.abs(nf - nu) <= 2 * ulp + 1e-30))
            t = {}
            for name, step in (("fused", fused), ("unfused", unfused)):
                f = program(step, args.k)
                t[name] = median_seconds(lambda a: f(*a)[0], (x, res, w), args.samples, args.reps) * 1e6 / args.k
            cell = dict(route=route, rows=rows, bytes=rows * HIDDEN * 2, kind=args.kind, ok=ok,
                        fused_us=round(t["fused"], 2), unfused_us=round(t["unfused"], 2),
                        ratio=round(t["fused"] / t["unfused"], 3))
            results.append(cell)
            if rank0:
                print(json.dumps(cell), flush=True)
        jax_arx.shutdown()
    if rank0:
        print(f"{'route':6} {'rows':>5} {'KB':>5} {'fused us':>9} {'unfused us':>11} {'ratio':>6}  checked")
        for c in results:
            print(f"{c['route']:6} {c['rows']:5d} {c['bytes'] // 1024:5d} {c['fused_us']:9.1f} "
                  f"{c['unfused_us']:11.1f} {c['ratio']:6.2f}  {'ok' if c['ok'] else 'MISMATCH'}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_norm.json"), "w") as fh:
                json.dump(dict(platform=platform, world=jax.device_count(), k=args.k, samples=args.samples,
                               reps=args.reps, results=results), fh, indent=1)
    return 0 if all(c["ok"] for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())
