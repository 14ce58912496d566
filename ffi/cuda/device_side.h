// The device side on NVIDIA GPUs: the collectives of ffi/host, as kernels on
// XLA's stream, over the same channels (comm/channel.h), with the same bits.
//
// attach() pins an endpoint's region for its GPU, maps the peers' memory
// where they share the host, builds the channels the kernels take, and
// allocates the words the kernels keep in device memory (the sequence
// numbers among them, so that a captured CUDA graph replays correctly:
// nothing on the launch path is host bookkeeping). The launch functions only
// enqueue kernels; the handlers in ffi/xla/handlers_cuda.cc call them and
// nothing else. No XLA types here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "base/combine.h"
#include "base/layout.h"
#include "base/norm.h"
#include "base/status.h"
#include "comm/channel.h"
#include "comm/endpoint.h"
#include "comm/plan.h"

namespace arx::cuda {

// Words in device memory, one set per endpoint. Only kernels touch them.
// Counters shared by the blocks of one grid carry the seq in their high bits
// (grid.cuh, "Counting").
struct FamilyWords {
  unsigned long long seq;       // the last seq of the family a kernel ran (the device's sequence state)
  unsigned long long go;        // the coordinating block -> the others: seq << 2 | failed (twoshot.cu)
  unsigned long long arrived;   // blocks whose share of the copies is done: seq << 16 | count (twoshot.cu)
  unsigned long long finished;  // blocks done with the seq: seq << 16 | gave-up blocks << 8 | count (settle)
};

struct DeviceWords {
  FamilyWords family[kFamilies];
  unsigned long long failed;  // 1 once a collective failed (sticky; mirrors Control::failed_seq, in device memory)
  unsigned long long ring;    // the proxy channel: trigger ring entries the kernels published (the next index)
  // What the blocks of one grid that gave up waiting found, read and cleared
  // by the grid's last block out (grid.cuh, settle).
  unsigned long long fail_any;      // 1: some block of this grid gave up (the others stop waiting)
  unsigned long long fail_kind;     // FailureKind::kMismatch or kAborted, the first one found; else 0
  unsigned long long fail_missing;  // bit src per source that had not arrived
  unsigned long long fail_flag;     // for a mismatch: the flag word that disagreed
  unsigned long long fail_src;      // for a mismatch: the peer that sent it
  unsigned long long pad;
  unsigned long long fail_theirs[kDescriptorWords];  // for a mismatch: the peer's exact Descriptor
  unsigned long long pad1[4];
  // The bulk collectives: per piece, the producer blocks done with their
  // share of it: seq << 16 | counts (grid.cuh's arrival fields; bulk.cu:
  // the last to finish the peers' part signals the piece).
  unsigned long long piece_arrived[kMaxPieces];
};
static_assert(sizeof(DeviceWords) == 4 * 64, "DeviceWords: four lines");

// What every kernel gets besides its channel.
struct Grid {
  DeviceWords* words;
  Control* ctl;         // the Control block, as the device addresses it
  uint64_t timeout_ns;  // Config::timeout_s, measured with %globaltimer
  int max_blocks;       // grid size cap of the grids whose blocks wait
  int sms;              // the device's multiprocessors
  TraceBuffer* trace;   // the stage timestamps, as the device addresses them (base/trace.h): null but in a trace build
};

// The LL one-shot's channels (ll.cu), of one medium: its lines, which carry
// their flags, over `lines` (a channel whose inbox is ll_recv: comm/
// channel.h, `ll_lines`), and its announcement over `psum`, the psum
// family's piece-0 word (so a peer that ran another algorithm at the same
// seq shows up there as a mismatch).
template <typename Ch>
struct LLChannel {
  Ch psum;
  Ch lines;
};

// Weight ranges the next kernels read: the kernel asks L2 for them while it
// waits for the peers (DRAM is idle then). cp.async.bulk.prefetch.L2, sm_90+;
// ignored on older chips.
constexpr int kMaxPrefetch = 8;
struct Prefetch {
  const void* ptr[kMaxPrefetch];
  uint64_t bytes[kMaxPrefetch];
  int count;
};

// Pins the endpoint's region for spec().device_ordinal (and, on one host,
// the peers' regions; with GPU inboxes, maps the peers' GPU memory),
// builds the channels, allocates the device words, sets the endpoint's route
// and keeps everything in ep.device_state. Idempotent. Call it after
// Endpoint::connect, before the first collective; the endpoint must outlive
// every kernel it launched.
Status attach(Endpoint& ep);
bool attached(const Endpoint& ep);

// Enqueues out[count] = sum over ranks of in[count] on `stream` (fp32 in rank
// order, rounded once), as `plan` (comm/plan.h, for this size) says. in and
// out may alias. `tag` (the call site's, the same on every rank) travels in
// the descriptor. Returns the launch error (which may belong to an earlier
// kernel). With `norm` on, the fused call (base/norm.h): out becomes the sum
// + norm.residual and norm.normed its norm; plan is plan_psum's for rows of
// norm.width elements.
cudaError_t launch_psum(const Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count,
                        uint64_t tag, const Prefetch& prefetch, cudaStream_t stream, const AddNorm& norm = {});

// The bulk collectives (bulk.cu), one kernel each, with the contracts of
// their host counterparts (host/device_side.h). On failure out is NaN
// (all_gather: nan_type's NaN, or every byte 0xFF when nan_type is negative)
// and the failure is recorded in the Control block. The handler checks the
// sizes against the plan before launching.
cudaError_t launch_all_gather(const Endpoint& ep, const void* in, void* out, uint64_t bytes, uint64_t outer,
                              uint64_t type_code, int nan_type, uint64_t tag, cudaStream_t stream);
cudaError_t launch_reduce_scatter(const Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count,
                                  uint64_t outer, uint64_t tag, cudaStream_t stream);
cudaError_t launch_moe_combine(const Endpoint& ep, const MoeCombine& a, uint16_t* out, uint64_t tag,
                               cudaStream_t stream);

// ---- between attach.cc and the kernels' files ----------------------------------

// The host object behind ep.device_state.
struct DeviceState;
struct Channels {
  Grid grid;
  bool direct = false;
  bool gpu_inboxes = false;  // the direct channels' inboxes are in GPU memory (peer_memory.cc)
  DirectChannel psum_direct, bulk_direct;
  ProxyChannel psum_proxy, bulk_proxy;
  LLChannel<DirectChannel> ll_direct;
  LLChannel<ProxyChannel> ll_proxy;
};
const Channels& channels_of(const Endpoint& ep);

// The pinned round trip (ping_pong.cu): `rounds` passes of a word from a
// host thread to a kernel's thread on `device` and back, through mapped host
// memory. The host's steady clock = the GPU's %globaltimer + offset_ns,
// within error_ns (half the shortest round trip).
struct PingPong {
  uint64_t min_ns = 0, median_ns = 0;
  int64_t offset_ns = 0, error_ns = 0;
};
Status pinned_ping_pong(int device, int rounds, PingPong& out);

// The inboxes in GPU memory (peer_memory.cc), for attach(): this rank's
// (`mine`, zeroed) and every peer's, mapped for this rank's GPU; all null
// when the communicator uses the host region instead. `holder` keeps the
// mappings; drop it only once no kernel uses them.
struct PeerInboxes {
  uint8_t* mine = nullptr;
  uint8_t* peer[kMaxWorld] = {};
  std::shared_ptr<void> holder;
};

// Offers this rank's inbox of `bytes` to the peers and maps theirs, through
// the peers' mapped regions (Endpoint::windows). Every rank of the
// communicator must call it at set-up; they agree: either all get GPU
// inboxes or none (Config::cuda_peer_memory: -1 where every rank can map
// every peer's, with one log line otherwise; 0 never; 1 required, an error
// otherwise). An error also when a peer does not answer within the timeout.
Status map_peer_memory(Endpoint& ep, int device, uint64_t bytes, PeerInboxes& out);

}  // namespace arx::cuda
