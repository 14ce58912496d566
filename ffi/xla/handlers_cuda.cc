// CUDA-platform handlers. A handler decodes the call, finds the endpoint of
// (comm_id, device ordinal), checks what it can on the host, and launches;
// nothing on this path keeps per-call state on the host (the sequence number
// lives on the device), so a CUDA graph that captured the launch replays
// correctly without running this code again.
#include "xla/handlers_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "cuda/device_side.h"
#include "xla/handlers.h"

namespace arx::xla {

// How many times XLA ran the psum handler in this process. A test reads it
// (ffi/xla/testing_cuda.cc) to show that XLA captured the launches in a CUDA
// graph: replays of a captured graph run no handler.
std::atomic<uint64_t> g_psum_cuda_handler_calls{0};
// The same for the prefill ops' handlers (all three together).
std::atomic<uint64_t> g_prefill_cuda_handler_calls{0};

namespace {

// An int64 attribute; `fallback` when the call has none (optional ones).
ffi::ErrorOr<int64_t> int_attr(const ffi::Dictionary& attrs, const char* name, std::optional<int64_t> fallback) {
  if (!attrs.contains(name)) {
    if (fallback) return *fallback;
    return ffi::Unexpected(ffi::Error::InvalidArgument(strf("jax_arx.psum: the call has no '%s' attribute", name)));
  }
  return attrs.get<int64_t>(name);
}

// x[0..n) -> y[0..n), each summed over the communicator, one collective per
// pair in operand order (the same contract as the CPU handler). Operands
// past the n-th are dependency operands (never read; they order this call
// after their producers), then the last `prefetch` of them are weights the
// next kernels read, which the first kernel asks L2 to fetch while it waits
// for the peers. Attributes: comm_id, algorithm (1 one-shot, 2 two-shot),
// site (the call site's tag, default 0), prefetch (default 0); taken as a
// dictionary so that the attributes a lowering adds later do not break it.
ffi::Error psum_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     ffi::Dictionary attrs) {
  g_psum_cuda_handler_calls.fetch_add(1, std::memory_order_relaxed);
  const auto comm_id = int_attr(attrs, "comm_id", std::nullopt);
  const auto algorithm = int_attr(attrs, "algorithm", std::nullopt);
  const auto site = int_attr(attrs, "site", 0);
  const auto prefetch = int_attr(attrs, "prefetch", 0);
  for (const auto* a : {&comm_id, &algorithm, &site, &prefetch})
    if (a->has_error()) return a->error();
  const size_t n = rets.size();
  if (args.size() < n + (size_t)std::max<int64_t>(*prefetch, 0))
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: %zu operands for %zu results and %lld prefetch operands",
                                            args.size(), n, (long long)*prefetch));
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(*comm_id, device_ordinal, ep); e.failure()) return e;
  const cuda::DeviceView* view = cuda::view_of(*ep);
  if (!view)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: %s was not set up for CUDA (platform 'cuda' in "
                                            "jax_arx.initialize)", ep->label().c_str()));
  // The "next host-side call raises" contract: a failure a kernel recorded
  // (or the proxy, or a lost peer) is raised by the first call whose handler
  // runs after it. The kernels would fill NaN and return at once anyway.
  if (ep->failed()) return ffi::Error::Internal(ep->failure());
  cuda::Algorithm alg;
  uint64_t limit;
  switch (*algorithm) {
    case 1:
      alg = cuda::Algorithm::kOneShot;
      limit = cuda::oneshot_max_bytes(*ep);
      break;
    case 2:
      alg = cuda::Algorithm::kTwoShot;
      limit = cuda::twoshot_max_bytes(*ep);
      break;
    default:
      return ffi::Error::InvalidArgument(
          strf("jax_arx.psum: unknown algorithm %lld (1: one-shot, 2: two-shot)", (long long)*algorithm));
  }

  cuda::Prefetch pf{};
  if (*prefetch > cuda::kMaxPrefetch)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: at most %d prefetch operands, got %lld",
                                            cuda::kMaxPrefetch, (long long)*prefetch));
  for (size_t i = args.size() - (size_t)std::max<int64_t>(*prefetch, 0); i < args.size(); ++i) {
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

  for (size_t i = 0; i < n; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    const std::optional<DType> dtype = dtype_of(x->element_type());
    if (!dtype)
      return ffi::Error::InvalidArgument("jax_arx.psum: the CUDA handler takes float32, bfloat16 or float16");
    if ((*y)->element_type() != x->element_type() || (*y)->element_count() != x->element_count())
      return ffi::Error::InvalidArgument("jax_arx.psum: each result must have its operand's shape and dtype");
    if (x->size_bytes() > limit)
      return ffi::Error::InvalidArgument(
          strf("jax_arx.psum: %zu bytes exceed the %s limit of %llu bytes on %s (JAX_ARX_SLOT_BYTES, "
               "JAX_ARX_SEND_BYTES); the Python side should have chosen another algorithm or jax.lax.psum",
               x->size_bytes(), *algorithm == 1 ? "one-shot" : "two-shot", (unsigned long long)limit,
               ep->label().c_str()));
    // Leaves of one call are told apart by their position, as on the host.
    const uint64_t tag = (uint64_t)*site * 64 + i;
    const cudaError_t e = cuda::launch_allreduce(*view, alg, *dtype, x->untyped_data(), (*y)->untyped_data(),
                                                 x->element_count(), tag, i == 0 ? pf : cuda::Prefetch{}, stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(strf("jax_arx.psum: launching on device %d failed: %s (%s); the error may belong "
                                       "to an earlier kernel on this device",
                                       (int)device_ordinal, cudaGetErrorName(e), cudaGetErrorString(e)));
  }
  return ffi::Error::Success();
}


// The endpoint of (comm_id, device ordinal) and its CUDA view; an error if
// there is none, or if the endpoint has failed (the "next host-side call
// raises" contract: the kernels would fill NaN and return at once anyway).
ffi::Error cuda_endpoint(const char* op, int64_t comm_id, int32_t device_ordinal, std::shared_ptr<Endpoint>& ep,
                         const cuda::DeviceView*& view) {
  g_prefill_cuda_handler_calls.fetch_add(1, std::memory_order_relaxed);  // every prefill handler starts here
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  view = cuda::view_of(*ep);
  if (!view)
    return ffi::Error::InvalidArgument(strf("jax_arx.%s: %s was not set up for CUDA (platform 'cuda' in "
                                            "jax_arx.initialize)", op, ep->label().c_str()));
  if (ep->failed()) return ffi::Error::Internal(ep->failure());
  return ffi::Error::Success();
}

ffi::Error launched(const char* op, int32_t device_ordinal, cudaError_t e) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(strf("jax_arx.%s: launching on device %d failed: %s (%s); the error may belong to an "
                                   "earlier kernel on this device",
                                   op, (int)device_ordinal, cudaGetErrorName(e), cudaGetErrorString(e)));
}

ffi::Error too_big(const char* op, const Endpoint& ep, uint64_t bytes) {
  return ffi::Error::InvalidArgument(strf("jax_arx.%s: %llu bytes on %s exceed the prefill slot of %llu bytes; raise "
                                          "JAX_ARX_PREFILL_SLOT_BYTES (the Python side should have fallen back to "
                                          "jax.lax)",
                                          op, (unsigned long long)bytes, ep.label().c_str(),
                                          (unsigned long long)ep.layout().prefill_slot_bytes));
}

// The prefill ops (ffi/cuda/prefill.cu), with the CPU handlers' operands,
// results and attributes (handlers_host.cc): x[0..n) -> y[0..n), one op per
// pair in operand order, then dependency operands.
ffi::Error all_gather_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, int64_t comm_id, int64_t site, int64_t dimension) {
  std::shared_ptr<Endpoint> ep;
  const cuda::DeviceView* view = nullptr;
  if (ffi::Error e = cuda_endpoint("all_gather", comm_id, device_ordinal, ep, view); e.failure()) return e;
  if (args.size() < rets.size()) return ffi::Error::InvalidArgument("jax_arx.all_gather: fewer operands than results");
  const uint64_t world = (uint64_t)ep->spec().world;
  for (size_t i = 0; i < rets.size(); ++i) {
    PrefillPair p;
    if (ffi::Error e = prefill_pair(true, args, rets, i, world, dimension, p); e.failure()) return e;
    if (world * p.in_bytes > view->prefill_slot_bytes) return too_big("all_gather", *ep, world * p.in_bytes);
    const cudaError_t e = cuda::launch_all_gather(*view, p.in, p.out, p.in_bytes, p.outer, (uint64_t)p.type,
                                                  p.dtype ? (int)*p.dtype : -1, (uint64_t)site * 64 + i, stream);
    if (ffi::Error err = launched("all_gather", device_ordinal, e); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error psum_scatter_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, int64_t comm_id, int64_t site, int64_t dimension) {
  std::shared_ptr<Endpoint> ep;
  const cuda::DeviceView* view = nullptr;
  if (ffi::Error e = cuda_endpoint("psum_scatter", comm_id, device_ordinal, ep, view); e.failure()) return e;
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.psum_scatter: fewer operands than results");
  const uint64_t world = (uint64_t)ep->spec().world;
  for (size_t i = 0; i < rets.size(); ++i) {
    PrefillPair p;
    if (ffi::Error e = prefill_pair(false, args, rets, i, world, dimension, p); e.failure()) return e;
    if (p.in_bytes > view->prefill_slot_bytes) return too_big("psum_scatter", *ep, p.in_bytes);
    const cudaError_t e = cuda::launch_reduce_scatter(*view, *p.dtype, p.in, p.out, p.out_count, p.outer,
                                                      (uint64_t)site * 64 + i, stream);
    if (ffi::Error err = launched("psum_scatter", device_ordinal, e); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error moe_combine_psum_scatter_cuda(cudaStream_t stream, int32_t device_ordinal, ffi::RemainingArgs args,
                                         ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, int64_t site,
                                         int64_t scaled) {
  std::shared_ptr<Endpoint> ep;
  const cuda::DeviceView* view = nullptr;
  if (ffi::Error e = cuda_endpoint("moe_combine_psum_scatter", comm_id, device_ordinal, ep, view); e.failure())
    return e;
  MoeOperands m;
  if (ffi::Error e = moe_operands(args, *out, scaled != 0, (uint64_t)ep->spec().world, m); e.failure()) return e;
  if (m.padded * m.hidden * 2 > view->prefill_slot_bytes)
    return too_big("moe_combine_psum_scatter", *ep, m.padded * m.hidden * 2);
  const cuda::MoeCombineArgs a{m.y, m.y_scale, m.pos, m.w, m.shared, m.rows, m.tokens, m.padded, m.hidden, m.topk};
  return launched("moe_combine_psum_scatter", device_ordinal,
                  cuda::launch_moe_combine(*view, a, static_cast<uint16_t*>(out->untyped_data()),
                                           (uint64_t)site * 64, stream));
}

}  // namespace

void add_cuda_registrations(nanobind::dict& d) {
  d["jax_arx_psum"] = nanobind::capsule(reinterpret_cast<void*>(arx_psum_cuda));
  d["jax_arx_all_gather"] = nanobind::capsule(reinterpret_cast<void*>(arx_all_gather_cuda));
  d["jax_arx_psum_scatter"] = nanobind::capsule(reinterpret_cast<void*>(arx_psum_scatter_cuda));
  d["jax_arx_moe_combine_psum_scatter"] = nanobind::capsule(reinterpret_cast<void*>(arx_moe_combine_psum_scatter_cuda));
}

}  // namespace arx::xla

// Command-buffer compatible: the handler only launches, so XLA may capture it
// in a CUDA graph (about 3.3 us a call inside jax.jit, against 5.3-8.8 us
// without the trait).
XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_cuda, arx::xla::psum_cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device_ordinal
                                  .RemainingArgs()  // x[0..n), dependency operands, prefetch operands
                                  .RemainingRets()  // y[0..n)
                                  .Attrs<xla::ffi::Dictionary>(),  // comm_id, algorithm, site, prefetch
                              {xla::ffi::Traits::kCmdBufferCompatible});

// The prefill ops: command-buffer compatible for the same reason (they only
// launch; the prefill seq and the ring index live on the device).
XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_all_gather_cuda, arx::xla::all_gather_cuda,
                              arx::xla::prefill_collective_binding(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_scatter_cuda, arx::xla::psum_scatter_cuda,
                              arx::xla::prefill_collective_binding(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
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
