// The device side on NVIDIA GPUs: the same steps as ffi/host/collectives.cc,
// on the same layout, as kernels on XLA's stream.
//
// attach() pins an endpoint's region for its GPU and allocates the words the
// kernels keep in device memory (the sequence number among them, so that a
// captured CUDA graph replays correctly: nothing on the launch path is host
// bookkeeping). The launch functions only enqueue kernels; the handlers in
// ffi/xla/handlers_cuda.cc call them and nothing else. No XLA types here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "comm/endpoint.h"
#include "comm/layout.h"
#include "comm/status.h"

namespace arx::cuda {

// Words in device memory, one set per endpoint. Only kernels touch them.
struct DeviceWords {
  unsigned long long seq;  // seq_dev: the last seq a kernel of this endpoint ran
  unsigned long long go;   // block 0 -> the other blocks: seq * 4 + (1 if the seq failed) + (2 if published)
  // Per-seq counters shared by the blocks of one grid: seq << 16 | count.
  unsigned long long arrived;   // blocks other than 0 whose copy into send[par] is done
  unsigned long long finished;  // blocks done with the seq (the last one advances seq)
  unsigned long long failed;    // 1 once a seq failed (mirrors Control::failed_seq, in device memory)
  // The pipelined one-shot (allreduce.cu): what the blocks of one grid that
  // gave up waiting found, read and cleared by the grid's last block out.
  unsigned long long fail_any;      // 1: some block of this grid gave up (the others stop waiting)
  unsigned long long fail_kind;     // FailureKind::kMismatch or kAborted, the first one found; else 0
  unsigned long long fail_missing;  // bit flag_index(src, root) per source that had not arrived
  unsigned long long fail_flag;     // for a mismatch: the flag word that disagreed
  unsigned long long fail_src;      // for a mismatch: the peer that sent it
  // The prefill ops (prefill.cu): their own sequence state, as on the host
  // (layout.h, "Sequence state"), and, for the proxy path, how many work
  // ring entries the kernels have published (the next entry's index).
  unsigned long long prefill_seq;   // the last prefill seq a kernel of this endpoint ran
  unsigned long long ring_published;
  unsigned long long prefill_finished;  // blocks done with the prefill seq: seq << 16 | count
  unsigned long long pad0[3];
  // Per piece, the blocks of one grid done with their share of it:
  // seq << 16 | count (the last one publishes the piece).
  unsigned long long piece_arrived[kChunks];
};
static_assert(sizeof(DeviceWords) == 192, "DeviceWords: three lines");

// What the kernels are handed, by value: device addresses of the endpoint's
// pinned region and of its device words, and the sizes (plain data).
struct DeviceView {
  Control* ctl;
  const uint64_t* flags;  // kFlagWords words, written by peers (the proxy, a carrier)
  const uint8_t* recv;    // recv[parity][src], slot_bytes each
  uint8_t* send;          // send[parity], send_bytes each
  DeviceWords* words;
  uint64_t slot_bytes, send_bytes;
  uint64_t timeout_ns;  // Config::timeout_s, measured with %globaltimer
  int rank, world, roots;
  int max_blocks;  // grid size cap
  // Direct mode (shm carrier): device addresses of each peer's recv[0][0]
  // and flags, mapped in this process; the kernels write their partials
  // there themselves (data, then the flag with release) and the proxy sends
  // nothing. Null for this rank, and everywhere when not direct.
  bool direct;
  // Direct mode only: the one-shot goes chunk by chunk, each chunk with its
  // own flag (Config::cuda_pipeline: -1 per size, 0 off, 1 on), in chunks of
  // about chunk_bytes (Config::cuda_chunk_bytes; 0: built in).
  int pipeline;
  uint64_t chunk_bytes;
  // Direct mode only: a one-shot up to this many bytes carries its flags
  // inside the data (Config::cuda_ll_max_bytes; -1: built in, 0: never).
  int64_t ll_max_bytes;
  // The LL one-shot's lines (layout.h, "The LL one-shot"): this rank's
  // ll_recv[0][0], written by the peers' kernels and zeroed by this rank's,
  // and, in direct mode, each peer's, mapped here (null for this rank, and
  // everywhere when not direct).
  uint8_t* ll_recv;
  uint8_t* peer_ll_recv[kMaxWorld];
  uint8_t* peer_recv[kMaxWorld];
  uint64_t* peer_flags[kMaxWorld];
  // Direct mode: the pipelined one-shot's chunk flags (psum_chunk_flag_index)
  // are read here (this rank's) and written there (each peer's). The flag
  // page of the host region (flags, peer_flags) unless peer_memory.
  const uint64_t* chunk_flags;
  uint64_t* peer_chunk_flags[kMaxWorld];
  // Direct mode with the psum inboxes in GPU memory (peer_memory.cc): recv,
  // ll_recv and chunk_flags are in this GPU's memory, their peer_* in the
  // peers' GPUs' memory, mapped here. The seq-level flag words (flag_index)
  // stay in the host region (flags, peer_flags): the watchdog reads them.
  bool peer_memory;
  // The prefill ops (layout.h, "Prefill-sized ops"): the work ring and this
  // rank's buffers, each [2 parities][prefill_slot_bytes]; in direct mode,
  // each peer's prefill_recv[0] (null for this rank, and when not direct).
  PrefillControl* pctl;
  uint8_t* prefill_send;
  const uint8_t* prefill_recv;
  uint64_t prefill_slot_bytes;
  uint8_t* peer_prefill_recv[kMaxWorld];
};

// The psum inboxes in GPU memory (peer_memory.cc), for attach(): this rank's
// (`mine`, zeroed) and every peer's, mapped for this rank's GPU; all null
// when the communicator uses the host region instead. `holder` keeps the
// mappings; drop it only once no kernel uses them.
struct PeerInboxes {
  uint8_t* mine = nullptr;
  uint8_t* peer[kMaxWorld] = {};
  std::shared_ptr<void> holder;
};

// Offers this rank's inbox of `bytes` to the peers and maps theirs, through
// the shm carrier's mapped regions (every peer's must be mapped here). Every
// rank of the communicator must call it at set-up; they agree: either all
// get GPU inboxes or none (Config::cuda_peer_memory: -1 where every rank can
// map every peer's, with one log line otherwise; 0 never; 1 required, an
// error otherwise). An error also when a peer does not answer within the
// timeout.
Status map_peer_memory(Endpoint& ep, int device, uint64_t bytes, PeerInboxes& out);

// Weight ranges the next kernels read: the kernel asks L2 for them while it
// waits for the peers (DRAM is idle then). cp.async.bulk.prefetch.L2, sm_90+;
// ignored on older chips.
constexpr int kMaxPrefetch = 8;
struct Prefetch {
  const void* ptr[kMaxPrefetch];
  uint64_t bytes[kMaxPrefetch];
  int count;
};

// Pins the endpoint's region (cudaHostRegister, mapped | portable) for
// spec().device_ordinal, allocates the device words and keeps both in
// ep.device_state. Idempotent. Call it after Endpoint::create, before the
// first collective; the endpoint must outlive every kernel it launched.
Status attach(Endpoint& ep);

// The view attach() made, or nullptr if the endpoint was not attached.
const DeviceView* view_of(const Endpoint& ep);

// The one-shot partial a slot holds, and the two-shot partial (mesh): the
// largest psum each algorithm takes on this endpoint.
uint64_t oneshot_max_bytes(const Endpoint& ep);
uint64_t twoshot_max_bytes(const Endpoint& ep);

enum class Algorithm : int64_t { kOneShot = 1, kTwoShot = 2 };

// Enqueues out[count] = sum over ranks of in[count] on `stream` (fp32 in rank
// order, rounded once). in and out may alias. One-shot: one kernel, one seq.
// Two-shot: a reduce-scatter kernel and an all-gather kernel, a seq each.
// `tag` (the call site's, the same on every rank) travels in the descriptor.
// Returns the launch error (which may belong to an earlier kernel).
cudaError_t launch_allreduce(const DeviceView& v, Algorithm algorithm, DType dtype, const void* in, void* out,
                             uint64_t count, uint64_t tag, const Prefetch& prefetch, cudaStream_t stream);

// ---- the prefill ops (prefill.cu; layout.h, "Prefill-sized ops") -------------
// Each call is one prefill op with the next prefill seq (kept on the device),
// one kernel. In direct mode the kernel writes the peers' prefill_recv
// itself, a flag per piece; otherwise it copies into prefill_send and
// publishes pieces into the work ring for the proxy. Results land in `out`
// (XLA's buffer). On failure out is NaN (all-gather: nan_type's NaN, or
// every byte 0xFF when nan_type is negative) and the failure is recorded in
// the Control block with failed_op. The handler checks the sizes against
// prefill_slot_bytes before launching.

// out[outer][world][block] = every rank's in[outer][block], bytes =
// outer * block; type_code tells element types apart in the descriptor.
cudaError_t launch_all_gather(const DeviceView& v, const void* in, void* out, uint64_t bytes, uint64_t outer,
                              uint64_t type_code, int nan_type, uint64_t tag, cudaStream_t stream);

// out[outer][count / outer] = the rank-order fp32 sum of every rank's
// in[outer][rank][count / outer], rounded once.
cudaError_t launch_reduce_scatter(const DeviceView& v, DType dtype, const void* in, void* out, uint64_t count,
                                  uint64_t outer, uint64_t tag, cudaStream_t stream);

// The fused MoE combine + reduce-scatter; the same contract as
// host::MoeCombine (ffi/host/prefill.h): rows shared[t] + sum_k w[t, k] *
// y[pos[t, k]] in fp32 with one rounding per term, rounded once to bf16,
// zero past `tokens`; out[padded / world, hidden] = the rank-order sum of
// every rank's rows for this rank.
struct MoeCombineArgs {
  const void* y;         // [rows, hidden] bf16 or e4m3
  const float* y_scale;  // [rows, hidden / 128] when y is e4m3, else null
  const int32_t* pos;    // [tokens, topk]
  const float* w;        // [tokens, topk]
  const uint16_t* shared;  // [tokens, hidden] bf16
  uint64_t rows, tokens, padded, hidden, topk;
};
cudaError_t launch_moe_combine(const DeviceView& v, const MoeCombineArgs& a, uint16_t* out, uint64_t tag,
                               cudaStream_t stream);

}  // namespace arx::cuda
