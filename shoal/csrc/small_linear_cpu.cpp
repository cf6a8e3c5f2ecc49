// y = x W^T (+ b) for a few rows of x on the CPU: the decode step of a small batch.
//
// Why: for 1-4 rows a linear layer is a matrix-vector product bound by reading W once, and
// torch's CPU matmul reads it at 7-12 GB/s on a Zen 3 host whose cores stream 32 GB/s; in
// bfloat16 without a native bf16 matmul (AVX-512 BF16, AMX) it manages about 1 GFLOP/s.
// Here each output feature's weight row is read once for all the rows of x, converted to fp32
// in registers, with several independent FMA chains; output features are split over the
// threads. Accumulation in fp32, rounded once to the output dtype.
//
// Portability: 8-float vectors (AVX2 registers; the baseline build splits them), cloned for
// x86-64-v3 and the baseline (see cpu_common.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace shoal_cpu;

constexpr int64_t kMaxRows = 8;  // rows of x per call (more: a matmul's job)
constexpr int kChains = 4;       // independent accumulators per row of x (FMA latency)

SHOAL_INLINE float hsum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Output features [n0, n1): x is fp32 [M, k] (converted once), w [N, k] row-major.
template <typename T, int M>
SHOAL_INLINE void features(const float* x, const T* w, const T* bias, T* y, int64_t k,
                           int64_t n0, int64_t n1, int64_t y_stride) {
  constexpr int64_t kStep = 8 * kChains;
  const int64_t body = k - k % kStep;
  for (int64_t n = n0; n < n1; ++n) {
    const T* row = w + n * k;
    V8 acc[M][kChains] = {};
    for (int64_t i = 0; i < body; i += kStep) {
      for (int c = 0; c < kChains; ++c) {
        const V8 wv = load8(row + i + 8 * c);
        for (int m = 0; m < M; ++m) acc[m][c] += wv * load8(x + m * k + i + 8 * c);
      }
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]));
      for (int64_t i = body; i < k; ++i) s += to_f32(row[i]) * x[m * k + i];
      if (bias != nullptr) s += to_f32(bias[n]);
      store(y + m * y_stride + n, s);
    }
  }
}

template <typename T, int M>
SHOAL_CLONES void run_rows(const float* x, const T* w, const T* bias, T* y, int64_t k,
                           int64_t n0, int64_t n1, int64_t y_stride) {
  features<T, M>(x, w, bias, y, k, n0, n1, y_stride);
}

template <typename T>
void run(const float* x, const T* w, const T* bias, T* y, int64_t m, int64_t k, int64_t n0,
         int64_t n1, int64_t y_stride) {
  switch (m) {
#define SHOAL_ROWS(R) \
  case R:             \
    return run_rows<T, R>(x, w, bias, y, k, n0, n1, y_stride);
    SHOAL_ROWS(1) SHOAL_ROWS(2) SHOAL_ROWS(3) SHOAL_ROWS(4)
    SHOAL_ROWS(5) SHOAL_ROWS(6) SHOAL_ROWS(7) SHOAL_ROWS(8)
#undef SHOAL_ROWS
  }
}

void small_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  for (const at::Tensor* t : {&out, &x, &weight})
    TORCH_CHECK(t->device().is_cpu(), "small_linear: CPU tensors only");
  const auto dt = weight.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "small_linear: float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == dt && out.scalar_type() == dt,
              "x, weight and out must share a dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be contiguous [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1) && x.size(0) >= 1 &&
                  x.size(0) <= kMaxRows,
              "x must be [M, K] with 1 <= M <= ", kMaxRows);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0) &&
                  out.stride(1) == 1,
              "out must be [M, N] with a contiguous last dim");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == dt && bias->is_contiguous() &&
                    bias->numel() == weight.size(0),
                "bias must be contiguous [N] of the weight's dtype");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  // x as fp32 [M, K], contiguous: read once per weight row, so converted once here.
  const at::Tensor xc = x.contiguous();
  std::vector<float> xf;
  const float* xp = nullptr;
  if (dt == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xf.resize(static_cast<size_t>(m * k));
    const uint16_t* src = static_cast<const uint16_t*>(xc.data_ptr());
    for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_f32(src[i]);
    xp = xf.data();
  }
  const int64_t y_stride = out.stride(0);
  // Blocks of 64 features: each thread streams a contiguous stretch of W.
  at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
    if (dt == at::kFloat) {
      run<float>(xp, weight.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
                 out.data_ptr<float>(), m, k, n0, n1, y_stride);
    } else {
      run<uint16_t>(xp, static_cast<const uint16_t*>(weight.data_ptr()),
                    has_bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr,
                    static_cast<uint16_t*>(out.data_ptr()), m, k, n0, n1, y_stride);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("small_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) { m.impl("small_linear", &small_linear); }
