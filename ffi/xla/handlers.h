// The XLA FFI handlers of jax_arx. Each is a thin layer: decode the call,
// find the endpoint by (comm_id, device ordinal), hand the buffers to a
// device side, and turn its Status into an ffi::Error.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/combine.h"
#include "base/layout.h"
#include "base/norm.h"
#include "comm/endpoint.h"
#include "comm/plan.h"
#include "xla/ffi/api/ffi.h"

namespace arx::xla {

namespace ffi = ::xla::ffi;

// The reducing ops' element types; nullopt for any other.
inline std::optional<DType> dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F16:
      return DType::kF16;
    default:
      return std::nullopt;  // XLA's enum, not ours: every other type is unsupported
  }
}

// The endpoint a call of `family` runs on, or an error saying how to get
// one. A bulk collective needs one whose region holds the bulk lanes
// (Config::bulk_lanes): the one jax_arx makes for them at the first bulk
// collective it traces, under a communicator id of its own.
inline ffi::Error endpoint_for(int64_t comm_id, int32_t device_ordinal, std::shared_ptr<Endpoint>& ep,
                               Family family = Family::kPsum) {
  ep = find_endpoint(comm_id, device_ordinal);
  if (!ep)
    return ffi::Error::InvalidArgument(
        strf("jax_arx: no communicator %lld on local device %d in this process; call jax_arx.initialize(mesh) (after "
             "jax.distributed.initialize) with the mesh the collective runs over, before running it",
             (long long)comm_id, (int)device_ordinal));
  if (family == Family::kBulk && ep->layout().bulk_lane == 0)
    return ffi::Error::InvalidArgument(
        strf("jax_arx: %s holds no bulk lanes, so no all_gather, psum_scatter or MoE combine runs on it (communicator "
             "%lld is not the one jax_arx made for them; JAX_ARX_PREFILL_SLOT_BYTES=0 turns them off)",
             ep->label().c_str(), (long long)comm_id));
  return ffi::Error::Success();
}

// Counts a call whose handler runs (Endpoint::stats), with the algorithm
// the plan chose for it.
inline void count_call(Endpoint& ep, Stats::Kind kind, uint64_t bytes, const Plan& plan) {
  ep.stats.count(kind, bytes, (int)plan.algorithm);
}

// Counts a call that failed where the host sees it (Endpoint::stats) and
// passes its error on.
inline ffi::Error failed_call(Endpoint& ep, Stats::Kind kind, ffi::Error e) {
  ep.stats.count_failure(kind);
  return e;
}

// The attributes of a psum call, the same on both platforms: comm_id, site
// (the call site's tag, default 0) and prefetch (how many of the operands,
// the last ones, are weights to prefetch; default 0). Taken as a dictionary,
// so that attributes a lowering adds later do not break it. `args` and
// `rets`: the operand and result counts, checked against prefetch.
// notice: 1 for a fallback's notice (jax_arx/_notice.py), a psum of one
// float that stats() does not count as the program's psum.
struct PsumAttributes {
  int64_t comm_id = 0, site = 0, prefetch = 0, notice = 0;
};

inline ffi::Error psum_attributes(const ffi::Dictionary& attrs, size_t args, size_t rets, PsumAttributes& at) {
  if (!attrs.contains("comm_id"))
    return ffi::Error::InvalidArgument("jax_arx.psum: the call has no 'comm_id' attribute");
  auto get = [&](const char* name, int64_t& out) -> ffi::Error {
    if (!attrs.contains(name)) return ffi::Error::Success();
    auto v = attrs.get<int64_t>(name);
    if (v.has_error()) return v.error();
    out = *v;
    return ffi::Error::Success();
  };
  for (auto [name, out] :
       {std::pair{"comm_id", &at.comm_id}, {"site", &at.site}, {"prefetch", &at.prefetch}, {"notice", &at.notice}})
    if (ffi::Error e = get(name, *out); e.failure()) return e;
  if (at.prefetch < 0 || args < rets + (size_t)at.prefetch)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: %zu operands for %zu results and %lld prefetch operands",
                                            args, rets, (long long)at.prefetch));
  return ffi::Error::Success();
}

// Pair i of a psum call, x_i -> y_i: a reducing dtype, y of x's shape.
struct PsumPair {
  const void* in = nullptr;
  void* out = nullptr;
  uint64_t count = 0, bytes = 0;
  DType dtype = DType::kF32;
};

inline ffi::Error psum_pair(ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t i, PsumPair& p) {
  auto x = args.get<ffi::AnyBuffer>(i);
  auto y = rets.get<ffi::AnyBuffer>(i);
  if (x.has_error()) return x.error();
  if (y.has_error()) return y.error();
  const std::optional<DType> dtype = dtype_of(x->element_type());
  if (!dtype) return ffi::Error::InvalidArgument("jax_arx.psum: takes float32, bfloat16 or float16");
  if ((*y)->element_type() != x->element_type() || (*y)->element_count() != x->element_count())
    return ffi::Error::InvalidArgument("jax_arx.psum: each result must have its operand's shape and dtype");
  p.in = x->untyped_data();
  p.out = (*y)->untyped_data();
  p.count = x->element_count();
  p.bytes = x->size_bytes();
  p.dtype = *dtype;
  return ffi::Error::Success();
}

// A call of psum_add_norm, the same on both platforms: operands x,
// residual (x's shape and dtype), weight [W] (x's dtype, W x's last
// dimension), then bias [W] when the `bias` attribute is 1, then dependency
// operands; results normed, hidden (x's shape and dtype); attributes those
// of psum plus kind (0 rms, 1 layer), eps (f32) and bias. The pair's `out`
// is hidden, where the sum goes (base/norm.h).
struct AddNormCall {
  PsumAttributes at;
  PsumPair p;
  AddNorm norm;
};

inline ffi::Error add_norm_call(ffi::RemainingArgs& args, ffi::RemainingRets& rets, const ffi::Dictionary& attrs,
                                AddNormCall& c) {
  constexpr const char* kWhat =
      "jax_arx.psum_add_norm: expected operands x, residual (x's shape and dtype), weight "
      "[x.shape[-1]] and, with bias=1, bias [x.shape[-1]], all float32, bfloat16 or "
      "float16, and results normed, hidden of x's shape and dtype";
  if (rets.size() != 2) return ffi::Error::InvalidArgument(kWhat);
  auto int_attr = [&](const char* name, int64_t& out) -> ffi::Error {
    auto v = attrs.get<int64_t>(name);
    if (v.has_error()) return ffi::Error::InvalidArgument(strf("jax_arx.psum_add_norm: no int attribute '%s'", name));
    out = *v;
    return ffi::Error::Success();
  };
  int64_t kind = 0, bias = 0;
  if (ffi::Error e = int_attr("kind", kind); e.failure()) return e;
  if (ffi::Error e = int_attr("bias", bias); e.failure()) return e;
  auto eps = attrs.get<float>("eps");
  if (eps.has_error()) return ffi::Error::InvalidArgument("jax_arx.psum_add_norm: no float attribute 'eps'");
  if ((kind != 0 && kind != 1) || (bias != 0 && bias != 1) || !(*eps >= 0.f))
    return ffi::Error::InvalidArgument(
        "jax_arx.psum_add_norm: kind must be 0 (rms) or 1 (layer), bias 0 or 1, eps "
        ">= 0");
  const size_t n = bias ? 4 : 3;
  if (args.size() < n) return ffi::Error::InvalidArgument(kWhat);
  if (ffi::Error e = psum_attributes(attrs, args.size() - (n - 1), 1, c.at); e.failure()) return e;
  std::vector<ffi::AnyBuffer> b;
  for (size_t i = 0; i < n; ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    b.push_back(*a);
  }
  auto normed = rets.get<ffi::AnyBuffer>(0);
  auto hidden = rets.get<ffi::AnyBuffer>(1);
  if (normed.has_error()) return normed.error();
  if (hidden.has_error()) return hidden.error();
  const ffi::AnyBuffer& x = b[0];
  const auto dims = x.dimensions();
  const std::optional<DType> dtype = dtype_of(x.element_type());
  if (!dtype || dims.size() == 0 || dims.back() <= 0) return ffi::Error::InvalidArgument(kWhat);
  const uint64_t width = (uint64_t)dims.back();
  auto like_x = [&](const ffi::AnyBuffer& y) {
    return y.element_type() == x.element_type() && y.element_count() == x.element_count();
  };
  auto row = [&](const ffi::AnyBuffer& y) {
    return y.element_type() == x.element_type() && y.dimensions().size() == 1 && (uint64_t)y.dimensions()[0] == width;
  };
  if (!like_x(b[1]) || !row(b[2]) || (bias && !row(b[3])) || !like_x(**normed) || !like_x(**hidden))
    return ffi::Error::InvalidArgument(kWhat);
  c.p.in = x.untyped_data();
  c.p.out = (*hidden)->untyped_data();
  c.p.count = x.element_count();
  c.p.bytes = x.size_bytes();
  c.p.dtype = *dtype;
  c.norm.residual = b[1].untyped_data();
  c.norm.weight = b[2].untyped_data();
  c.norm.bias = bias ? b[3].untyped_data() : nullptr;
  c.norm.normed = (*normed)->untyped_data();
  c.norm.width = width;
  c.norm.eps = *eps;
  c.norm.kind = kind ? NormKind::kLayer : NormKind::kRms;
  return ffi::Error::Success();
}

// The bytes of one row of a fused call, for the plan.
inline uint64_t row_bytes(const AddNormCall& c) { return c.norm.width * dtype_size(c.p.dtype); }

// The binding of all_gather and psum_scatter, which take the same operands
// and attributes on both platforms; `bind` is Ffi::Bind() with the
// platform's own context before them (CUDA: the stream).
template <typename Binding>
auto bulk_collective_binding(Binding bind) {
  return std::move(bind)
      .template Ctx<ffi::DeviceOrdinal>()    // device_ordinal
      .RemainingArgs()                       // x[0..n), then dependency operands
      .RemainingRets()                       // y[0..n)
      .template Attr<int64_t>("comm_id")     // comm_id
      .template Attr<int64_t>("site")        // site: the call site's tag
      .template Attr<int64_t>("dimension");  // dimension: x's axis gathered along, or scattered along
}

// The rows of the gathered / scattered dimension (host/device_side.h): the
// product of x's first `dimension` sizes. With `dimension` = d, x viewed as
// [outer][rest] gathers into [outer][world][rest] (all_gather along d,
// tiled or not) and scatters from [outer][world][rest / world]
// (psum_scatter along d).
inline ffi::Error outer_rows(const ffi::AnyBuffer& x, int64_t dimension, uint64_t& outer) {
  const auto dims = x.dimensions();
  if (dimension < 0 || dimension > (int64_t)dims.size())
    return ffi::Error::InvalidArgument(
        strf("jax_arx: dimension %lld of a rank-%zu operand", (long long)dimension, dims.size()));
  outer = 1;
  for (int64_t d = 0; d < dimension; ++d) outer *= (uint64_t)dims[d];
  if (outer == 0) outer = 1;  // no elements: any row count describes them
  return ffi::Error::Success();
}

// Pair i of a bulk call, x_i -> y_i, checked as both platforms' handlers
// check it: all_gather (`gather`): y has x's dtype and world times its
// bytes; psum_scatter: x has a reducing dtype, y has its dtype and 1/world of
// its elements. `outer`: the rows of the gathered / scattered dimension
// (outer_rows), which must divide x's part.
struct BulkPair {
  const void* in = nullptr;
  void* out = nullptr;
  uint64_t in_bytes = 0, out_count = 0, outer = 1;
  ffi::DataType type{};
  std::optional<DType> dtype;  // the reducing type; for all_gather, nullopt if x has none
};

inline ffi::Error bulk_pair(bool gather, ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t i, uint64_t world,
                            int64_t dimension, BulkPair& p) {
  const char* op = gather ? "all_gather" : "psum_scatter";
  auto x = args.get<ffi::AnyBuffer>(i);
  auto y = rets.get<ffi::AnyBuffer>(i);
  if (x.has_error()) return x.error();
  if (y.has_error()) return y.error();
  p.in = x->untyped_data();
  p.out = (*y)->untyped_data();
  p.in_bytes = x->size_bytes();
  p.out_count = (*y)->element_count();
  p.type = x->element_type();
  p.dtype = dtype_of(p.type);
  if (!gather && !p.dtype)
    return ffi::Error::InvalidArgument("jax_arx.psum_scatter: takes float32, bfloat16 or float16");
  const bool shaped =
      gather ? (*y)->size_bytes() == world * x->size_bytes() : (*y)->element_count() * world == x->element_count();
  if ((*y)->element_type() != p.type || !shaped)
    return ffi::Error::InvalidArgument(
        strf("jax_arx.%s: result %zu must have its operand's dtype and %s%llu %s its "
             "elements",
             op, i, gather ? "" : "1/", (unsigned long long)world, gather ? "times" : "of"));
  if (ffi::Error e = outer_rows(*x, dimension, p.outer); e.failure()) return e;
  const uint64_t part = gather ? p.in_bytes : p.out_count;
  if (part % p.outer)
    return ffi::Error::InvalidArgument(
        strf("jax_arx.%s: operand %zu does not split into %llu rows along dimension "
             "%lld",
             op, i, (unsigned long long)p.outer, (long long)dimension));
  return ffi::Error::Success();
}

// The fused MoE combine's operands (base/combine.h), checked: y [R, H]
// (bf16, or e4m3 when `scaled`), then y_scale [R, H / 128] f32 when
// `scaled`, pos [T, topk] s32, w [T, topk] f32, shared [T, H] bf16, then
// dependency operands; the result [Tpad / world, H] bf16. The same on both
// platforms.
inline ffi::Error moe_operands(ffi::RemainingArgs& args, const ffi::AnyBuffer& out, bool scaled, uint64_t world,
                               MoeCombine& m) {
  const size_t n = scaled ? 5 : 4;
  if (args.size() < n)
    return ffi::Error::InvalidArgument(
        strf("jax_arx.moe_combine_psum_scatter: %zu operands, expected at least %zu", args.size(), n));
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
  const bool ok = dims(y, R, H) && dims(pos, T, K) && dims(w, T2, K2) && dims(shared, T3, H3) && dims(out, O, H4) &&
                  T2 == T && K2 == K && T3 == T && H3 == H && H4 == H &&
                  y.element_type() == (scaled ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16) &&
                  pos.element_type() == ffi::DataType::S32 && w.element_type() == ffi::DataType::F32 &&
                  shared.element_type() == ffi::DataType::BF16 && out.element_type() == ffi::DataType::BF16;
  if (!ok)
    return ffi::Error::InvalidArgument(
        "jax_arx.moe_combine_psum_scatter: expected y [R, H] bf16 (or float8_e4m3fn with y_scale [R, H / 128] "
        "float32), pos [T, topk] int32, w [T, topk] float32, shared [T, H] bfloat16 and a [Tpad / world, H] "
        "bfloat16 result");
  if (scaled) {
    int64_t R5, S5;
    if (!dims(b[1], R5, S5) || R5 != R || H % 128 || S5 != H / 128 || b[1].element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument(
          "jax_arx.moe_combine_psum_scatter: y_scale must be [R, H / 128] float32, "
          "with H a multiple of 128");
  }
  m.y = y.untyped_data();
  m.y_scale = scaled ? static_cast<const float*>(b[1].untyped_data()) : nullptr;
  m.pos = static_cast<const int32_t*>(pos.untyped_data());
  m.w = static_cast<const float*>(w.untyped_data());
  m.shared = static_cast<const uint16_t*>(shared.untyped_data());
  m.rows = (uint64_t)R;
  m.tokens = (uint64_t)T;
  m.padded = (uint64_t)O * world;
  m.hidden = (uint64_t)H;
  m.topk = (uint64_t)K;
  if (m.tokens > m.padded || (m.rows == 0 && m.tokens && m.topk))
    return ffi::Error::InvalidArgument(
        strf("jax_arx.moe_combine_psum_scatter: %llu tokens, %llu padded rows, %llu "
             "expert rows: the padded rows must be at least the tokens, and pos needs "
             "expert rows to point at",
             (unsigned long long)m.tokens, (unsigned long long)m.padded, (unsigned long long)m.rows));
  return ffi::Error::Success();
}

}  // namespace arx::xla

XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_add_norm_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_all_gather_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_scatter_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_after_host);
