// CUDA-platform handlers. A handler decodes the call, finds the endpoint of
// (comm_id, device ordinal), asks the plan (comm/plan.h) what runs this size,
// and launches; nothing on this path keeps per-call state on the host (the
// sequence numbers live on the device), so a CUDA graph that captured the
// launch replays correctly without running this code again.
#include "xla/handlers_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <optional>

#include "comm/plan.h"
#include "cuda/device_side.h"
#include "xla/capsule.h"
#include "xla/handlers.h"

namespace arx::xla {
namespace {

// The endpoint of (comm_id, device ordinal), attached to its GPU; an error
// if there is none, or if the endpoint has failed (the "next host-side call
// raises" contract: the kernels would fill NaN and return at once anyway).
ffi::Error cuda_endpoint(const char* op, int64_t comm_id, int32_t device_ordinal, std::shared_ptr<Endpoint>& ep,
                         Family family = Family::kPsum) {
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep, family); e.failure()) return e;
  if (!cuda::attached(*ep))
    return ffi::Error::InvalidArgument(
        strf("jax_arx.%s: %s was not set up for CUDA (platform 'cuda' in "
             "jax_arx.initialize)",
             op, ep->label().c_str()));
  if (ep->failed()) return ffi::Error::Internal(ep->failure());
  return ffi::Error::Success();
}

ffi::Error launched(const char* op, int32_t device_ordinal, cudaError_t e) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(
      strf("jax_arx.%s: launching on device %d failed: %s (%s); the error may belong to an "
           "earlier kernel on this device",
           op, (int)device_ordinal, cudaGetErrorName(e), cudaGetErrorString(e)));
}

ffi::Error refused(const char* op, const Plan& plan) {
  return ffi::Error::InvalidArgument(
      strf("jax_arx.%s: %s (the Python side should have fallen back to jax.lax)", op, plan.why_not.c_str()));
}

// x[0..n) -> y[0..n), each summed over the communicator, one collective per
// pair in operand order (the same contract as the CPU handler). Operands
// past the n-th are dependency operands (never read; they order this call
// after their producers), then the last `prefetch` of them are weights the
// next kernels read, which the first kernel asks L2 to fetch while it waits
// for the peers.
ffi::Error psum_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     ffi::Dictionary attrs) {
  PsumAttributes at;
  if (ffi::Error e = psum_attributes(attrs, args.size(), rets.size(), at); e.failure()) return e;
  if (at.prefetch > cuda::kMaxPrefetch)
    return ffi::Error::InvalidArgument(
        strf("jax_arx.psum: at most %d prefetch operands, got %lld", cuda::kMaxPrefetch, (long long)at.prefetch));
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = cuda_endpoint("psum", at.comm_id, device_ordinal, ep); e.failure()) return e;
  cuda::Prefetch pf{};
  for (size_t i = args.size() - (size_t)at.prefetch; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    // The bulk prefetch takes 16-byte aligned addresses and sizes: round the
    // range inwards (a few bytes at either end are not worth a fault).
    const uintptr_t lo = ((uintptr_t)b->untyped_data() + 15) & ~(uintptr_t)15;
    const uintptr_t hi = ((uintptr_t)b->untyped_data() + b->size_bytes()) & ~(uintptr_t)15;
    if (hi <= lo) continue;
    pf.ptr[pf.count] = reinterpret_cast<const void*>(lo);
    pf.bytes[pf.count] = hi - lo;
    ++pf.count;
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    PsumPair p;
    if (ffi::Error e = psum_pair(args, rets, i, p); e.failure()) return e;
    const Plan plan = plan_psum(*ep, p.bytes);
    if (plan.algorithm == Algorithm::kNone) return refused("psum", plan);
    if (!at.notice) count_call(*ep, Stats::kPsum, p.bytes, plan);
    // Leaves of one call are told apart by their position, as on the host.
    const cudaError_t e = cuda::launch_psum(*ep, plan, p.dtype, p.in, p.out, p.count, (uint64_t)at.site * 64 + i,
                                            i == 0 ? pf : cuda::Prefetch{}, stream);
    if (ffi::Error err = launched("psum", device_ordinal, e); err.failure()) return err;
  }
  return ffi::Error::Success();
}

// (normed, hidden) = the fused psum + residual + norm of x (add_norm_call),
// one psum collective, the norm in the kernels' epilogue (cuda/norm.cuh).
ffi::Error psum_add_norm_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Dictionary attrs) {
  AddNormCall c;
  if (ffi::Error e = add_norm_call(args, rets, attrs, c); e.failure()) return e;
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = cuda_endpoint("psum_add_norm", c.at.comm_id, device_ordinal, ep); e.failure()) return e;
  const Plan plan = plan_psum(*ep, c.p.bytes, row_bytes(c));
  if (plan.algorithm == Algorithm::kNone) return refused("psum_add_norm", plan);
  count_call(*ep, Stats::kPsum, c.p.bytes, plan);
  const cudaError_t e = cuda::launch_psum(*ep, plan, c.p.dtype, c.p.in, c.p.out, c.p.count, (uint64_t)c.at.site * 64,
                                          cuda::Prefetch{}, stream, c.norm);
  return launched("psum_add_norm", device_ordinal, e);
}

// The bulk collectives (ffi/cuda/bulk.cu), with the CPU handler's operands,
// results and attributes (handlers_host.cc, bulk_host): x[0..n) -> y[0..n),
// one collective per pair in operand order, then dependency operands;
// all_gather where kGather, else psum_scatter.
template <bool kGather>
ffi::Error bulk_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     int64_t comm_id, int64_t site, int64_t dimension) {
  const char* op = kGather ? "all_gather" : "psum_scatter";
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = cuda_endpoint(op, comm_id, device_ordinal, ep, Family::kBulk); e.failure()) return e;
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument(strf("jax_arx.%s: fewer operands than results", op));
  const uint64_t world = (uint64_t)ep->spec().world;
  for (size_t i = 0; i < rets.size(); ++i) {
    BulkPair p;
    if (ffi::Error e = bulk_pair(kGather, args, rets, i, world, dimension, p); e.failure()) return e;
    // The plan's lane: a rank's slice of the gather, a destination's part of the scatter.
    const uint64_t lane = kGather ? p.in_bytes : p.in_bytes / world;
    const Plan plan = plan_bulk(*ep, op, lane);
    if (plan.algorithm == Algorithm::kNone) return refused(op, plan);
    count_call(*ep, kGather ? Stats::kAllGather : Stats::kPsumScatter, lane, plan);
    const uint64_t tag = (uint64_t)site * 64 + i;
    const cudaError_t e =
        kGather ? cuda::launch_all_gather(*ep, p.in, p.out, p.in_bytes, p.outer, (uint64_t)p.type,
                                          p.dtype ? (int)*p.dtype : -1, tag, stream)
                : cuda::launch_reduce_scatter(*ep, *p.dtype, p.in, p.out, p.out_count, p.outer, tag, stream);
    if (ffi::Error err = launched(op, device_ordinal, e); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error moe_combine_psum_scatter_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args,
                                         ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, int64_t site,
                                         int64_t scaled) {
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = cuda_endpoint("moe_combine_psum_scatter", comm_id, device_ordinal, ep, Family::kBulk); e.failure())
    return e;
  MoeCombine m;
  if (ffi::Error e = moe_operands(args, *out, scaled != 0, (uint64_t)ep->spec().world, m); e.failure()) return e;
  // plan_bulk, not plan_moe_combine: the call exists only where the plan
  // chose the fused op (Python lowers the unfused pair otherwise).
  const Plan plan = plan_bulk(*ep, "moe_combine_psum_scatter", m.padded / ep->spec().world * m.hidden * 2);
  if (plan.algorithm == Algorithm::kNone) return refused("moe_combine_psum_scatter", plan);
  count_call(*ep, Stats::kMoeCombine, m.padded / ep->spec().world * m.hidden * 2, plan);
  return launched(
      "moe_combine_psum_scatter", device_ordinal,
      cuda::launch_moe_combine(*ep, m, static_cast<uint16_t*>(out->untyped_data()), (uint64_t)site * 64, stream));
}

// y = x, after the dependency operands (the CPU handler's contract, host
// handlers): y aliases x, so there is nothing to launch unless XLA chose
// otherwise.
ffi::Error after_cuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto x = args.get<ffi::AnyBuffer>(0);
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (x.has_error() || y.has_error() || rets.size() != 1 || x->size_bytes() != (*y)->size_bytes())
    return ffi::Error::InvalidArgument("jax_arx: arx_after takes x and dependency operands, and returns x");
  if (x->untyped_data() == (*y)->untyped_data()) return ffi::Error::Success();
  return launched(
      "fallback notice", -1,
      cudaMemcpyAsync((*y)->untyped_data(), x->untyped_data(), x->size_bytes(), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace

void add_cuda_registrations(nanobind::dict& d) {
  d["jax_arx_psum"] = capsule(arx_psum_cuda);
  d["jax_arx_psum_add_norm"] = capsule(arx_psum_add_norm_cuda);
  d["jax_arx_all_gather"] = capsule(arx_all_gather_cuda);
  d["jax_arx_psum_scatter"] = capsule(arx_psum_scatter_cuda);
  d["jax_arx_moe_combine_psum_scatter"] = capsule(arx_moe_combine_psum_scatter_cuda);
  d["arx_after"] = capsule(arx_after_cuda);
}

}  // namespace arx::xla

// Command-buffer compatible: the handler only launches, so XLA may capture it
// in a CUDA graph (docs/performance.md: the trait is worth more than any
// kernel tweak).
XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_cuda, arx::xla::psum_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device_ordinal
                                  .RemainingArgs()                 // x[0..n), dependency operands, prefetch operands
                                  .RemainingRets()                 // y[0..n)
                                  .Attrs<xla::ffi::Dictionary>(),  // comm_id, site, prefetch
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_add_norm_cuda, arx::xla::psum_add_norm_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device_ordinal
                                  .RemainingArgs()                 // x, residual, weight, [bias], dependency operands
                                  .RemainingRets()                 // normed, hidden
                                  .Attrs<xla::ffi::Dictionary>(),  // comm_id, site, kind, eps, bias
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The bulk collectives: command-buffer compatible for the same reason (they
// only launch; the bulk seq and the ring index live on the device).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    arx_all_gather_cuda, arx::xla::bulk_cuda</*kGather=*/true>,
    arx::xla::bulk_collective_binding(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    arx_psum_scatter_cuda, arx::xla::bulk_cuda</*kGather=*/false>,
    arx::xla::bulk_collective_binding(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_cuda, arx::xla::moe_combine_psum_scatter_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device_ordinal
                                  .RemainingArgs()             // y, [y_scale], pos, w, shared, then dependencies
                                  .Ret<xla::ffi::AnyBuffer>()  // out [Tpad / world, H] bf16
                                  .Attr<int64_t>("comm_id")    // comm_id
                                  .Attr<int64_t>("site")       // site: the call site's tag
                                  .Attr<int64_t>("scaled"),    // scaled: 1 if y is e4m3 with y_scale
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_after_cuda, arx::xla::after_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .RemainingArgs()                                // x, dependency operands
                                  .RemainingRets(),                               // y, x's buffer
                              {xla::ffi::Traits::kCmdBufferCompatible});
