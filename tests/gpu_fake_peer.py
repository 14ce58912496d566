"""The peers of the GPU wait tests (tests/test_gpu_waits.py), played by the
test: one endpoint on one GPU, opened through the test hooks
(tests/gpu/hooks_cuda.cc, in a build with JAX_ARX_TESTING=ON), never
connected, so no proxy runs and no peer process exists. The test writes the
peers' bytes, LL lines and flag words exactly where a carrier or a peer's
kernel would (ffi/base/layout.h), or withholds them, and reads what the
endpoint's kernels sent, recorded and zeroed.

What the test must mirror of the core, each named where it is defined: the
OpCode numbers, the flag word and the header slots (ffi/base/words.h), the
DType numbers, the Control block's and a Trigger's words (ffi/base/layout.h),
the tags the kernels mix into their descriptors (ffi/cuda/oneshot.cu
``pieces_tag``, ffi/cuda/ll.cu ``ll_tag``). A mirror that is wrong makes the
kernel see a mismatch: the tests fail, they cannot pass wrongly.
"""

from __future__ import annotations

import ctypes

import numpy as np

M64 = (1 << 64) - 1
DESC_BITS = 24
OP_PSUM, OP_PSUM_SCATTER, OP_PSUM_GATHER = 1, 2, 3  # base/words.h, OpCode
DTYPE_CODE = {"float32": 1, "bfloat16": 2, "float16": 3}  # layout.h, DType
ALGORITHM = {1: "one_shot", 2: "two_shot", 3: "ll"}  # comm/plan.h, Algorithm
EVERY_PEER = M64  # layout.h, kEveryPeer
# Control's 32 words (layout.h): name -> index.
CONTROL = {
    "begun": 0,
    "begun_bulk": 1,
    "done": 2,
    "done_bulk": 3,
    "failed_seq": 8,
    "failed_kind": 9,
    "failed_missing": 10,
    "failed_flag": 11,
    "failed_src": 12,
    "failed_desc": 13,
    "failed_family": 14,
    "failed_op": 15,
    "abort": 16,
    "ring_published": 24,
    "ring_consumed": 25,
}
TRIGGER = ("src", "len", "dst", "flag", "value", "dest", "family", "tag")  # layout.h, Trigger
RING = 256  # layout.h, kRing: the trigger ring's entries
TIMEOUT, MISMATCH, ABORTED = 1, 2, 3  # layout.h, FailureKind
LL_LINE, LL_PAYLOAD = 16, 8  # layout.h, kLLLineBytes, kLLLinePayload
TRIGGER_HEADER = 1 << 8  # layout.h, kTriggerHeader: a piece-0 trigger puts the staged header first
NO_FLAG = M64  # layout.h, kTriggerNoFlag: a put with no flag word (LL lines)
# base/words.h, "The flag page": kPsumWords + kMaxWorld x kMaxPieces x kRoots bulk
# words, then 2 families x kMaxWorld heard words, then the header slots of
# kDescriptorWords words by (family, parity, source).
MAX_WORLD, DESCRIPTOR_WORDS = 8, 4
HEADER_WORD_BASE = 256 + MAX_WORLD * 8 * 2 + 2 * MAX_WORLD


class Desc(int):
    """A collective's descriptor: its 24-bit hash (this int, what flag words
    carry) and ``words``, the exact Descriptor (op, type, count, tag) that the
    header slots hold (base/words.h, "Headers")."""

    def __new__(cls, hashed, words):
        d = int.__new__(cls, hashed)
        d.words = tuple(w & M64 for w in words)
        return d


def header_word(family, parity, src):
    """base/words.h, header_word: the first word of a header slot."""
    return HEADER_WORD_BASE + ((family * 2 + parity) * MAX_WORLD + src) * DESCRIPTOR_WORDS


def flag_word(seq, desc):
    return (seq << DESC_BITS | (desc & ((1 << DESC_BITS) - 1))) & M64


def pieces_tag(tag, pieces):
    return (tag ^ (0x5851F42D4C957F2D * (pieces + 1))) & M64


def ll_tag(tag):
    return tag ^ 0x9E3779B97F4A7C15


def ll_flag(seq, desc):
    return (desc & 0xFFFFFF) << 8 | ((seq >> 1) & 0x7F) << 1 | 1


def piece_range(nbytes, n, j):
    """base/words.h, piece_range: piece j of n of nbytes, 16-byte steps."""
    step = ((nbytes + n - 1) // n + 15) & ~15
    return min(step * j, nbytes), min(step * (j + 1), nbytes)


def raw(data: np.ndarray) -> bytes:
    return np.ascontiguousarray(data).tobytes()


def lines_of(data: np.ndarray, flag_lo: int, flag_hi: int, hi_garbage=False) -> np.ndarray:
    """data as LL lines {data0, flag, data1, flag} (32-bit words), the last
    one padded; ``hi_garbage``: the second halves' data all ones."""
    b = np.frombuffer(raw(data), np.uint8)
    words = np.concatenate([b, np.zeros(-len(b) % LL_PAYLOAD, np.uint8)]).view(np.uint32).reshape(-1, 2)
    lines = np.zeros((len(words), 4), np.uint32)
    lines[:, 0], lines[:, 2] = words[:, 0], (0xFFFFFFFF if hi_garbage else words[:, 1])
    lines[:, 1], lines[:, 3] = flag_lo, flag_hi
    return lines


class FakePeer:
    """Rank ``rank`` of ``world`` on GPU 0: its region and the hooks on it.
    ``direct``: the direct route, looped back (what the kernels send to a
    peer lands at this rank's own places, which its waits never read);
    else the proxy route, whose triggers no proxy takes. ``ll_max_bytes``:
    the LL one-shot's limit (-1 built in, 0 never)."""

    def __init__(self, comm_id, rank, *, world=2, timeout_s, direct=False, ll_max_bytes=-1):
        from jax_arx import _core

        self.lib = lib = ctypes.CDLL(_core.__file__)
        lib.arx_testing_describe.restype = ctypes.c_uint64
        self.comm_id, self.rank, self.world, self.timeout_s = comm_id, rank, world, timeout_s
        err = ctypes.create_string_buffer(2048)
        rc = lib.arx_testing_open(
            ctypes.c_int64(comm_id),
            0,
            rank,
            world,
            ctypes.c_double(timeout_s),
            int(direct),
            ctypes.c_int64(ll_max_bytes),
            err,
            len(err),
        )
        assert rc == 0, err.value.decode()
        out = (ctypes.c_uint64 * 12)()
        assert lib.arx_testing_layout(self._id, 0, out) == 0
        (
            self.base,
            self.flags,
            self.recv,
            self.send,
            self.ring,
            self.ll_recv,
            self.slot,
            self.send_bytes,
            self.total,
            self.roots,
            self.stride,
            self.pieces_per_src,
        ) = list(out)
        # ll_recv is [2 parities][world sources][an LL slot], right before the staging buffer.
        self.ll_slot = (self.send - self.ll_recv) // (2 * world)

    @property
    def _id(self):
        return ctypes.c_int64(self.comm_id)

    # --- what the kernels expect ---

    def plan(self, nbytes):
        """(algorithm name, pieces) the psum handler runs for ``nbytes`` here."""
        out = (ctypes.c_int64 * 2)()
        assert self.lib.arx_testing_plan(self._id, 0, ctypes.c_uint64(nbytes), out) == 0
        return ALGORITHM[out[0]], out[1]

    def describe(self, op, dtype, count, tag):
        hashed = int(
            self.lib.arx_testing_describe(
                op, ctypes.c_uint64(DTYPE_CODE[dtype]), ctypes.c_uint64(count), ctypes.c_uint64(tag & M64)
            )
        )
        return Desc(hashed, (op, DTYPE_CODE[dtype], count, tag))

    def oneshot_desc(self, dtype, count, pieces, tag=0):
        return self.describe(OP_PSUM, dtype, count, pieces_tag(tag, pieces))

    def ll_desc(self, dtype, count, tag=0):
        return self.describe(OP_PSUM, dtype, count, ll_tag(tag))

    def word(self, src, piece, root=0):
        """The psum flag word (src, piece, root): base/words.h, FlagWords."""
        return src * self.stride + piece * self.roots + root

    # --- playing the peers ---

    def write(self, offset, data: bytes):
        assert self.lib.arx_testing_write(self._id, 0, ctypes.c_uint64(offset), data, ctypes.c_uint64(len(data))) == 0

    def slot_at(self, seq, src):
        return self.recv + ((seq & 1) * self.world + src) * self.slot

    def write_slot(self, seq, src, data: np.ndarray, offset=0):
        self.write(self.slot_at(seq, src) + offset, raw(data))

    def signal(self, src, seq, desc, pieces=(0,)):
        """src's header of seq (``desc.words``) and its flag words of
        ``pieces`` at seq, every root, stored with release after the bytes
        they announce, as a carrier stores them."""
        words = np.array(desc.words, np.uint64)
        self.write(self.flags + 8 * header_word(0, seq & 1, src), words.tobytes())
        for piece in pieces:
            for root in range(self.roots):
                assert (
                    self.lib.arx_testing_store_flag(
                        self._id, 0, self.word(src, piece, root), ctypes.c_uint64(flag_word(seq, desc))
                    )
                    == 0
                )

    def lines_at(self, seq, src):
        return self.ll_recv + ((seq & 1) * self.world + src) * self.ll_slot

    def write_lines(self, seq, src, data: np.ndarray, flag, halves=(True, True), hi_garbage=False):
        """data as src's LL lines of seq, with the flag in the halves asked
        for. The data goes in first with both flags 0, then the flags: the
        copy is not 8-byte atomic as a kernel's stores are, and the kernel
        must never see a flag before its data."""
        self.write(self.lines_at(seq, src), raw(lines_of(data, 0, 0, hi_garbage)))
        self.write(
            self.lines_at(seq, src), raw(lines_of(data, flag if halves[0] else 0, flag if halves[1] else 0, hi_garbage))
        )

    def fail(self, message):
        assert self.lib.arx_testing_fail(self._id, 0, message.encode()) == 0

    # --- reading what the kernels did ---

    def read(self, offset, nbytes) -> bytes:
        return ctypes.string_at(self.base + offset, nbytes)

    def read_word(self, index) -> int:
        return int(np.frombuffer(self.read(self.flags + 8 * index, 8), np.uint64)[0])

    def read_lines(self, seq, src, n) -> np.ndarray:
        return np.frombuffer(self.read(self.lines_at(seq, src), LL_LINE * n), np.uint32).reshape(n, 4)

    def control(self) -> dict:
        w = (ctypes.c_uint64 * 32)()
        assert self.lib.arx_testing_control(self._id, 0, w) == 0
        return {name: int(w[i]) for name, i in CONTROL.items()}

    def trigger(self, index) -> dict:
        """Trigger ``index`` of the ring (its fields as the kernel wrote them)."""
        words = np.frombuffer(self.read(self.ring + 8 * len(TRIGGER) * (index % RING), 8 * len(TRIGGER)), np.uint64)
        return {name: int(v) for name, v in zip(TRIGGER, words, strict=True)}

    def failure(self) -> str:
        buf = ctypes.create_string_buffer(8192)
        self.lib.arx_testing_failure(self._id, 0, buf, len(buf))
        return buf.value.decode()

    def waiting(self, seq) -> bool:
        """A kernel of psum seq ``seq`` began and has not finished."""
        c = self.control()
        return c["begun"] == seq and c["done"] == seq - 1

    def close(self):
        self.lib.arx_testing_close(self._id, 0)
