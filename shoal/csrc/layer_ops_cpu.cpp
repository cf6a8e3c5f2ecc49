// The small ops of a decoder layer on the CPU, each one pass over its rows: RMSNorm (with the
// residual add fused), SiLU(gate) * up, neox rotary embedding in place, and the KV cache
// write.
//
// Why: written as torch ops, a bf16 RMSNorm is seven ops (a float copy, pow, mean, add,
// rsqrt, mul, a bf16 copy, mul), the rotary embedding eight, each a full pass over the
// activations with its own allocation and dispatch. A 14k-token prefill of SmolLM2 spent
// 10 s of 18 in them (2 cores), more than in its matmuls, and a batch-1 decode step pays
// their dispatch 30 times over. Each op here reads its input once and writes its output once.
//
// Rounding follows the torch reference paths (shoal/layers/norm.py, activation.py,
// rotary.py): every intermediate that torch holds in the activation dtype is rounded to it
// here too, so bf16 results match to the last bit except where a float sum or exp differs in
// its last float bit before that rounding.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace shoal_cpu;

constexpr int64_t kGrainElements = 16384;  // below this many elements a call stays on one thread

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1));
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, name,
              " must be float32 or bfloat16");
}

// ---- RMSNorm ------------------------------------------------------------------------------
// Rows are addressed as [a, b] with strides (sa, sb): a 2-D [T, H] tensor is b = 1, the
// per-head norm of a [T, heads, D] view (q and k of a fused qkv output) is a = T, b = heads.
struct Rows {
  int64_t a, b, sa, sb;
  int64_t count() const { return a * b; }
  int64_t offset(int64_t i) const { return (i / b) * sa + (i % b) * sb; }
};

Rows rows_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "expected a 2-D or 3-D tensor");
  TORCH_CHECK(t.stride(-1) == 1, "the last dim must be contiguous");
  if (t.dim() == 2) return {t.size(0), 1, t.stride(0), 0};
  return {t.size(0), t.size(1), t.stride(0), t.stride(1)};
}

constexpr int64_t kLanes = 16;  // partial sums of squares: a float sum only vectorises split

// residual (when given) <- x + residual, rounded to T; out <- round(norm(that)) * weight.
// out may be x itself (the in-place fused form).
template <typename T>
SHOAL_CLONES void norm_rows(const T* x, Rows xr, T* res, Rows rr, T* out, Rows orows,
                            const T* w, int64_t h, float eps, int64_t begin, int64_t end) {
  std::vector<float> buf(h);
  float* b = buf.data();
  for (int64_t i = begin; i < end; ++i) {
    const T* xi = x + xr.offset(i);
    T* oi = out + orows.offset(i);
    if (res != nullptr) {
      T* ri = res + rr.offset(i);
      for (int64_t j = 0; j < h; ++j) {
        const float s = round_to<T>(to_f32(xi[j]) + to_f32(ri[j]));
        store(ri + j, s);
        b[j] = s;
      }
    } else {
      for (int64_t j = 0; j < h; ++j) b[j] = to_f32(xi[j]);
    }
    float part[kLanes] = {};
    const int64_t body = h - h % kLanes;
    for (int64_t j = 0; j < body; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) part[l] += b[j + l] * b[j + l];
    float acc = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) acc += part[l];
    for (int64_t j = body; j < h; ++j) acc += b[j] * b[j];
    const float rstd = 1.0f / std::sqrt(acc / static_cast<float>(h) + eps);
    for (int64_t j = 0; j < h; ++j) store(oi + j, round_to<T>(b[j] * rstd) * to_f32(w[j]));
  }
}

template <typename T>
void norm_dispatch(const at::Tensor& out, const at::Tensor& x, const at::Tensor* residual,
                   const at::Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  const Rows xr = rows_of(x), orows = rows_of(out);
  const Rows rr = residual != nullptr ? rows_of(*residual) : Rows{0, 1, 0, 0};
  T* res = residual != nullptr ? static_cast<T*>(residual->data_ptr()) : nullptr;
  const T* xp = static_cast<const T*>(x.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const T* wp = static_cast<const T*>(weight.data_ptr());
  at::parallel_for(0, xr.count(), grain_rows(h), [&](int64_t begin, int64_t end) {
    norm_rows<T>(xp, xr, res, rr, op, orows, wp, h, static_cast<float>(eps), begin, end);
  });
}

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  check_float(x, "x");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, out and weight must share a dtype");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight must be contiguous [hidden]");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  if (is_bf16(x)) return norm_dispatch<uint16_t>(out, x, nullptr, weight, eps);
  norm_dispatch<float>(out, x, nullptr, weight, eps);
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  check_norm(x, x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  TORCH_CHECK(x.data_ptr() != residual.data_ptr(), "x and residual must be distinct buffers");
  if (is_bf16(x)) return norm_dispatch<uint16_t>(x, x, &residual, weight, eps);
  norm_dispatch<float>(x, x, &residual, weight, eps);
}

// ---- SiLU(gate) * up ----------------------------------------------------------------------
template <typename T>
SHOAL_CLONES void silu_mul_rows(const T* x, int64_t sx, T* out, int64_t so, int64_t d,
                                int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const T* g = x + i * sx;
    const T* u = g + d;
    T* o = out + i * so;
    for (int64_t j = 0; j < d; ++j) {
      const float gv = to_f32(g[j]);
      const float s = round_to<T>(gv / (1.0f + exp_clamped(-gv)));  // F.silu in T
      store(o + j, s * to_f32(u[j]));
    }
  }
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "x and out must be 2-D with contiguous rows");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(1) == x.size(1) / 2 && out.size(0) == x.size(0),
              "out must be [T, x.size(1) / 2]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "x and out must share a dtype");
  const int64_t d = out.size(1);
  at::parallel_for(0, x.size(0), grain_rows(d), [&](int64_t begin, int64_t end) {
    if (is_bf16(x))
      silu_mul_rows(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                    static_cast<uint16_t*>(out.data_ptr()), out.stride(0), d, begin, end);
    else
      silu_mul_rows(static_cast<const float*>(x.data_ptr()), x.stride(0),
                    static_cast<float*>(out.data_ptr()), out.stride(0), d, begin, end);
  });
}

// ---- rotary embedding (neox: the halves of the first rot_dim dims rotate as pairs) -------
// cos_sin: [max_pos, rot_dim] float32, cos of the rot_dim / 2 frequencies then their sin.
template <typename T>
SHOAL_CLONES void rotate_heads(T* x, int64_t sh, int64_t heads, const float* cs,
                               int64_t half) {
  const float* cos = cs;
  const float* sin = cs + half;
  for (int64_t h = 0; h < heads; ++h) {
    T* a = x + h * sh;
    T* b = a + half;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = to_f32(a[j]), x2 = to_f32(b[j]);
      store(a + j, x1 * cos[j] + x2 * -sin[j]);
      store(b + j, x2 * cos[j] + x1 * sin[j]);
    }
  }
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos_sin, int64_t rot_dim) {
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) &&
                  q.scalar_type() == k.scalar_type(),
              "q and k must be [T, heads, head_dim] of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "the head dim must be contiguous");
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= q.size(2) && rot_dim <= k.size(2),
              "rot_dim must be even and at most the head dim");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == rot_dim && cos_sin.is_contiguous(),
              "cos_sin_cache must be contiguous float32 [max_pos, rot_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == q.size(0) && positions.is_contiguous(),
              "positions must be contiguous int64 [T]");
  const int64_t t = q.size(0), max_pos = cos_sin.size(0), half = rot_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " outside the table of ",
                max_pos);
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t per_token = (q.size(1) + k.size(1)) * rot_dim;
  at::parallel_for(0, t, grain_rows(per_token), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = cs + pos[i] * rot_dim;
      if (is_bf16(q)) {
        rotate_heads(static_cast<uint16_t*>(q.data_ptr()) + i * q.stride(0), q.stride(1),
                     q.size(1), row, half);
        rotate_heads(static_cast<uint16_t*>(k.data_ptr()) + i * k.stride(0), k.stride(1),
                     k.size(1), row, half);
      } else {
        rotate_heads(static_cast<float*>(q.data_ptr()) + i * q.stride(0), q.stride(1),
                     q.size(1), row, half);
        rotate_heads(static_cast<float*>(k.data_ptr()) + i * k.stride(0), k.stride(1),
                     k.size(1), row, half);
      }
    }
  });
}

// ---- KV cache write -----------------------------------------------------------------------
// key/value [T, Hk, D] (views of the qkv output: any token and head strides) into their
// slots of key_cache / value_cache [slots, Hk, D]; a negative slot is a padding token.
void write_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [T, Hk, D]");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  key_cache.size(1) == key.size(1) && key_cache.size(2) == key.size(2),
              "the caches must be contiguous [slots, Hk, D] matching key");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "keys, values and caches must share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "the head dim must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t t = key.size(0), hk = key.size(1), d = key.size(2);
  const int64_t slots = key_cache.size(0), elem = key.element_size();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(slot[i] < slots, "slot ", slot[i], " is outside the cache's ", slots);
  const char* src[2] = {static_cast<const char*>(key.data_ptr()),
                        static_cast<const char*>(value.data_ptr())};
  char* dst[2] = {static_cast<char*>(key_cache.data_ptr()),
                  static_cast<char*>(value_cache.data_ptr())};
  const int64_t st[2] = {key.stride(0), value.stride(0)}, sh[2] = {key.stride(1), value.stride(1)};
  at::parallel_for(0, t, grain_rows(2 * hk * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slot[i] < 0) continue;
      for (int p = 0; p < 2; ++p) {
        char* row = dst[p] + slot[i] * hk * d * elem;
        const char* in = src[p] + i * st[p] * elem;
        if (sh[p] == d) {
          std::memcpy(row, in, hk * d * elem);
        } else {
          for (int64_t h = 0; h < hk; ++h)
            std::memcpy(row + h * d * elem, in + h * sh[p] * elem, d * elem);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, "
        "int rot_dim) -> ()");
  m.def("write_kv_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, "
        "Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("write_kv_cache", &write_kv_cache);
}
