// The fused psum's epilogue on the host (base/norm.h): the same operations
// in the same order as the CUDA side's, so both give the same bits.

#include "base/norm.h"
#include "host/convert.h"
#include "host/device_side.h"

namespace arx::host {
namespace {

template <typename E>
void rows(uint64_t count, uint8_t* hidden, const AddNorm& n) {
  constexpr uint64_t esize = E::kSize;
  constexpr auto load = E::load;
  constexpr auto store = E::store;
  const uint8_t* res = static_cast<const uint8_t*>(n.residual);
  const uint8_t* w = static_cast<const uint8_t*>(n.weight);
  const uint8_t* b = static_cast<const uint8_t*>(n.bias);
  uint8_t* normed = static_cast<uint8_t*>(n.normed);
  const uint64_t width = n.width, nrows = width ? count / width : 0;
  float lanes[kNormLanes];
  // The pairwise sum of the lanes, halving (base/norm.h).
  auto tree = [&] {
    for (int stride = kNormLanes / 2; stride > 0; stride /= 2)
      for (int j = 0; j < stride; ++j) lanes[j] = norm_add(lanes[j], lanes[j + stride]);
    return lanes[0];
  };
  for (uint64_t row = 0; row < nrows; ++row) {
    uint8_t* h = hidden + row * width * esize;
    const uint8_t* r = res + row * width * esize;
    uint8_t* o = normed + row * width * esize;
    // hidden = psum + residual, rounded; the first sum over it. Walking the
    // row in order, element e goes to lane e % kNormLanes: each lane still
    // adds its elements in order from 0, as base/norm.h says.
    for (float& l : lanes) l = 0.f;
    for (uint64_t e = 0; e < width; ++e) {
      store(h + e * esize, norm_add(load(h + e * esize), load(r + e * esize)));
      const float v = load(h + e * esize);
      float& l = lanes[e % kNormLanes];
      l = norm_add(l, n.kind == NormKind::kLayer ? v : norm_mul(v, v));
    }
    float mean = 0.f, stat = tree();
    if (n.kind == NormKind::kLayer) {
      mean = norm_mean(stat, width);
      for (float& l : lanes) l = 0.f;
      for (uint64_t e = 0; e < width; ++e) {
        float& l = lanes[e % kNormLanes];
        l = norm_add(l, norm_term(n.kind, load(h + e * esize), mean));
      }
      stat = tree();
    }
    const float scale = norm_scale(stat, width, n.eps);
    for (uint64_t e = 0; e < width; ++e) {
      const float bias = b ? load(b + e * esize) : 0.f;
      store(o + e * esize,
            norm_out(n.kind, load(h + e * esize), mean, scale, load(w + e * esize), b ? &bias : nullptr));
    }
  }
}

}  // namespace

void add_norm(DType dtype, void* hidden, uint64_t count, const AddNorm& n) {
  with_element(dtype, [&](auto e) { rows<decltype(e)>(count, static_cast<uint8_t*>(hidden), n); });
}

}  // namespace arx::host
