"""GPU tests of the CUDA device side's waits with no peer at all: on one GPU,
one process, the test plays the peer (tests/gpu_fake_peer.py). It writes,
late or never, the peer's bytes, LL lines and flag words where a carrier or
the peer's kernel would, and checks the result (the reference sum, or NaN),
how long the kernel waited, the failure record in the Control block and its
message, and what the kernel sent (the proxy's triggers and staged bytes, or,
looped back, the lanes, lines and flag words it wrote).

Marked ``gpu``; needs a jax_arx built with the test hooks (CMake option
JAX_ARX_TESTING=ON: gpu_common.BUILD): on a machine with a GPU, these tests
fail without them. One process runs every case, each on its own endpoint;
each test asserts one case, every check of it named. Bounds: a wait that must
time out ends within [timeout, 2x timeout] (3 s); one that must end at once
(a mismatch, an abort) within half its endpoint's timeout (20 s). "Late"
means after the test has seen the kernel waiting: Control::begun ahead of
Control::done.

One-shot and two-shot, rank 0 of 2 over the proxy channel (LL off) unless said:
- ``oneshot_on_time_late_stale``: seq 1 on time (the sum; the triggers and
  the staged partial), seq 2 late, seq 3 stale (the peer's flags still at
  seq 2): NaN after the timeout, the record names rank 1; the next call whose
  handler runs raises; the GPU still works;
- ``pieces_rank1_aliased``: rank 1 (the sum starts with the peer's partial),
  the direct channel looped back with LL off, input aliased to output, a
  partial in several pieces whose flags come late and last piece first;
- ``mismatch``: the peer's flag carries another descriptor: NaN at once;
- ``abort``: the host fails the endpoint while the kernel waits (a carrier
  that lost the peer): NaN at once, recorded as an abort;
- ``two_shot``: both halves, the all-gather's late, past the slot.

The LL one-shot, over the direct channel looped back:
- ``ll_on_time_torn_stale``: seq 1 on time (the sum; the lines sent, the
  announcement, the peer's lines zeroed), seq 2 late with torn lines first
  (second halves without their flag and with wrong data: never taken), seq 3
  with seq 1's lines again (stale): NaN after the timeout;
- ``ll_rank1_tails_blocks``: rank 1; float16 aliased with a 2-byte tail,
  float32 with a 4-byte tail, bfloat16 at the LL cap (128 KiB, many blocks);
- ``ll_mismatch_ll`` / ``ll_mismatch_oneshot``: the peer ran another LL
  psum (another size), or a one-shot: NaN at once;
- ``ll_no_announcement``: every line on time, no announcement: NaN after
  the timeout;
- ``ll_abort``: the host fails the endpoint while the kernel waits.

The LL one-shot over the proxy channel (a carrier that puts whole words):
- ``ll_proxy_sent_mismatch``: seq 1 on time (the sum; the announcement as
  trigger 0, the lines staged once and published as trigger 1 without a
  flag word, the peer's lines zeroed); seq 2, the peer ran a one-shot: NaN
  at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import pytest

import gpu_common

pytestmark = pytest.mark.gpu

THIS = os.path.abspath(__file__)
SHORT_S, LONG_S = 3.0, 20.0  # endpoint timeouts: cases that must time out, and those that must not wait
CASES = (
    "oneshot_on_time_late_stale",
    "pieces_rank1_aliased",
    "mismatch",
    "abort",
    "two_shot",
    "ll_on_time_torn_stale",
    "ll_rank1_tails_blocks",
    "ll_mismatch_ll",
    "ll_mismatch_oneshot",
    "ll_no_announcement",
    "ll_abort",
    "ll_proxy_sent_mismatch",
)


# --- the tests -------------------------------------------------------------------


def launch():
    gpus = gpu_common.require_gpus(1, hooks=True)
    return gpu_common.launch_once(
        ("waits",), lambda: gpu_common.run_workers(THIS, ["waits"], None, gpu_common.gpu_env(gpus[:1], 1), timeout=300)
    )


@pytest.mark.parametrize("case", CASES)
def test_wait(case):
    report = launch().phase("waits")[0]
    assert sorted(report["cases"]) == sorted(CASES), sorted(report["cases"])
    c = report["cases"][case]
    failed = [name for name, ok in c["checks"].items() if not ok]
    assert c["checks"] and not failed, f"failed: {failed}\n{json.dumps(c, indent=1)[:6000]}"


# --- the worker ---------------------------------------------------------------------
# Everything below runs in the worker process only.


class Case:
    """The named checks of one case, and what to show when one fails."""

    def __init__(self):
        self.checks, self.info = {}, {}

    def expect(self, what, ok, **info):
        self.checks[what] = bool(ok)
        self.info.update(
            {k: v if isinstance(v, (int, float, str, bool, list, dict)) else str(v) for k, v in info.items()}
        )


def _dtype(name):
    from bulk_cases import _dtypes

    return _dtypes()[name]


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _same(a, b):
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _sum(*parts):
    from bulk_cases import reference_sum

    return reference_sum(list(parts))


def _inputs(name, count, seed):
    return gpu_common.signed_inputs(_dtype(name), count, 2, seed)


def _psum(comm_id, x, alias=False):
    """jax_arx.psum's FFI call (tag 0) on the endpoint ``comm_id``, compiled for x."""
    import jax

    call = jax.ffi.ffi_call(
        "jax_arx_psum",
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        has_side_effect=True,
        input_output_aliases={0: 0} if alias else None,
    )
    return (
        jax.jit(lambda v: call(v, comm_id=np.int64(comm_id), site=np.int64(0)), donate_argnums=(0,) if alias else ())
        .lower(x)
        .compile()
    )


def _dev(x):
    import jax.numpy as jnp

    return jnp.asarray(x)


def _timed(f, x):
    start = time.monotonic()
    got = np.asarray(f(_dev(x)))
    return got, time.monotonic() - start


def _until(condition, within_s):
    """Polls ``condition`` until it holds or ``within_s`` passed; whether it held."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _nan(a):
    return bool(np.isnan(a.astype(np.float32)).all())


def _timed_out(c, peer, got, seconds, seq):
    """The checks of a wait that must give up at the timeout, at ``seq``, on rank 1."""
    from gpu_fake_peer import OP_PSUM, TIMEOUT

    ctl, msg = peer.control(), peer.failure()
    c.expect("nan", _nan(got))
    c.expect("timeout_bound", peer.timeout_s <= seconds <= 2 * peer.timeout_s, seconds=seconds)
    c.expect(
        "record",
        ctl["failed_seq"] == seq
        and ctl["failed_kind"] == TIMEOUT
        and ctl["failed_missing"] == 0b10
        and ctl["failed_family"] == 0
        and ctl["failed_op"] == OP_PSUM
        and ctl["done"] == seq,
        control=ctl,
    )
    c.expect("message", "rank 1" in msg and "timed out" in msg, message=msg)


def _at_once(c, peer, got, seconds, kind, **record):
    from gpu_fake_peer import CONTROL

    ctl = peer.control()
    c.expect("nan", _nan(got))
    c.expect("at_once", seconds < peer.timeout_s / 2, seconds=seconds)
    c.expect(
        "record",
        ctl["failed_kind"] == kind and all(ctl[k] == v for k, v in record.items()),
        control=ctl,
        want={k: v for k, v in record.items() if k in CONTROL},
    )


def _aborted(c, peer, f, x):
    """Calls f(x); once the kernel waits, fails the endpoint from the host."""
    from gpu_fake_peer import ABORTED

    y = f(_dev(x))
    c.expect("kernel_waiting", _until(lambda: peer.waiting(1), peer.timeout_s / 2))
    start = time.monotonic()
    peer.fail("jax_arx: test: lost rank 1: connection reset")
    got = np.asarray(y)
    _at_once(c, peer, got, time.monotonic() - start, ABORTED)
    c.expect("abort_word", peer.control()["abort"] != 0)
    c.expect("message", "lost rank 1" in peer.failure(), message=peer.failure())


def case_oneshot_on_time_late_stale(c):
    from gpu_fake_peer import EVERY_PEER, TRIGGER_HEADER, FakePeer, flag_word, piece_range, raw

    peer = FakePeer(9001, 0, timeout_s=SHORT_S, ll_max_bytes=0)
    n, nbytes = 1001, 2002
    algorithm, pieces = peer.plan(nbytes)
    c.expect("plan", algorithm == "one_shot", algorithm=algorithm)
    desc = peer.oneshot_desc("bfloat16", n, pieces)
    mine, theirs = _inputs("bfloat16", n, 1)
    f = _psum(9001, _dev(mine))
    peer.write_slot(1, 1, theirs)
    peer.signal(1, 1, desc, range(pieces))
    c.expect("on_time_sum", _same(np.asarray(f(_dev(mine))), _sum(mine, theirs)))
    ctl = peer.control()
    c.expect("on_time_control", ctl["begun"] == ctl["done"] == 1 and ctl["failed_seq"] == 0, control=ctl)
    for k in range(pieces):
        lo, hi = piece_range(nbytes, pieces, k)
        want = {
            "src": peer.send + peer.send_bytes + lo,
            "len": hi - lo,
            "dst": peer.slot_at(1, 0) + lo,
            "flag": peer.word(0, k),
            "value": flag_word(1, desc),
            "dest": EVERY_PEER,
            "family": TRIGGER_HEADER if k == 0 else 0,
            "tag": k + 1,
        }
        c.expect(f"trigger_{k}", peer.trigger(k) == want, trigger=peer.trigger(k), want=want)
    c.expect("staged", peer.read(peer.send + peer.send_bytes, nbytes) == raw(mine))

    mine2, theirs2 = _inputs("bfloat16", n, 2)
    y = f(_dev(mine2))
    c.expect("late_kernel_waiting", _until(lambda: peer.waiting(2), SHORT_S / 2))
    peer.write_slot(2, 1, theirs2)
    peer.signal(1, 2, desc, range(pieces))
    c.expect("late_sum", _same(np.asarray(y), _sum(mine2, theirs2)))

    got, seconds = _timed(f, mine)  # the peer's flags stay at seq 2: stale for seq 3
    _timed_out(c, peer, got, seconds, 3)
    try:
        np.asarray(_psum(9001, _dev(mine[:-1]))(_dev(mine[:-1])))  # a new program: its handler runs
        raised = ""
    except Exception as e:  # jax's runtime error type differs between versions
        raised = str(e)
    c.expect("next_call_raises", "rank 1" in raised, raised=raised[:2000])
    y = _dev(np.arange(100, dtype=np.float32))
    c.expect("gpu_still_works", float(y @ y) == 328350.0)
    peer.close()


def case_pieces_rank1_aliased(c):
    from gpu_fake_peer import FakePeer, flag_word, piece_range, raw

    peer = FakePeer(9002, 1, timeout_s=LONG_S, direct=True, ll_max_bytes=0)
    n, nbytes = 20001, 40002
    algorithm, pieces = peer.plan(nbytes)
    c.expect("plan", algorithm == "one_shot" and pieces >= 2, algorithm=algorithm, pieces=pieces)
    desc = peer.oneshot_desc("float16", n, pieces)
    theirs, mine = _inputs("float16", n, 3)  # the peer is rank 0
    f = _psum(9002, _dev(mine), alias=True)
    y = f(_dev(mine))
    c.expect("kernel_waiting", _until(lambda: peer.waiting(1), LONG_S / 2))
    for k in reversed(range(pieces)):  # each piece's bytes, then its flag; piece 0 last
        lo, hi = piece_range(nbytes, pieces, k)
        peer.write(peer.slot_at(1, 0) + lo, raw(theirs)[lo:hi])
        peer.signal(0, 1, desc, [k])
    c.expect("sum", _same(np.asarray(y), _sum(theirs, mine)))
    # Looped back: what it sent to rank 0 is in its own lane and flag words.
    c.expect("sent_lane", peer.read(peer.slot_at(1, 1), nbytes) == raw(mine))
    words = [peer.read_word(peer.word(1, k)) for k in range(pieces)]
    c.expect("sent_flags", words == [flag_word(1, desc)] * pieces, words=words)
    peer.close()


def case_mismatch(c):
    from gpu_fake_peer import MISMATCH, FakePeer, flag_word

    peer = FakePeer(9003, 0, timeout_s=LONG_S, ll_max_bytes=0)
    n = 512
    _, pieces = peer.plan(4 * n)
    desc, other = peer.oneshot_desc("float32", n, pieces), peer.oneshot_desc("float32", n + 1, pieces)
    mine, _ = _inputs("float32", n, 4)
    f = _psum(9003, _dev(mine))
    peer.signal(1, 1, other, range(pieces))
    got, seconds = _timed(f, mine)
    _at_once(c, peer, got, seconds, MISMATCH, failed_src=1, failed_flag=flag_word(1, other), failed_desc=desc)
    c.expect("message", "different collective" in peer.failure(), message=peer.failure())
    peer.close()


def case_abort(c):
    from gpu_fake_peer import FakePeer

    peer = FakePeer(9004, 0, timeout_s=LONG_S, ll_max_bytes=0)
    mine, _ = _inputs("float32", 512, 5)
    _aborted(c, peer, _psum(9004, _dev(mine)), mine)
    peer.close()


def case_two_shot(c):
    from gpu_fake_peer import (
        EVERY_PEER,
        OP_PSUM_GATHER,
        OP_PSUM_SCATTER,
        TRIGGER_HEADER,
        FakePeer,
        flag_word,
        piece_range,
        raw,
    )

    peer = FakePeer(9005, 0, timeout_s=LONG_S)
    n = peer.slot // 2 + 1001  # bfloat16: past the slot, the one-shot's limit
    nbytes = 2 * n
    algorithm, _ = peer.plan(nbytes)
    c.expect("plan", algorithm == "two_shot", algorithm=algorithm)
    scatter, gather = (peer.describe(op, "bfloat16", n, 0) for op in (OP_PSUM_SCATTER, OP_PSUM_GATHER))
    (_, hi0), (lo1, hi1) = piece_range(nbytes, 2, 0), piece_range(nbytes, 2, 1)  # piece 0 starts at 0
    mine, theirs = _inputs("bfloat16", n, 6)
    summed0 = _sum(mine[: hi0 // 2], theirs[: hi0 // 2])
    gathered = _inputs("bfloat16", n - hi0 // 2, 8)[0]  # rank 1's summed chunk
    f = _psum(9005, _dev(mine))
    peer.write_slot(1, 1, theirs[: hi0 // 2])  # rank 1's part of rank 0's chunk, for the reduce-scatter
    peer.signal(1, 1, scatter)
    y = f(_dev(mine))
    c.expect("gather_half_waiting", _until(lambda: peer.waiting(2), LONG_S / 2))
    peer.write_slot(2, 1, gathered)
    peer.signal(1, 2, gather)
    c.expect("sum", _same(np.asarray(y), np.concatenate([summed0, gathered])))
    # Staged: chunk 1 of the partial for rank 1 (lane 1 of the parity-1 staging,
    # a chunk apart), then the summed chunk 0 for every peer (parity 0).
    wants = [
        {
            "src": peer.send + peer.send_bytes + hi0,
            "len": hi1 - lo1,
            "dst": peer.slot_at(1, 0),
            "flag": peer.word(0, 0),
            "value": flag_word(1, scatter),
            "dest": 1,
            "family": TRIGGER_HEADER,
            "tag": 1,
        },
        {
            "src": peer.send,
            "len": hi0,
            "dst": peer.slot_at(2, 0),
            "flag": peer.word(0, 0),
            "value": flag_word(2, gather),
            "dest": EVERY_PEER,
            "family": TRIGGER_HEADER,
            "tag": 2,
        },
    ]
    for k, want in enumerate(wants):
        c.expect(f"trigger_{k}", peer.trigger(k) == want, **{f"trigger_{k}": peer.trigger(k), f"want_{k}": want})
    c.expect("staged_scatter", peer.read(peer.send + peer.send_bytes + hi0, hi1 - lo1) == raw(mine)[lo1:hi1])
    c.expect("staged_gather", peer.read(peer.send, hi0) == raw(summed0))
    ctl = peer.control()
    c.expect("control", ctl["begun"] == ctl["done"] == 2 and ctl["failed_seq"] == 0, control=ctl)
    peer.close()


def _ll_on_time(c, peer, tag, seed):
    """Seq 1 of an LL psum of 1001 bf16 (251 lines, the last with 6 bytes of
    padding) against `peer`, whose lines and announcement are on time: checks
    the plan and the sum; returns what the case goes on with."""
    from gpu_fake_peer import ll_flag

    n, nbytes = 1001, 2002
    c.expect("plan", peer.plan(nbytes)[0] == "ll", plan=peer.plan(nbytes))
    desc = peer.ll_desc("bfloat16", n)
    mine, theirs = _inputs("bfloat16", n, seed)
    f = _psum(tag, _dev(mine))
    peer.write_lines(1, 1, theirs, ll_flag(1, desc))
    peer.signal(1, 1, desc)  # the announcement: the peer's psum word (1, piece 0)
    c.expect("on_time_sum", _same(np.asarray(f(_dev(mine))), _sum(mine, theirs)))
    return n, nbytes, -(-nbytes // 8), desc, mine, theirs, f


def case_ll_on_time_torn_stale(c):
    from gpu_fake_peer import FakePeer, flag_word, lines_of, ll_flag

    peer = FakePeer(9101, 0, timeout_s=SHORT_S, direct=True)
    n, nbytes, lines, desc, mine, theirs, f = _ll_on_time(c, peer, 9101, 21)
    # Looped back: its lines for rank 1 are in its own ll_recv[1][0], its announcement in its own word.
    c.expect(
        "sent_lines", np.array_equal(peer.read_lines(1, 0, lines), lines_of(mine, ll_flag(1, desc), ll_flag(1, desc)))
    )
    c.expect("announced", peer.read_word(peer.word(0, 0)) == flag_word(1, desc))
    c.expect("consumed_zeroed", not peer.read_lines(1, 1, lines).any())

    mine2, theirs2 = _inputs("bfloat16", n, 22)
    peer.signal(1, 2, desc)
    y = f(_dev(mine2))
    c.expect("late_kernel_waiting", _until(lambda: peer.waiting(2), SHORT_S / 2))
    # Torn: first halves complete, second halves with wrong data and no flag.
    peer.write_lines(2, 1, theirs2, ll_flag(2, desc), halves=(True, False), hi_garbage=True)
    c.expect("torn_not_taken", peer.waiting(2))
    peer.write_lines(2, 1, theirs2, ll_flag(2, desc))
    c.expect("late_sum", _same(np.asarray(y), _sum(mine2, theirs2)))
    c.expect("late_zeroed", not peer.read_lines(2, 1, lines).any())

    # Seq 3 shares seq 1's slot: lines with seq 1's flag are stale, never taken.
    peer.write_lines(3, 1, theirs, ll_flag(1, desc))
    peer.signal(1, 3, desc)
    got, seconds = _timed(f, mine)
    _timed_out(c, peer, got, seconds, 3)
    peer.close()


def case_ll_rank1_tails_blocks(c):
    from gpu_fake_peer import FakePeer, ll_flag

    peer = FakePeer(9102, 1, timeout_s=LONG_S, direct=True)
    for seq, (name, n, alias) in enumerate(
        (("float16", 4097, True), ("float32", 1001, False), ("bfloat16", 65536, False)), start=1
    ):
        theirs, mine = _inputs(name, n, 30 + seq)  # the peer is rank 0
        nbytes = n * _dtype(name).itemsize
        c.expect(f"plan_{name}", peer.plan(nbytes)[0] == "ll", plan=peer.plan(nbytes))
        desc = peer.ll_desc(name, n)
        peer.write_lines(seq, 0, theirs, ll_flag(seq, desc))
        peer.signal(0, seq, desc)
        got = np.asarray(_psum(9102, _dev(mine), alias)(_dev(mine)))
        c.expect(f"sum_{name}_{n}", _same(got, _sum(theirs, mine)))
        c.expect(f"zeroed_{name}_{n}", not peer.read_lines(seq, 0, -(-nbytes // 8)).any())
    c.expect("control", peer.control()["done"] == 3, control=peer.control())
    peer.close()


def _ll_mismatch(c, comm_id, other):
    from gpu_fake_peer import MISMATCH, FakePeer, flag_word, ll_flag

    peer = FakePeer(comm_id, 0, timeout_s=LONG_S, direct=True)
    n = 512
    mine, theirs = _inputs("float32", n, 40)
    if other == "ll":  # another LL psum (two more elements): its lines never match, its announcement neither
        d = peer.ll_desc("float32", n + 2)
        peer.write_lines(1, 1, np.concatenate([theirs, theirs[:2]]), ll_flag(1, d))
    else:  # a one-shot: no lines, its piece-0 flag word where the LL announcement goes
        d = peer.oneshot_desc("float32", n, 1)
    peer.signal(1, 1, d)
    got, seconds = _timed(_psum(comm_id, _dev(mine)), mine)
    _at_once(c, peer, got, seconds, MISMATCH, failed_src=1, failed_flag=flag_word(1, d))
    c.expect("message", "different collective" in peer.failure(), message=peer.failure())
    peer.close()


def case_ll_no_announcement(c):
    from gpu_fake_peer import FakePeer, ll_flag

    peer = FakePeer(9106, 0, timeout_s=SHORT_S, direct=True)
    mine, theirs = _inputs("bfloat16", 1001, 23)
    peer.write_lines(1, 1, theirs, ll_flag(1, peer.ll_desc("bfloat16", 1001)))
    got, seconds = _timed(_psum(9106, _dev(mine)), mine)
    _timed_out(c, peer, got, seconds, 1)
    peer.close()


def case_ll_abort(c):
    from gpu_fake_peer import FakePeer

    peer = FakePeer(9105, 0, timeout_s=LONG_S, direct=True)
    mine, _ = _inputs("bfloat16", 1001, 24)
    _aborted(c, peer, _psum(9105, _dev(mine)), mine)
    peer.close()


def case_ll_proxy_sent_mismatch(c):
    from gpu_fake_peer import (
        EVERY_PEER,
        LL_LINE,
        MISMATCH,
        NO_FLAG,
        TRIGGER_HEADER,
        FakePeer,
        flag_word,
        lines_of,
        ll_flag,
    )

    peer = FakePeer(9107, 0, timeout_s=LONG_S)
    n, nbytes, lines, desc, mine, theirs, f = _ll_on_time(c, peer, 9107, 26)
    staged = peer.send + peer.send_bytes  # parity 1, lane 0
    wants = [
        {
            "src": staged,
            "len": 0,
            "dst": peer.slot_at(1, 0),
            "flag": peer.word(0, 0),
            "value": flag_word(1, desc),
            "dest": EVERY_PEER,
            "family": TRIGGER_HEADER,
            "tag": 1,
        },
        {
            "src": staged,
            "len": LL_LINE * lines,
            "dst": peer.lines_at(1, 0),
            "flag": NO_FLAG,
            "value": flag_word(1, desc),
            "dest": EVERY_PEER,
            "family": 0,
            "tag": 2,
        },
    ]
    for k, want in enumerate(wants):
        c.expect(f"trigger_{k}", peer.trigger(k) == want, **{f"trigger_{k}": peer.trigger(k), f"want_{k}": want})
    sent = np.frombuffer(peer.read(staged, LL_LINE * lines), np.uint32).reshape(lines, 4)
    c.expect("staged_lines", np.array_equal(sent, lines_of(mine, ll_flag(1, desc), ll_flag(1, desc))))
    c.expect("consumed_zeroed", not peer.read_lines(1, 1, lines).any())
    ctl = peer.control()
    c.expect("on_time_control", ctl["done"] == 1 and ctl["failed_seq"] == 0, control=ctl)

    other = peer.oneshot_desc("bfloat16", n, 1)  # the peer ran a one-shot at seq 2
    peer.write_slot(2, 1, theirs)
    peer.signal(1, 2, other)
    got, seconds = _timed(f, mine)
    _at_once(c, peer, got, seconds, MISMATCH, failed_seq=2, failed_src=1, failed_flag=flag_word(2, other))
    peer.close()


def worker():
    from jax_arx import _native

    assert _native.register_ffi_targets(), "jax_arx's handlers are not registered"

    run = {
        "ll_mismatch_ll": lambda c: _ll_mismatch(c, 9103, "ll"),
        "ll_mismatch_oneshot": lambda c: _ll_mismatch(c, 9104, "oneshot"),
    }
    cases = {}
    for name in CASES:
        c = Case()
        try:
            run.get(name, globals().get(f"case_{name}"))(c)
        except Exception:  # the next case runs on its own endpoint
            c.expect("no_exception", False, exception=traceback.format_exc()[-3000:])
        cases[name] = {"checks": c.checks, "info": c.info}
    gpu_common.emit(phase="waits", ranks=[0], cases=cases)


if __name__ == "__main__" and "--worker" in sys.argv:
    gpu_common.place_rank()
    worker()
