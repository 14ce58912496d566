// Inboxes in GPU memory for the direct mode (shm carrier, GPUs of one host).
//
// Why: in direct mode the kernels write each peer's inbox themselves and
// poll their own. With the inboxes in the pinned host region every poll and
// every read of a peer's data is a round trip over PCIe, and every byte
// crosses PCIe twice (writer to host memory, host memory to reader). With
// the inbox in the reader's own GPU memory, mapped into the writers' GPUs,
// the writer stores over NVLink (or PCIe peer-to-peer) and the reader polls
// and reads its own memory. The protocol is the same (data, fence at system
// scope, flag; the reader acquires the flag, then reads): only where the
// words live changes, and the PTX memory model's system scope covers a
// peer GPU's memory as it covers host memory.
//
// How: each rank allocates its inbox with cuMemCreate, exportable as a POSIX
// file descriptor, and offers (pid, fd) in its region (layout.h,
// kPeerMemoryOfferWord); each peer fetches the descriptor with
// pidfd_getfd(2), imports it and maps it for its own GPU. This works when
// each process sees only its own GPU (CUDA_VISIBLE_DEVICES), unlike
// cudaIpcOpenMemHandle. Then every rank says whether it mapped every peer's
// (kPeerMemoryResultWord), and all use GPU inboxes only if all did: a
// writer must put its data where the reader polls, so the choice is one for
// the whole communicator. The host region's seq-level flags stay where they
// are: the proxy's watchdog and the failure messages read them.
//
// Lifetime: an allocation stays alive while any process maps it, so a peer
// that exits (or is killed) leaves this rank's mapping of its inbox valid,
// and this rank's kernels can never write into memory that was reused.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "base/atomics.h"
#include "cuda/device_side.h"

namespace arx::cuda {
namespace {

// The driver calls, through the runtime's entry points: no link-time
// dependency on libcuda beyond what the runtime loads anyway.
struct Driver {
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    auto get = [](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess)
        return false;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      return true;
    };
    r.ok = get("cuMemCreate", r.create) && get("cuMemRelease", r.release) && get("cuMemAddressReserve", r.reserve) &&
           get("cuMemAddressFree", r.address_free) && get("cuMemMap", r.map) && get("cuMemUnmap", r.unmap) &&
           get("cuMemSetAccess", r.set_access) && get("cuMemGetAllocationGranularity", r.granularity) &&
           get("cuMemExportToShareableHandle", r.export_handle) &&
           get("cuMemImportFromShareableHandle", r.import_handle);
    return r;
  }();
  return d;
}

// One mapping of an allocation (this rank's own, or a peer's), undone in
// reverse order of its steps.
struct Mapping {
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  bool mapped = false;

  void undo() {
    const Driver& d = driver();
    if (mapped) d.unmap(ptr, bytes);
    if (ptr) d.address_free(ptr, bytes);
    if (handle) d.release(handle);
    *this = Mapping{};
  }
};

// Maps `m.handle` (bytes) at a fresh address, readable and writable by
// `device`. On failure returns the step that failed.
const char* map_for(Mapping& m, size_t bytes, size_t alignment, int device) {
  const Driver& d = driver();
  if (d.reserve(&m.ptr, bytes, alignment, 0, 0) != CUDA_SUCCESS) return "cuMemAddressReserve";
  m.bytes = bytes;
  if (d.map(m.ptr, bytes, 0, m.handle, 0) != CUDA_SUCCESS) return "cuMemMap";
  m.mapped = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // For a peer's allocation this is where peer access is refused (no NVLink
  // and no PCIe peer-to-peer between the two GPUs).
  if (d.set_access(m.ptr, bytes, &access, 1) != CUDA_SUCCESS) return "cuMemSetAccess";
  return nullptr;
}

struct PeerMemory {
  int device = 0;
  Mapping own;
  int own_fd = -1;
  Mapping peer[kMaxWorld];

  ~PeerMemory() {
    // Kernels that use these mappings are done: DeviceState synchronizes the
    // device before it lets go of this.
    for (Mapping& m : peer) m.undo();
    own.undo();
    if (own_fd >= 0) close(own_fd);
  }
};

uint64_t* own_word(Endpoint& ep, int index) {
  return reinterpret_cast<uint64_t*>(ep.base() + ep.layout().flag_offset(index));
}

const uint64_t* peer_word(Endpoint& ep, int peer, int index) {
  return reinterpret_cast<const uint64_t*>(ep.windows().base(peer) + ep.layout().flag_offset(index));
}

// This rank's inbox: allocated on its GPU, zeroed, mapped for it, exported.
// Returns the step that failed, or nullptr.
const char* make_own(PeerMemory& pm, uint64_t bytes, size_t& granularity) {
  const Driver& d = driver();
  if (!d.ok) return "loading the driver's cuMem* calls";
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = pm.device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS)
    return "cuMemGetAllocationGranularity";
  const size_t size = (bytes + granularity - 1) / granularity * granularity;
  if (d.create(&pm.own.handle, size, &prop, 0) != CUDA_SUCCESS) return "cuMemCreate";
  if (const char* step = map_for(pm.own, size, granularity, pm.device)) return step;
  // Zeroed before anyone maps it: every flag at progress 0, every LL line
  // empty (the LL one-shot's "Stale lines" invariant starts here).
  if (cudaMemset(reinterpret_cast<void*>(pm.own.ptr), 0, size) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    cudaGetLastError();
    return "zeroing the inbox";
  }
  int fd = -1;
  if (d.export_handle(&fd, pm.own.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS || fd < 0)
    return "cuMemExportToShareableHandle";
  pm.own_fd = fd;
  return nullptr;
}

// Peer p's inbox, from its offer, mapped for this rank's GPU.
const char* map_peer(PeerMemory& pm, int p, uint64_t offer, uint64_t bytes, size_t granularity) {
#if !defined(SYS_pidfd_open) || !defined(SYS_pidfd_getfd)
  (void)pm, (void)p, (void)offer, (void)bytes, (void)granularity;
  return "pidfd_getfd (not in this system's headers: Linux 5.6 or later)";
#else
  const int pid = (int)(offer >> 32), fd = (int)(offer & 0xffffffffu) - 1;
  const int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) return "pidfd_open (the peers must share a process namespace)";
  const int local = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  close(pidfd);
  if (local < 0) return "pidfd_getfd (needs ptrace access to the peer: same user, or CAP_SYS_PTRACE)";
  const CUresult r = driver().import_handle(&pm.peer[p].handle, reinterpret_cast<void*>((uintptr_t)local),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(local);  // the import holds its own reference
  if (r != CUDA_SUCCESS) return "cuMemImportFromShareableHandle";
  const size_t size = (bytes + granularity - 1) / granularity * granularity;
  return map_for(pm.peer[p], size, granularity, pm.device);
#endif
}

}  // namespace

Status map_peer_memory(Endpoint& ep, int device, uint64_t bytes, PeerInboxes& out) {
  out = PeerInboxes{};
  const int rank = ep.spec().rank, world = ep.spec().world;
  const int64_t want = ep.spec().config.cuda_peer_memory;
  const double timeout_s = ep.spec().config.timeout_s;
  auto pm = std::make_shared<PeerMemory>();
  pm->device = device;
  std::string why;  // empty: this rank mapped every peer's inbox
  size_t granularity = 0;
  if (want == 0) {
    why = "JAX_ARX_CUDA_PEER_MEMORY=0";
  } else if (const char* step = make_own(*pm, bytes, granularity)) {
    why = strf("%s failed on this rank", step);
  }
  store_release(own_word(ep, kPeerMemoryBytesWord), bytes);
  store_release(own_word(ep, kPeerMemoryOfferWord),
                why.empty() ? (uint64_t)getpid() << 32 | (uint64_t)(pm->own_fd + 1) : kPeerMemoryNone);
  const auto deadline = deadline_in(timeout_s);
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    const uint64_t offer = wait_nonzero(peer_word(ep, p, kPeerMemoryOfferWord), deadline);
    if (offer == 0)
      return Status::Error(
          strf("jax_arx: %s: rank %d did not offer its GPU inbox (or say it has none) within %g s; "
               "it may have failed to set up, see its log",
               ep.label().c_str(), p, timeout_s));
    if (!why.empty()) continue;  // this rank says no: the others will not use theirs either
    if (offer == kPeerMemoryNone) {
      why = strf("rank %d has none", p);
    } else if (load_acquire(peer_word(ep, p, kPeerMemoryBytesWord)) != bytes) {
      why = strf("rank %d's inbox has another size", p);
    } else if (const char* step = map_peer(*pm, p, offer, bytes, granularity)) {
      why = strf("%s failed for rank %d's inbox", step, p);
    }
  }
  store_release(own_word(ep, kPeerMemoryResultWord), why.empty() ? 1 : 2);
  // Every peer has fetched this rank's descriptor once its result is set.
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    const uint64_t result = wait_nonzero(peer_word(ep, p, kPeerMemoryResultWord), deadline);
    if (result == 0)
      return Status::Error(strf("jax_arx: %s: rank %d did not say whether it mapped the GPU inboxes within %g s",
                                ep.label().c_str(), p, timeout_s));
    if (result != 1 && why.empty()) why = strf("rank %d could not map every peer's", p);
  }
  if (pm->own_fd >= 0) {
    close(pm->own_fd);
    pm->own_fd = -1;
  }
  if (!why.empty()) {
    if (want == 1)
      return Status::Error(
          strf("jax_arx: %s: JAX_ARX_CUDA_PEER_MEMORY=1, but the psum inboxes cannot live in GPU "
               "memory: %s; unset it to use the pinned host region instead",
               ep.label().c_str(), why.c_str()));
    if (want != 0)
      fprintf(stderr, "jax_arx: %s: psum inboxes in pinned host memory, not in GPU memory: %s\n", ep.label().c_str(),
              why.c_str());
    return Status::Ok();  // pm goes: nothing of it was used
  }
  out.mine = reinterpret_cast<uint8_t*>(pm->own.ptr);
  for (int p = 0; p < world; ++p)
    if (p != rank) out.peer[p] = reinterpret_cast<uint8_t*>(pm->peer[p].ptr);
  out.holder = std::move(pm);
  return Status::Ok();
}

}  // namespace arx::cuda
