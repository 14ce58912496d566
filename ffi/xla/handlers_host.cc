// Host-platform handlers: the CPU backend runs the device side in the
// handler's own thread (ffi/host).
#include <cstring>
#include <mutex>
#include <vector>

#include "host/collectives.h"
#include "host/convert.h"
#include "host/prefill.h"
#include "xla/handlers.h"

namespace arx::xla {
namespace {

// Fills every result from index `from` on with what a failed call leaves:
// NaN of a reducing type, every byte 0xFF otherwise (a NaN in every
// floating type). Never stale memory.
void fill_failed_results(ffi::RemainingRets& rets, size_t from) {
  for (size_t j = from; j < rets.size(); ++j)
    if (auto yj = rets.get<ffi::AnyBuffer>(j); yj.has_value()) {
      if (auto dj = dtype_of((*yj)->element_type()))
        host::fill_nan(*dj, (*yj)->untyped_data(), (*yj)->element_count());
      else std::memset((*yj)->untyped_data(), 0xFF, (*yj)->size_bytes());
    }
}

// x[0..n) -> y[0..n), each summed over the communicator, one collective per
// pair in operand order. Operands past the n-th are dependency operands:
// never read, they only make XLA run this call after their producers (see
// jax_arx/_psum.py: the CPU runtime executes independent calls concurrently,
// and every rank must issue collectives in the same order).
ffi::Error psum_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_id,
                     int64_t algorithm, int64_t site) {
  if (algorithm != 1)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: algorithm %lld is not available on the CPU backend "
                                            "(only one-shot, 1)", (long long)algorithm));
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.psum: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    const std::optional<DType> dtype = dtype_of(x->element_type());
    if (!dtype)
      return ffi::Error::InvalidArgument("jax_arx.psum: the CPU handler takes float32, bfloat16 or float16");
    if ((*y)->element_type() != x->element_type() || (*y)->element_count() != x->element_count())
      return ffi::Error::InvalidArgument("jax_arx.psum: each result must have its operand's shape and dtype");
    // Leaves of one call are told apart by their position.
    const Status s = host::allreduce(*ep, *dtype, x->untyped_data(), (*y)->untyped_data(), x->element_count(),
                                     (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);  // the rest of the call too, never stale memory
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// The rows of the gathered / scattered dimension (host/prefill.h): the
// product of x's first `dimension` sizes. With `dimension` = d, x viewed as
// [outer][rest] gathers into [outer][world][rest] (all_gather along d,
// tiled or not) and scatters from [outer][world][rest / world]
// (psum_scatter along d).
ffi::Error outer_rows(const ffi::AnyBuffer& x, int64_t dimension, uint64_t& outer) {
  const auto dims = x.dimensions();
  if (dimension < 0 || dimension > (int64_t)dims.size())
    return ffi::Error::InvalidArgument(strf("jax_arx: dimension %lld of a rank-%zu operand", (long long)dimension,
                                            dims.size()));
  outer = 1;
  for (int64_t d = 0; d < dimension; ++d) outer *= (uint64_t)dims[d];
  if (outer == 0) outer = 1;  // no elements: any row count describes them
  return ffi::Error::Success();
}

// x[0..n) -> y[0..n): y_i = every rank's x_i, gathered along `dimension`
// (bytes, any element type). One prefill op per pair, in operand order;
// operands past the n-th are dependency operands, as for psum.
ffi::Error all_gather_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_id,
                           int64_t site, int64_t dimension) {
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.all_gather: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    if ((*y)->element_type() != x->element_type() || (*y)->size_bytes() != world * x->size_bytes())
      return ffi::Error::InvalidArgument(strf("jax_arx.all_gather: result %zu must have its operand's dtype and "
                                              "%llu times its elements",
                                              i, (unsigned long long)world));
    uint64_t outer = 0;
    if (ffi::Error e = outer_rows(*x, dimension, outer); e.failure()) return e;
    const Status s = host::all_gather(*ep, x->untyped_data(), (*y)->untyped_data(), x->size_bytes(), outer,
                                      (uint64_t)x->element_type(), dtype_of(x->element_type()),
                                      (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// x[0..n) -> y[0..n): y_i = the sum over ranks of block `rank` of x_i along
// `dimension` (fp32 in rank order, rounded once). As all_gather_host
// otherwise.
ffi::Error psum_scatter_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int64_t comm_id, int64_t site, int64_t dimension) {
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.psum_scatter: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    const std::optional<DType> dtype = dtype_of(x->element_type());
    if (!dtype)
      return ffi::Error::InvalidArgument("jax_arx.psum_scatter: the CPU handler takes float32, bfloat16 or float16");
    if ((*y)->element_type() != x->element_type() || (*y)->element_count() * world != x->element_count())
      return ffi::Error::InvalidArgument(strf("jax_arx.psum_scatter: result %zu must have its operand's dtype and "
                                              "1/%llu of its elements",
                                              i, (unsigned long long)world));
    uint64_t outer = 0;
    if (ffi::Error e = outer_rows(*x, dimension, outer); e.failure()) return e;
    const Status s = host::reduce_scatter(*ep, *dtype, x->untyped_data(), (*y)->untyped_data(),
                                          (*y)->element_count(), outer, (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// The fused MoE combine + reduce-scatter (host/prefill.h). Operands: y
// [R, H] (bf16, or e4m3 when `scaled`), then y_scale [R, H / 128] f32 when
// `scaled`, pos [T, topk] s32, w [T, topk] f32, shared [T, H] bf16, then
// dependency operands. Result: [Tpad / world, H] bf16.
ffi::Error moe_combine_psum_scatter_host(int32_t device_ordinal, ffi::RemainingArgs args,
                                         ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, int64_t site,
                                         int64_t scaled) {
  const size_t n = scaled ? 5 : 4;
  if (args.size() < n)
    return ffi::Error::InvalidArgument(strf("jax_arx.moe_combine_psum_scatter: %zu operands, expected at least %zu",
                                            args.size(), n));
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  std::vector<ffi::AnyBuffer> b;
  for (size_t i = 0; i < n; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    b.push_back(*a);
  }
  const ffi::AnyBuffer &y = b[0], &pos = b[n - 3], &w = b[n - 2], &shared = b[n - 1];
  auto dims = [](const ffi::AnyBuffer& x, int64_t& d0, int64_t& d1) {
    if (x.dimensions().size() != 2) return false;
    d0 = x.dimensions()[0];
    d1 = x.dimensions()[1];
    return true;
  };
  int64_t R, H, T, K, T2, K2, T3, H3, O, H4;
  const bool ok = dims(y, R, H) && dims(pos, T, K) && dims(w, T2, K2) && dims(shared, T3, H3) &&
                  out->dimensions().size() == 2 && (O = out->dimensions()[0], H4 = out->dimensions()[1], true) &&
                  T2 == T && K2 == K && T3 == T && H3 == H && H4 == H &&
                  y.element_type() == (scaled ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16) &&
                  pos.element_type() == ffi::DataType::S32 && w.element_type() == ffi::DataType::F32 &&
                  shared.element_type() == ffi::DataType::BF16 && out->element_type() == ffi::DataType::BF16;
  if (!ok)
    return ffi::Error::InvalidArgument(
        "jax_arx.moe_combine_psum_scatter: expected y [R, H] bf16 (or float8_e4m3fn with y_scale [R, H / 128] "
        "float32), pos [T, topk] int32, w [T, topk] float32, shared [T, H] bfloat16 and a [Tpad / world, H] "
        "bfloat16 result");
  if (scaled) {
    int64_t R5, S5;
    if (!dims(b[1], R5, S5) || R5 != R || H % 128 || S5 != H / 128 || b[1].element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("jax_arx.moe_combine_psum_scatter: y_scale must be [R, H / 128] float32, "
                                         "with H a multiple of 128");
  }
  host::MoeCombine a;
  a.y = y.untyped_data();
  a.y_scale = scaled ? static_cast<const float*>(b[1].untyped_data()) : nullptr;
  a.pos = static_cast<const int32_t*>(pos.untyped_data());
  a.w = static_cast<const float*>(w.untyped_data());
  a.shared = static_cast<const uint16_t*>(shared.untyped_data());
  a.rows = (uint64_t)R;
  a.tokens = (uint64_t)T;
  a.padded = (uint64_t)O * world;
  a.hidden = (uint64_t)H;
  a.topk = (uint64_t)K;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  const Status s = host::moe_combine_reduce_scatter(*ep, a, static_cast<uint16_t*>(out->untyped_data()),
                                                    (uint64_t)site * 64);
  if (!s.ok()) return ffi::Error::Internal(s.message());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace arx::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_host, arx::xla::psum_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // x[0..n), then dependency operands
                                  .RemainingRets()                 // y[0..n)
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("algorithm")      // algorithm: 1 one-shot
                                  .Attr<int64_t>("site"));         // site: the call site's tag

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_all_gather_host, arx::xla::all_gather_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // x[0..n), then dependency operands
                                  .RemainingRets()                 // y[0..n)
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("site")           // site: the call site's tag
                                  .Attr<int64_t>("dimension"));    // dimension: gathered along x's axis d

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_scatter_host, arx::xla::psum_scatter_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // x[0..n), then dependency operands
                                  .RemainingRets()                 // y[0..n)
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("site")           // site: the call site's tag
                                  .Attr<int64_t>("dimension"));    // dimension: scattered along x's axis d

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_host, arx::xla::moe_combine_psum_scatter_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // y, [y_scale], pos, w, shared, then dependencies
                                  .Ret<xla::ffi::AnyBuffer>()      // out [Tpad / world, H] bf16
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("site")           // site: the call site's tag
                                  .Attr<int64_t>("scaled"));       // scaled: 1 if y is e4m3 with y_scale
