"""Per-call latency of jax_arx.psum against jax.lax.psum (NCCL): two
processes with one GPU each, bf16, 8 KB to 4 MB.

    python examples/bench_psum.py --out bench_out

Every series is measured the same way, in the same run: K dependent calls
inside one jitted program, minus the same program without the collective,
divided by K; each sample runs the program a few times back to back (so the
ranks' start skew is spread thin) and the median of the samples is kept.
The programs keep a scale by 0.5 and an optimization barrier between calls,
so the baseline has the same kernels minus the collectives.

Series (one two-process job each, since NCCL reads its environment once):

  arx-shm        jax_arx over the shm carrier: jax_arx.psum's own choice, and
                 one-shot and two-shot forced (direct FFI calls); the kernels
                 write the peer's inbox themselves, the one-shot as jax_arx
                 chooses per size (today: up to 128 KiB in 16-byte lines
                 that carry their flags inside the data, the "LL"
                 one-shot; above, chunk by chunk, a flag per chunk, in
                 32 KiB chunks (GPU inboxes) or 16 KiB chunks (host))
  arx-shm-host   the same with the peers' data in pinned host memory
                 (JAX_ARX_CUDA_PEER_MEMORY=0); arx-shm puts each rank's
                 psum inbox in its GPU's memory, mapped into the peers' GPUs
                 (over NVLink here), when every rank can map every peer's
  arx-shm-noll   the same with the LL one-shot off
                 (JAX_ARX_CUDA_LL_MAX_BYTES=0): chunk by chunk at every size
  arx-shm-ll32k  the same with LL up to 32 KiB (ll64k: 64 KiB); with
                 arx-shm-noll and arx-shm, what the built-in limit (LL up
                 to its cap, 128 KiB) was chosen from (run them with
                 --sizes 8192,16384,32768,65536,131072)
  arx-shm-whole  the same with the one-shot in one piece, one flag, the
                 blocks meeting before the flag (JAX_ARX_CUDA_PIPELINE=0)
  arx-shm-pipe8k the same chunk by chunk in 8 KiB chunks
                 (JAX_ARX_CUDA_PIPELINE=1, JAX_ARX_CUDA_CHUNK_BYTES=8KiB)
  arx-shm-pipe4k the same in 4 KiB chunks
  arx-shm-pipe32k the same in 32 KiB chunks (64k: 64 KiB)
  arx-shm-proxy  the same with JAX_ARX_CUDA_DIRECT=0: the kernels publish and
                 the proxy copies, as over tcp or verbs
  arx-tcp        the same over the tcp carrier
  nccl           jax.lax.psum, NCCL as it comes (NVLink between the GPUs)
  nccl-p2p-off   NCCL_P2P_DISABLE=1 (through host memory)
  nccl-socket    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo

Each arx series also checks, once per size, that jax_arx.psum's result is
bit-identical to the fp32 rank-order sum (the "exact" column of the JSON).

Writes bench_psum.json and bench_psum.png (matplotlib) into --out and prints
a table. NCCL's NVLink multicast stays as the environment has it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from bench_common import median_seconds, run_config as launch_config, size_label

THIS = os.path.abspath(__file__)
SIZES = [8 << 10, 64 << 10, 256 << 10, 512 << 10, 2 << 20, 4 << 20]
CONFIGS = {
    "arx-shm": {"JAX_ARX_TRANSPORT": "shm"},
    "arx-shm-host": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PEER_MEMORY": "0"},
    "arx-shm-noll": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_LL_MAX_BYTES": "0"},
    "arx-shm-ll64k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_LL_MAX_BYTES": "64KiB"},
    "arx-shm-ll32k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_LL_MAX_BYTES": "32KiB"},
    "arx-shm-whole": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PIPELINE": "0"},
    "arx-shm-pipe4k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PIPELINE": "1", "JAX_ARX_CUDA_CHUNK_BYTES": "4KiB"},
    "arx-shm-pipe8k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PIPELINE": "1", "JAX_ARX_CUDA_CHUNK_BYTES": "8KiB"},
    "arx-shm-pipe32k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PIPELINE": "1", "JAX_ARX_CUDA_CHUNK_BYTES": "32KiB"},
    "arx-shm-pipe64k": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_PIPELINE": "1", "JAX_ARX_CUDA_CHUNK_BYTES": "64KiB"},
    "arx-shm-proxy": {"JAX_ARX_TRANSPORT": "shm", "JAX_ARX_CUDA_DIRECT": "0"},
    "arx-tcp": {"JAX_ARX_TRANSPORT": "tcp"},
    "nccl": {},
    "nccl-p2p-off": {"NCCL_P2P_DISABLE": "1"},
    "nccl-socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"},
}
# Room for every size in both algorithms: one-shot up to the slot, two-shot
# up to min(send buffer, world * slot).
ARX_ENV = {"JAX_ARX_SLOT_BYTES": "4MiB", "JAX_ARX_SEND_BYTES": "4MiB"}


# --- the worker: one configuration, every size ------------------------------

ARX_COLLECTIVES = ("jax_arx.psum", "one-shot", "two-shot")


def worker(config, sizes, k, samples, reps, out_path, which=ARX_COLLECTIVES):
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["JAX_PROCESS_ID"]
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_arx

    jax_arx.distributed_initialize()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    arx = config.startswith("arx")
    comm = None
    if arx:
        jax_arx.initialize(mesh)
        from jax_arx import _comm
        comm = _comm.communicator("x")
        if jax.process_index() == 0:
            print(f"{config}: psum inboxes in {comm.endpoints[0].endpoint.psum_inboxes} memory", flush=True)

    def direct(x, algorithm):
        call = jax.ffi.ffi_call("jax_arx_psum", jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True)
        return call(x, comm_id=np.int64(comm.comm_id), algorithm=np.int64(algorithm), site=np.int64(0))

    collectives = {"none": lambda y: y}
    if arx:
        arx_calls = {"jax_arx.psum": lambda y: jax_arx.psum(y, "x"), "one-shot": lambda y: direct(y, 1),
                     "two-shot": lambda y: direct(y, 2)}
        collectives.update({name: arx_calls[name] for name in which})
    else:
        collectives["jax.lax.psum"] = lambda y: jax.lax.psum(y, "x")

    def program(coll):
        def body(x):
            y = x
            for _ in range(k):
                y = jax.lax.optimization_barrier(coll(y) * jnp.asarray(0.5, y.dtype))
            return y
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

    def timed(f, x):
        return median_seconds(f, x, samples, reps)

    results = {}
    for nbytes in sizes:
        n = nbytes // 2
        flat = np.random.default_rng(0).standard_normal(2 * n).astype(jnp.bfloat16)
        x = jax.make_array_from_callback(flat.shape, NamedSharding(mesh, P("x")), lambda idx: flat[idx])
        base = timed(program(collectives["none"]), x)
        row = {}
        if arx:
            # The contract, once per size: the fp32 sum in rank order, rounded once.
            import ml_dtypes
            want = (flat[:n].astype(np.float32) + flat[n:].astype(np.float32)).astype(ml_dtypes.bfloat16)
            once = jax.jit(jax.shard_map(lambda y: jax_arx.psum(y, "x"), mesh=mesh, in_specs=P("x"),
                                         out_specs=P("x"), check_vma=False))(x)
            row["exact"] = all(np.array_equal(np.asarray(s.data).view(np.uint16), want.view(np.uint16))
                               for s in once.addressable_shards)
        for name, coll in collectives.items():
            if name == "none":
                continue
            if name == "one-shot" and nbytes > comm.slot_bytes:
                continue
            if name == "two-shot" and nbytes > min(comm.send_bytes, 2 * comm.slot_bytes):
                continue
            t = timed(program(coll), x)
            row[name] = max(0.0, (t - base) / k * 1e6)
        row["baseline_program_us"] = base * 1e6
        results[str(nbytes)] = row
        if jax.process_index() == 0:
            print(f"{config} {nbytes:>8} B: " + ", ".join(f"{a} {b:.1f} us" if not isinstance(b, bool) else f"{a} {b}"
                                                          for a, b in row.items()), flush=True)
    if arx:
        jax_arx.check()
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


# --- the driver ----------------------------------------------------------------

def run_config(config, args, out_dir):
    env = dict(os.environ)
    env.update(CONFIGS[config])
    if config.startswith("arx"):
        env.update(ARX_ENV)
    path = os.path.join(out_dir, f"bench_{config}.json")
    return launch_config(THIS, config, env, ["--k", str(args.k), "--samples", str(args.samples), "--reps",
                                             str(args.reps), "--sizes", ",".join(map(str, args.sizes)),
                                             "--collectives", args.collectives], path, args.timeout)


def table(all_results, sizes):
    series = []
    for config, res in all_results.items():
        if not res:
            continue
        names = [n for n, v in next(iter(res.values())).items()
                 if n != "baseline_program_us" and not isinstance(v, bool)]
        for name in names:
            series.append((config if config.startswith("nccl") else f"{config} {name}", config, name))
    head = f"{'series':<28}" + "".join(f"{size_label(s):>10}" for s in sizes)
    lines = [head, "-" * len(head)]
    for label, config, name in series:
        cells = []
        for s in sizes:
            v = all_results[config].get(str(s), {}).get(name)
            cells.append(f"{v:>10.1f}" if v is not None else f"{'-':>10}")
        lines.append(f"{label:<28}" + "".join(cells))
    return "\n".join(lines), series


def plot(all_results, series, sizes, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.cm.tab20(np.linspace(0, 1, max(len(series), 2)))
    for (label, config, name), color in zip(series, colors):
        xs = [s for s in sizes if name in all_results[config].get(str(s), {})]
        ys = [all_results[config][str(s)][name] for s in xs]
        style = "--" if config.startswith("nccl") else "-"
        ax.plot([s / 1024 for s in xs], ys, style, marker="o", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("partial per rank (KB, bf16)")
    ax.set_ylabel("per-call latency (us)")
    ax.set_title("psum, 2 processes x 1 H200: K dependent calls in one jit, minus baseline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--k", type=int, default=32, help="dependent calls per program")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5, help="programs per sample, back to back")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--collectives", default=",".join(ARX_COLLECTIVES),
                    help="arx series to time (of jax_arx.psum, one-shot, two-shot)")
    ap.add_argument("--worker")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, args.sizes, args.k, args.samples, args.reps, args.json,
               tuple(c for c in args.collectives.split(",") if c))
        return
    os.makedirs(args.out, exist_ok=True)
    all_results = {}
    for config in args.configs.split(","):
        all_results[config] = run_config(config, args, args.out)
    text, series = table(all_results, args.sizes)
    meta = dict(k=args.k, samples=args.samples, reps=args.reps, sizes=args.sizes, configs=CONFIGS, arx_env=ARX_ENV,
                method="K dependent calls in one jitted program minus the same program without the collective, "
                       "/ K; median of samples")
    with open(os.path.join(args.out, "bench_psum.json"), "w") as f:
        json.dump(dict(meta=meta, results=all_results), f, indent=1)
    plot(all_results, series, args.sizes, os.path.join(args.out, "bench_psum.png"))
    print("\nper-call latency, us (bf16, 2 processes x 1 GPU)\n" + text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
