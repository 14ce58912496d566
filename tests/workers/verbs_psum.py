"""Worker for tests/test_verbs.py: jax_arx.psum between two processes over the
verbs carrier, run inside the soft-RoCE VM by tests/verbs/vm_psum_test.sh
(also usable on real hosts).

jax.distributed comes from the environment (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID). The process runs the phases given on the
command line one after the other, each its own jax_arx.initialize() and
shutdown() over the same mesh (so the compiled functions are reused), with
the environment the phase asks for:

  --phase "name=two-roots transport=verbs hca=rxe0,rxe2/rxe1,rxe3 expect=verbs calls=16"

  name       the phase's name in the PASS line
  transport  verbs | tcp | shm | auto (JAX_ARX_TRANSPORT unset: the automatic choice)
  topology   mesh (default) | ring (jax_arx.initialize's topology: links to the
             neighbours only; each rank's hca then lists its prev port, then its next)
  hca        JAX_ARX_IB_HCA per rank, '/'-separated; '-' leaves it unset for that rank
  expect     the carrier every endpoint must end up on
  calls      back-to-back calls per dtype and size (default 16)
  chunk      split verbs writes into pieces of this many bytes (tuning, through
             jax_arx.initialize(_tuning=...); default unset: writes whole)
  ib_timeout JAX_ARX_IB_TIMEOUT for the phase (default: the environment's)
  lose       a rank that exits mid-stream: the other's next psum must fail with
             an error naming it, well within JAX_ARX_TIMEOUT_S (the last phase)
  bulk       after the psum calls, this many calls each of all_gather,
             psum_scatter and the fused MoE combine (tests/workers/verbs_bulk.py),
             on the bulk collectives' endpoints, which must be on the expected
             carrier and have counted every call

Every result is checked bit for bit against the fp32 rank-order sum computed
with numpy, rounded once to the dtype. Every process can make every rank's
input (seeded by rank, size and call), so the reference needs no collective of
jax's own. Prints "verbs_psum: PASS <phase>: ..." per phase, or a FAIL line and
exits 1.
"""

import argparse
import os
import sys
import time

import numpy as np

import jax_arx

jax_arx.distributed_initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import verbs_bulk  # noqa: E402  (beside this file)

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SIZES = (1, 7, 1000, 4097, 40001, 131071)  # odd counts split unevenly over two roots


def parse_phase(text):
    phase = dict(calls="16", transport="verbs", hca="-/-", expect="verbs")
    for token in text.split():
        key, _, value = token.partition("=")
        phase[key] = value
    assert "name" in phase, text
    return phase


def say(msg):
    print(f"verbs_psum: [rank {jax.process_index()}] {msg}", flush=True)


def inputs_for(rank, n, call, dtype):
    return np.random.default_rng([rank, n, call]).standard_normal((1, n)).astype(np.float32).astype(dtype)


def reference(world, n, call, dtype):
    acc = np.zeros((n,), np.float32)
    for r in range(world):  # rank order, in fp32, rounded once
        acc += inputs_for(r, n, call, dtype)[0].astype(np.float32)
    return acc.astype(inputs_for(0, n, call, dtype).dtype)


IB_TIMEOUT = os.environ.get("JAX_ARX_IB_TIMEOUT")  # the environment's, for the phases that set none


def set_phase_env(phase, me):
    ib_timeout = phase.get("ib_timeout", IB_TIMEOUT)
    if ib_timeout is None:
        os.environ.pop("JAX_ARX_IB_TIMEOUT", None)
    else:
        os.environ["JAX_ARX_IB_TIMEOUT"] = ib_timeout
    if phase["transport"] == "auto":
        os.environ.pop("JAX_ARX_TRANSPORT", None)
    else:
        os.environ["JAX_ARX_TRANSPORT"] = phase["transport"]
    hca = phase["hca"].split("/")[me]
    if hca == "-":
        os.environ.pop("JAX_ARX_IB_HCA", None)
    else:
        os.environ["JAX_ARX_IB_HCA"] = hca
    return hca


def _bytes(text):
    """'64KiB', '4096' -> bytes."""
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
    digits = text.rstrip("KkMmIiBb")
    return int(digits) * units[text[len(digits) :].lower()]


def run_phase(phase, mesh, f):
    me, world = jax.process_index(), mesh.shape["x"]
    hca = set_phase_env(phase, me)
    t0 = time.monotonic()
    # moe_fused: verbs_bulk.py's MoE jobs run the fused combine itself, not
    # the unfused pair the plan would step aside for.
    jax_arx.initialize(
        mesh,
        topology=phase.get("topology"),
        _tuning={"moe_fused": 1, **({"ib_chunk_bytes": _bytes(phase["chunk"])} if phase.get("chunk") else {})},
    )
    transports = sorted({ep.transport for ep in jax_arx._comm.communicator("x").endpoints})
    if transports != [phase["expect"]]:
        say(f"FAIL {phase['name']}: carrier {transports}, expected {phase['expect']}")
        return False
    if "lose" in phase:
        return lose_peer(phase, mesh, f, int(phase["lose"]))
    calls = int(phase["calls"])
    checked = 0
    for dtype in DTYPES:
        for n in SIZES:
            # Back to back: every call is dispatched before any result is read.
            xs = [
                multihost_utils.host_local_array_to_global_array(inputs_for(me, n, c, dtype), mesh, P("x"))
                for c in range(calls)
            ]
            ys = [f(x) for x in xs]
            for c, y in enumerate(ys):
                ref = reference(world, n, c, dtype)
                for shard in y.addressable_shards:
                    got = np.asarray(shard.data).reshape(-1)  # (1, n): one row, every rank's sum
                    if got.shape != ref.shape or got.tobytes() != ref.tobytes():
                        bad = int(np.sum(got != ref)) if got.shape == ref.shape else f"shape {got.shape}: all"
                        say(
                            f"FAIL {phase['name']}: {np.dtype(dtype).name} n={n} call {c}: {bad} elements differ "
                            f"from the fp32 rank-order reference"
                        )
                        return False
                checked += 1
    bulk = run_bulk(phase, mesh) if phase.get("bulk") else ""
    if bulk is None:
        return False
    jax_arx.check()
    relayed = sum(le.endpoint.stats()["relayed_puts"] for le in jax_arx._comm.communicator("x").endpoints)
    jax_arx.shutdown()
    say(
        f"PASS {phase['name']}: {checked} psum calls over {transports[0]} "
        f"(JAX_ARX_IB_HCA={hca if hca != '-' else 'unset'}), bit-identical to the fp32 rank-order reference "
        f"(bf16, f16, f32; n = {', '.join(map(str, SIZES))}; {calls} back to back per dtype and size){bulk} "
        f"in {time.monotonic() - t0:.1f} s; {relayed} puts relayed for the previous rank"
    )
    return True


def run_bulk(phase, mesh):
    """The phase's bulk calls (verbs_bulk.run); then the bulk endpoints must
    be on the phase's carrier and have counted every call (jax_arx ran them,
    not jax.lax). The PASS line's part, or None after a FAIL line."""
    t0 = time.monotonic()
    calls = int(phase["bulk"])
    checked, error = verbs_bulk.run(mesh, calls, say)
    if error:
        say(f"FAIL {phase['name']}: {error}")
        return None
    eps = jax_arx._registry._bulk_communicators["x"].endpoints
    ran = {
        k: sum(le.endpoint.stats()["calls"][k] for le in eps)
        for k in ("all_gather", "psum_scatter", "moe_combine_psum_scatter")
    }
    want = {"all_gather": calls, "psum_scatter": calls, "moe_combine_psum_scatter": 2 * (calls // 2)}
    carriers = sorted({le.transport for le in eps})
    roots = sorted({le.endpoint.roots for le in eps})
    if ran != want or carriers != [phase["expect"]]:
        say(f"FAIL {phase['name']}: the bulk endpoints ({carriers}) ran {ran}, expected {want} over {phase['expect']}")
        return None
    return (
        f"; {checked} bulk calls over {carriers[0]} with {roots[0]} root(s) (all_gather, psum_scatter "
        f"{calls} each, MoE combine bf16 and e4m3 {calls // 2} each; 4 MiB gathered or scattered per call), "
        f"bit-identical to numpy in {time.monotonic() - t0:.1f} s"
    )


def lose_peer(phase, mesh, f, lost):
    """Rank `lost` exits after a few calls, without shutdown(); the other rank
    waits until it is gone, then calls psum again: its write to the dead peer
    is not acknowledged, the queue pair's retries run out, and the call must
    fail (NaN output or an error, then an error) naming the peer, long before
    JAX_ARX_TIMEOUT_S. (A peer that dies while this rank waits for it, with
    nothing of this rank's in flight, is found by the JAX_ARX_TIMEOUT_S
    watchdog instead: a dead RDMA peer is only noticed by writing to it.)"""
    me, world = jax.process_index(), mesh.shape["x"]
    n, dtype, good = 4097, jnp.float32, 5
    x = multihost_utils.host_local_array_to_global_array(inputs_for(me, n, 0, dtype), mesh, P("x"))
    ref = reference(world, n, 0, dtype)
    for _ in range(good):
        got = np.asarray(f(x).addressable_shards[0].data).reshape(-1)
        assert got.tobytes() == ref.tobytes()
    client = jax_arx._compat.distributed_client()
    if me == lost:
        say(f"exiting mid-stream after {good} calls, without shutdown")
        client.key_value_set("verbs_psum/exiting", "1")
        os._exit(0)
    client.blocking_key_value_get("verbs_psum/exiting", 120_000)
    time.sleep(1)  # os._exit takes the peer's queue pairs with it at once; a second is plenty
    limit = jax_arx.config.load().timeout_s
    t0 = time.monotonic()
    error, nan_calls, calls = None, 0, 0
    while time.monotonic() - t0 < limit + 10:
        calls += 1
        try:
            got = np.asarray(f(x).addressable_shards[0].data).reshape(-1)
        except Exception as e:  # the handler's error, as jax raises it
            error = str(e)
            break
        if got.tobytes() == ref.tobytes():
            say(f"FAIL {phase['name']}: psum succeeded without rank {lost}")
            os._exit(1)
        if not np.all(np.isnan(got)):
            say(f"FAIL {phase['name']}: a wrong sum (not NaN) after rank {lost} went away")
            os._exit(1)
        nan_calls += 1
    took = time.monotonic() - t0
    try:
        jax_arx.check()
        check_error = None
    except jax_arx.CollectiveError as e:
        check_error = str(e)
    message = error or check_error
    ok = message is not None and f"rank {lost}" in message and check_error is not None and took < limit
    lines = (message or "no error").strip().splitlines()
    line = next((text for text in lines if f"rank {lost}" in text), lines[0] if lines else "")
    say(
        f"{'PASS' if ok else 'FAIL'} {phase['name']}: psum failed {took:.1f} s after its first call without rank "
        f"{lost} ({calls} calls, {nan_calls} returned NaN; JAX_ARX_TIMEOUT_S={limit:g}), the error names the peer: "
        f"{line.strip()[:600]}"
    )
    # The peer is gone: skip shutdown()'s barrier and jax.distributed's.
    sys.stdout.flush()
    os._exit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", action="append", required=True, type=parse_phase)
    args = ap.parse_args()
    os.environ.setdefault("JAX_ARX_FALLBACK", "error")  # a fallback to jax.lax would test nothing here
    os.environ.setdefault("JAX_ARX_PREFILL_SLOT_BYTES", str(verbs_bulk.prefill_slot_bytes()))
    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    f = jax.jit(jax.shard_map(lambda v: jax_arx.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P()))
    for phase in args.phase:
        if not run_phase(phase, mesh, f):
            sys.stdout.flush()
            os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
