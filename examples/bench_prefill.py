"""Per-call latency of jax_arx.all_gather and jax_arx.psum_scatter against
jax.lax's (NCCL): two processes with one GPU each, bf16, a per-rank slice of
1, 4, 16 and 64 MB (all_gather: its input; psum_scatter: its output, so its
input is twice that at 2 ranks).

    python examples/bench_prefill.py --out bench_out
    python examples/bench_prefill.py --quick --out bench_out       # 1 and 16 MB, fewer samples
    python examples/bench_prefill.py --sizes 4MB,64MB --configs arx-shm,nccl-p2p-off
    python examples/bench_prefill.py --cpu --out /tmp/bench_cpu     # a smoke run on the CPU backend, tiny sizes

The method of examples/bench_psum.py (examples/bench_common.py), every
series measured in the same run: K dependent calls inside one jitted
program, minus the same program without the collective, divided by K; each
sample runs the program a few times back to back and the median of the
samples is kept. Each step feeds the collective's output back as the next
step's input through one elementwise pass the baseline has too:

  all_gather    y [n] -> gathered [2n] -> y = gathered[n/2 : n/2 + n] * 0.5
                (a window across both ranks' pieces); baseline y = y * 0.5
  psum_scatter  y [2n] -> s [n] -> y[:n] = s * 0.5 (in place);
                baseline y[:n] = y[:n] * 0.5

with an optimization barrier after each step, so no two steps fuse.

Series (one two-process job each, since NCCL reads its environment once):

  arx-shm        jax_arx over the shm carrier (on GPUs the kernels write the
                 peer's buffers themselves)
  arx-tcp        jax_arx over the tcp carrier (through the proxy's work ring)
  nccl           jax.lax, NCCL as it comes (NVLink between the GPUs)
  nccl-p2p-off   jax.lax with NCCL_P2P_DISABLE=1 (through host memory, as
                 jax_arx goes on one host)

The jax_arx series run with JAX_ARX_PREFILL_SLOT_BYTES = 2 x the largest
slice + 32 MiB (160 MiB for 64 MB: the gathered output and the scattered
input are 2 x the slice) and JAX_ARX_FALLBACK=error, so a size jax_arx
would leave to jax.lax fails the series instead of timing jax.lax under
jax_arx's name. Each checks, once per op and size, that its result is the
numpy reference bit for bit (the gathered pieces; the fp32 rank-order sum
rounded once): the "exact" field of the JSON. Over shm each rank's pinned
buffers (4 x the prefill slot) live in /dev/shm: about 1.3 GB for two ranks
at 64 MB.

Writes bench_prefill.json and bench_prefill.png (matplotlib; skipped with a
message if it is missing) into --out, and prints a table of per-call
latencies and one of the ratio jax_arx shm / NCCL with P2P disabled
(target: at most 1.25 at 16 and 64 MB for both ops). NCCL's NVLink
multicast stays as the environment has it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

from bench_common import median_seconds, run_config, size_label

THIS = os.path.abspath(__file__)
MB = 1 << 20
SIZES = [1 * MB, 4 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [1 * MB, 16 * MB]
CPU_SIZES = [16 << 10, 64 << 10]
OPS = ("all_gather", "psum_scatter")
CONFIGS = {
    "arx-shm": {"JAX_ARX_TRANSPORT": "shm"},
    "arx-tcp": {"JAX_ARX_TRANSPORT": "tcp"},
    "nccl": {},
    "nccl-p2p-off": {"NCCL_P2P_DISABLE": "1"},
}
RATIO = ("arx-shm", "nccl-p2p-off")  # the ratio table: this series over that one
TARGET_RATIO = 1.25
TARGET_SIZES = (16 * MB, 64 * MB)
WORLD = 2


def arx_env(sizes):
    """What the jax_arx series add to the environment: a prefill slot that
    holds the largest gathered output / scattered input, and no fallback."""
    slot_mib = -(-(WORLD * max(sizes)) // MB) + 32
    return {"JAX_ARX_PREFILL_SLOT_BYTES": f"{slot_mib}MiB", "JAX_ARX_FALLBACK": "error"}


# --- the worker: one configuration, every op and size -----------------------

def _pick_gpu():
    """This rank's one GPU: the rank-th of CUDA_VISIBLE_DEVICES (all GPUs
    when unset), before jax starts its backend."""
    rank = int(os.environ["JAX_PROCESS_ID"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(WORLD)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[rank]


def worker(config, sizes, ops, k, samples, reps, out_path, cpu):
    if not cpu:
        _pick_gpu()
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_arx

    jax_arx.distributed_initialize()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:WORLD]), ("x",))
    arx = config.startswith("arx")
    if arx:
        jax_arx.initialize(mesh)
    lib = jax_arx if arx else jax.lax
    collective = {"all_gather": lambda y: lib.all_gather(y, "x", tiled=True),
                  "psum_scatter": lambda y: lib.psum_scatter(y, "x", tiled=True)}
    half = jnp.asarray(0.5, jnp.bfloat16)

    def smap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

    def program(op, n, with_collective):
        """K dependent steps; each step's output has the input's shape."""
        def step(y):
            if op == "all_gather":  # y [n]
                if not with_collective:
                    return y * half
                g = collective[op](y)  # [2n]
                return jax.lax.dynamic_slice_in_dim(g, n // 2, n) * half
            # psum_scatter: y [2n]; the result goes into y's first half, in place
            s = collective[op](y) if with_collective else y[:n]
            return jax.lax.dynamic_update_slice_in_dim(y, s * half, 0, axis=0)

        def body(y):
            for _ in range(k):
                y = jax.lax.optimization_barrier(step(y))
            return y
        return smap(body)

    def sharded(flat):
        return jax.make_array_from_callback(flat.shape, NamedSharding(mesh, P("x")), lambda idx: flat[idx])

    results = {op: {} for op in ops}
    for nbytes in sizes:
        n = nbytes // 2  # bf16 elements of a rank's slice
        for op in ops:
            per_rank = n if op == "all_gather" else WORLD * n
            # Every rank makes the same global array; rank r's input is block r.
            flat = np.random.default_rng(nbytes).standard_normal(WORLD * per_rank, dtype=np.float32)
            flat = flat.astype(ml_dtypes.bfloat16)
            x = sharded(flat)
            row = {}
            if arx:
                # The contract, once per op and size, before timing.
                out = smap(collective[op])(x)
                parts = flat.reshape(WORLD, per_rank)
                row["exact"] = True
                for shard in out.addressable_shards:
                    rank = (shard.index[0].start or 0) // (out.shape[0] // WORLD)
                    if op == "all_gather":
                        want = parts.reshape(-1)
                    else:
                        acc = np.zeros(n, np.float32)
                        for r in range(WORLD):
                            acc += parts[r, rank * n:(rank + 1) * n].astype(np.float32)
                        want = acc.astype(ml_dtypes.bfloat16)
                    row["exact"] &= bool(np.array_equal(np.asarray(shard.data).view(np.uint16),
                                                        want.view(np.uint16)))
                del out
            base = median_seconds(program(op, n, False), x, samples, reps)
            t = median_seconds(program(op, n, True), x, samples, reps)
            row["us"] = max(0.0, (t - base) / k * 1e6)
            row["baseline_program_us"] = base * 1e6
            results[op][str(nbytes)] = row
            if jax.process_index() == 0:
                exact = f", exact {row['exact']}" if "exact" in row else ""
                print(f"{config} {op:<12} {size_label(nbytes):>6}: {row['us']:.1f} us per call{exact}", flush=True)
            del x
    if arx:
        jax_arx.check()
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform,
                           results=results), f)


# --- the driver ----------------------------------------------------------------

def parse_size(text):
    """'64MB', '64M', '64MiB' (all 64 << 20), '16KB', or a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MB, 256KB, 4096)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def latency_table(all_results, sizes, ops):
    head = f"{'op':<14}{'series':<16}" + "".join(f"{size_label(s):>11}" for s in sizes)
    lines = [head, "-" * len(head)]
    for op in ops:
        for config, res in all_results.items():
            cells = []
            for s in sizes:
                row = (res or {}).get("results", {}).get(op, {}).get(str(s))
                mark = "" if row is None or row.get("exact", True) else "!"  # ! : not the reference bits
                cells.append(f"{row['us']:>10.1f}{mark or ' '}" if row else f"{'-':>10} ")
            lines.append(f"{op:<14}{config:<16}" + "".join(cells))
    return "\n".join(lines)


def ratio_table(all_results, sizes, ops):
    """jax_arx shm over NCCL with P2P disabled, per op and size, with the
    target at the sizes it is set for. Returns (text, ratios, met): met is
    None when no size of the target was measured."""
    num, den = (all_results.get(c) or {} for c in RATIO)
    head = f"{'op':<14}" + "".join(f"{size_label(s):>11}" for s in sizes)
    lines = [f"ratio {RATIO[0]} / {RATIO[1]} (target <= {TARGET_RATIO} at "
             f"{', '.join(size_label(s) for s in TARGET_SIZES)})", head, "-" * len(head)]
    ratios, met = {}, True
    targets = [s for s in sizes if s in TARGET_SIZES]
    for op in ops:
        cells = []
        for s in sizes:
            a = num.get("results", {}).get(op, {}).get(str(s))
            b = den.get("results", {}).get(op, {}).get(str(s))
            if not a or not b or b["us"] <= 0:
                cells.append(f"{'-':>11}")
                if s in TARGET_SIZES:
                    met = False
                continue
            r = a["us"] / b["us"]
            ratios.setdefault(op, {})[str(s)] = r
            flag = ""
            if s in TARGET_SIZES:
                flag = " ok" if r <= TARGET_RATIO else " NO"
                met &= r <= TARGET_RATIO
            cells.append(f"{r:>8.2f}{flag:<3}")
        lines.append(f"{op:<14}" + "".join(cells))
    if not targets:
        met = None
        lines.append("target: not measured (no size of it in this run)")
    else:
        lines.append(f"target {'met' if met else 'NOT met'} at {', '.join(size_label(s) for s in targets)}")
    return "\n".join(lines), ratios, met


def plot(all_results, sizes, ops, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for config, res in all_results.items():
            rows = (res or {}).get("results", {}).get(op, {})
            xs = [s for s in sizes if str(s) in rows]
            if not xs:
                continue
            style = "--" if config.startswith("nccl") else "-"
            ax.plot([s / MB for s in xs], [rows[str(s)]["us"] for s in xs], style, marker="o", label=config)
        ax.set_xscale("log", base=2)
        ax.set_xticks([s / MB for s in sizes], [size_label(s) for s in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("slice per rank (bf16)")
        ax.set_ylabel("per-call latency (us)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", help="per-rank slices, e.g. 1MB,4MB,16MB,64MB (the default)")
    ap.add_argument("--quick", action="store_true", help="1 and 16 MB (unless --sizes), K 8, 5 samples of 3")
    ap.add_argument("--cpu", action="store_true",
                    help="a smoke run on the CPU backend (16 and 64 KB unless --sizes; 'nccl' is then gloo)")
    ap.add_argument("--k", type=int, help="dependent calls per program (default 16; --quick 8; --cpu 4)")
    ap.add_argument("--samples", type=int, help="default 7; --quick 5; --cpu 3")
    ap.add_argument("--reps", type=int, help="programs per sample, back to back (default 3; --cpu 2)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per series")
    ap.add_argument("--worker")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sizes = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes
             else CPU_SIZES if args.cpu else QUICK_SIZES if args.quick else SIZES)
    k = args.k or (4 if args.cpu else 8 if args.quick else 16)
    samples = args.samples or (3 if args.cpu else 5 if args.quick else 7)
    reps = args.reps or (2 if args.cpu else 3)
    ops = tuple(o for o in args.ops.split(",") if o)
    if any(o not in OPS for o in ops) or any(s < 16 or s % 16 for s in sizes):
        ap.error(f"--ops takes {', '.join(OPS)}; --sizes multiples of 16 bytes")
    if args.worker:
        worker(args.worker, sizes, ops, k, samples, reps, args.json, args.cpu)
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}")
    os.makedirs(args.out, exist_ok=True)
    extra_arx = arx_env(sizes)
    worker_args = ["--k", str(k), "--samples", str(samples), "--reps", str(reps), "--ops", ",".join(ops),
                   "--sizes", ",".join(map(str, sizes))] + (["--cpu"] if args.cpu else [])
    launcher_args = ["--cpu-devices", "1"] if args.cpu else []
    all_results = {}
    for config in configs:
        env = dict(CONFIGS[config], **(extra_arx if config.startswith("arx") else {}))
        path = os.path.join(args.out, f"bench_prefill_{config}.json")
        all_results[config] = run_config(THIS, config, env, worker_args, path, args.timeout, launcher_args)
    device = next((r["device"] for r in all_results.values() if r), "?")
    latencies = latency_table(all_results, sizes, ops)
    ratios_text, ratios, met = ratio_table(all_results, sizes, ops)
    meta = dict(k=k, samples=samples, reps=reps, sizes=sizes, ops=ops, configs=CONFIGS, arx_env=extra_arx,
                device=device, cpu=args.cpu, quick=args.quick,
                method="K dependent calls in one jitted program minus the same program without the collective, "
                       "/ K; median of samples of back-to-back runs")
    with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
        json.dump(dict(meta=meta, results=all_results, ratio=dict(series=RATIO, target=TARGET_RATIO,
                                                                  target_sizes=TARGET_SIZES, ratios=ratios,
                                                                  met=met)), f, indent=1)
    plot(all_results, sizes, ops, os.path.join(args.out, "bench_prefill.png"),
         f"2 processes x 1 {device}: K = {k} dependent calls in one jit, minus baseline")
    print(f"\nper-call latency, us (bf16, 2 processes x 1 {device}; '!': not the reference bits)\n{latencies}\n\n"
          f"{ratios_text}", flush=True)
    return 0 if all(all_results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
