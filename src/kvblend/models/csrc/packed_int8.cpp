// kvblend's int8 decode linear in one call: what models/packed.py's PackedWeight does around
// FBGEMM's dynamically quantized linear, without a dozen small tensor ops dispatched from
// Python for each matmul (they cost as much as the matmul at a decode step's shapes).
//
// For x (R, in) fp32: each row scaled to max |x| = 1; the input to FBGEMM is those R rows, then
// R rows of what FBGEMM's 7-bit grid over [-1, 1] rounds away from them (times 127: at most
// half a step of 2/127), then a pinned row (+1, 0, ..., 0, -1) that fixes the range at
// [-1, 1] whatever the other rows hold. The result row r is (out[r] + out[R + r] / 127) *
// max|x[r]| (+ bias). The same arithmetic as PackedWeight.int8_linear_ops, in float32.
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

constexpr float kSteps = 63.5f;  // FBGEMM's grid over the pinned range [-1, 1]: 127 steps

at::Tensor int8_linear(const at::Tensor& x, const c10::intrusive_ptr<LinearPackedParamsBase>& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "int8_linear takes a 2-d float32 CPU input");
  const at::Tensor in = x.contiguous();
  const int64_t rows = in.size(0), width = in.size(1);
  TORCH_CHECK(width >= 2, "int8_linear needs at least 2 input features (the pinned row)");
  at::Tensor stacked = at::zeros({2 * rows + 1, width}, in.options());
  const float* src = in.const_data_ptr<float>();
  float* dst = stacked.mutable_data_ptr<float>();
  std::vector<float> norms(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = src + r * width;
    float norm = 0.f;
    for (int64_t j = 0; j < width; ++j) norm = std::max(norm, std::fabs(row[j]));
    norm = std::max(norm, 1e-30f);
    norms[r] = norm;
    float* hi = dst + r * width;
    float* lo = dst + (rows + r) * width;
    for (int64_t j = 0; j < width; ++j) {
      const float h = row[j] / norm;
      const float scaled = h * kSteps;
      hi[j] = h;
      lo[j] = (scaled - std::nearbyint(scaled)) * 2.f;
    }
  }
  float* pin = dst + 2 * rows * width;
  pin[0] = 1.f;
  pin[width - 1] = -1.f;
  const at::Tensor out = packed->apply_dynamic(stacked, /*reduce_range=*/true).contiguous();
  const int64_t outs = out.size(1);
  at::Tensor y = at::empty({rows, outs}, in.options());
  const float* o = out.const_data_ptr<float>();
  float* dst_y = y.mutable_data_ptr<float>();
  const float* b = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.numel() == outs && bias_c.scalar_type() == at::kFloat, "bias must be float32 of the output width");
    b = bias_c.const_data_ptr<float>();
  }
  const float inv127 = 1.f / 127.f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* hi = o + r * outs;
    const float* lo = o + (rows + r) * outs;
    float* yr = dst_y + r * outs;
    for (int64_t j = 0; j < outs; ++j) {
      float v = (hi[j] + lo[j] * inv127) * norms[r];
      yr[j] = b ? v + b[j] : v;
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(kvblend_packed, m) {
  m.def("int8_linear(Tensor x, __torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor? bias) -> Tensor",
        &int8_linear);
}
