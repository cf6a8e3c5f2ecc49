// The decode step of a linear-attention layer (Gated DeltaNet, Kimi Delta Attention) on the
// CPU, in one call per layer: the short causal conv + SiLU with its state's window moved on,
// q and k L2-normed, the gated delta rule on the fp32 state, o = scale q^T S. The states are
// read from and written to their pages of the KV pool in place (shoal/attention/
// linear_state.py: a state is a run of float32 words over a block's planes, the conv state
// [C, K-1] first, then the delta-rule state [H, Dk, Dv]).
//
// Why: written as torch ops (LinearAttention._decodes), a step gathers every row's state
// (index_select), decays it, updates it and concatenates it with the conv state before
// scattering it back (index_copy_): about a dozen passes over 1 MiB per request and layer at
// 16 heads of 128 x 128. On 2 cores that was 24-49% of a bf16 decode step of a 12-layer
// Qwen3.5-shaped model (benchmarks/hybrid_cpu_profile.py). Here each state is read once,
// updated in a per-thread buffer that stays in L2 and written once.
//
// Rounding follows the torch reference (shoal/layers/ops/gated_delta_rule.py and the layers'
// mix()): the conv output is rounded to the activation dtype before q, k and v are taken from
// it; everything after is float32. Sums run in another order than torch's, so results agree
// to float rounding, not bit for bit.
//
// Rows must not share a write block with another row's read block (distinct requests never
// do: a request writes only blocks it alone holds), as for the CUDA kernels of the same step.

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

// Where word w of a block's state lies: plane w / per_plane, at
// block * block_stride + plane * plane_stride + w % per_plane (the words are float32).
struct Pages {
  float* words;
  int64_t per_plane, plane_stride, block_stride;

  float* at(int64_t block, int64_t w) const {
    return words + block * block_stride + (w / per_plane) * plane_stride + w % per_plane;
  }
  // Words [w, w + n) of a block, in contiguous pieces (a run may cross into the next plane).
  template <typename F>
  void pieces(int64_t block, int64_t w, int64_t n, F&& f) const {
    for (int64_t done = 0; done < n;) {
      const int64_t m = std::min(n - done, per_plane - (w + done) % per_plane);
      f(at(block, w + done), done, m);
      done += m;
    }
  }
  void read(int64_t block, int64_t w, int64_t n, float* dst) const {
    pieces(block, w, n, [&](float* p, int64_t at, int64_t m) {
      std::memcpy(dst + at, p, m * sizeof(float));
    });
  }
  void write(int64_t block, int64_t w, int64_t n, const float* src) const {
    pieces(block, w, n, [&](float* p, int64_t at, int64_t m) {
      std::memcpy(p, src + at, m * sizeof(float));
    });
  }
};

struct Shape {
  int64_t rows, channels, kernel, heads, key_heads, dk, dv;
  int64_t conv_words() const { return channels * (kernel - 1); }
};

SHOAL_INLINE float silu(float x) { return x / (1.0f + std::exp(-x)); }

constexpr int64_t kConvChunk = 512;  // channels per conv task

// y[b, c] = round_T(silu(bias + sum_t w[c, t] window[t])), window = the state's K-1 inputs
// then x; the state of block write[b] gets the window's last K-1.
template <typename T>
SHOAL_CLONES void conv_rows(const Pages& pages, const Shape& s, const T* x, int64_t sx,
                            const T* w, const T* bias, const int64_t* read,
                            const int64_t* write, float* y, int64_t begin, int64_t end) {
  const int64_t km = s.kernel - 1;
  const int64_t chunks = (s.channels + kConvChunk - 1) / kConvChunk;
  std::vector<float> win(kConvChunk * km);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / chunks;
    const int64_t c0 = (task % chunks) * kConvChunk;
    const int64_t n = std::min(kConvChunk, s.channels - c0);
    pages.read(read[b], c0 * km, n * km, win.data());
    for (int64_t c = 0; c < n; ++c) {
      float* state = win.data() + c * km;
      const T* wc = w + (c0 + c) * s.kernel;
      const float xv = to_f32(x[b * sx + c0 + c]);
      float acc = 0.f;
      for (int64_t t = 0; t < km; ++t) {
        state[t] = round_to<T>(state[t]);  // the torch path takes the state in T
        acc += state[t] * to_f32(wc[t]);
      }
      acc += xv * to_f32(wc[km]);
      if (bias != nullptr) acc += to_f32(bias[c0 + c]);
      y[b * s.channels + c0 + c] = round_to<T>(silu(acc));
      for (int64_t t = 0; t + 1 < km; ++t) state[t] = state[t + 1];
      if (km > 0) state[km - 1] = xv;
    }
    pages.write(write[b], c0 * km, n * km, win.data());
  }
}

// 1 / ||x|| as the layer's qk_norm takes it: x * rsqrt(sum + eps) (Gated DeltaNet) or
// x / sqrt(sum + eps) (KDA, as fla's and transformers' reference round).
SHOAL_CLONES void l2_norm(const float* x, float* out, int64_t n, bool divide) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
  const float r = std::sqrt(acc + 1e-6f);
  if (divide) {
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] / r;
  } else {
    const float inv = 1.0f / r;
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
  }
}

// The delta rule of task (b, h): buf holds S [dk, dv]; q, k normed; v the value row.
// S = diag(decay) S; delta = beta (v - k^T S); S += k delta^T; o = scale q^T S.
SHOAL_CLONES void delta_rule(float* S, const float* q, const float* k, const float* v,
                             const float* decay, bool per_channel, float beta, float scale,
                             int64_t dk, int64_t dv, float* kv, float* o) {
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float d = per_channel ? decay[i] : decay[0];
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= d;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    kv[j] = beta * (v[j] - kv[j]);  // now delta
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * kv[j];
      o[j] += qi * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] *= scale;
}

void rule_tasks(const Pages& pages, const Shape& s, const float* y, const float* g,
                bool per_channel, const float* beta, const int64_t* read,
                const int64_t* write, float scale, bool divide, float* o, int64_t begin,
                int64_t end) {
  const int64_t words = s.dk * s.dv, r = s.heads / s.key_heads;
  std::vector<float> buf(words + 4 * s.dk + s.dv);
  float* S = buf.data();
  float* q = S + words;
  float* k = q + s.dk;
  float* decay = k + s.dk;  // dk (per channel) or 1
  float* kv = decay + s.dk;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / s.heads, h = task % s.heads, kh = h / r;
    const float* yb = y + b * s.channels;
    l2_norm(yb + kh * s.dk, q, s.dk, divide);
    l2_norm(yb + (s.key_heads + kh) * s.dk, k, s.dk, divide);
    const float* v = yb + 2 * s.key_heads * s.dk + h * s.dv;
    const int64_t nd = per_channel ? s.dk : 1;
    const float* gb = g + (b * s.heads + h) * nd;
    for (int64_t i = 0; i < nd; ++i) decay[i] = std::exp(gb[i]);
    const int64_t w0 = s.conv_words() + h * words;
    pages.read(read[b], w0, words, S);
    delta_rule(S, q, k, v, decay, per_channel, beta[b * s.heads + h], scale, s.dk, s.dv, kv,
               o + (b * s.heads + h) * s.dv);
    pages.write(write[b], w0, words, S);
  }
}

void check_blocks(const at::Tensor& t, const char* name, int64_t rows, int64_t blocks) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == rows &&
                  t.is_contiguous() && t.device().is_cpu(),
              name, " must be contiguous CPU int64 [rows]");
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < blocks, name, " block ", p[i], " is outside [0, ", blocks,
                ")");
}

// words: the float32 view [planes, blocks, per_plane] of the cache; o: float32 [B, H, Dv];
// x: [B, C] (C = 2 Hk Dk + H Dv, q | k | v) bf16 or float32; conv_weight [C, K] and bias [C]
// in x's dtype; g float32 [B, H] or [B, H, Dk] (log decay); beta float32 [B, H].
void linear_state_decode(const at::Tensor& words, const at::Tensor& o, const at::Tensor& x,
                         const at::Tensor& conv_weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& g, const at::Tensor& beta, const at::Tensor& read,
                         const at::Tensor& write, int64_t key_dim, int64_t value_dim,
                         double scale, bool divide_norm) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU [rows, channels] tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be float32 or bfloat16");
  TORCH_CHECK(words.scalar_type() == at::kFloat && words.dim() == 3 && words.stride(2) == 1,
              "words must be the float32 [planes, blocks, per_plane] view of the cache");
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.dim() == 2 && beta.is_contiguous() &&
                  beta.size(0) == x.size(0),
              "beta must be contiguous float32 [rows, heads]");
  Shape s{x.size(0), x.size(1), conv_weight.size(1), beta.size(1), 0, key_dim, value_dim};
  TORCH_CHECK(s.kernel >= 1 && conv_weight.dim() == 2 && conv_weight.size(0) == s.channels &&
                  conv_weight.is_contiguous() && conv_weight.scalar_type() == x.scalar_type(),
              "conv_weight must be contiguous [channels, kernel] in x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == s.channels && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "conv_bias must be contiguous [channels] in x's dtype");
  const int64_t qk = s.channels - s.heads * s.dv;
  TORCH_CHECK(s.dk > 0 && s.dv > 0 && qk > 0 && qk % (2 * s.dk) == 0,
              "channels must be 2 * key_heads * key_dim + heads * value_dim");
  s.key_heads = qk / (2 * s.dk);
  TORCH_CHECK(s.heads % s.key_heads == 0, "heads must be a multiple of the key heads");
  const bool per_channel = g.dim() == 3;
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.size(0) == s.rows &&
                  g.size(1) == s.heads && (!per_channel || g.size(2) == s.dk) &&
                  (per_channel || g.dim() == 2),
              "g must be contiguous float32 [rows, heads] or [rows, heads, key_dim]");
  TORCH_CHECK(o.scalar_type() == at::kFloat && o.is_contiguous() && o.dim() == 3 &&
                  o.size(0) == s.rows && o.size(1) == s.heads && o.size(2) == s.dv,
              "o must be contiguous float32 [rows, heads, value_dim]");
  const int64_t planes = words.size(0), blocks = words.size(1);
  Pages pages{words.data_ptr<float>(), words.size(2), words.stride(0), words.stride(1)};
  TORCH_CHECK(s.conv_words() + s.heads * s.dk * s.dv <= planes * pages.per_plane,
              "a state does not fit a page of the cache");
  check_blocks(read, "read", s.rows, blocks);
  check_blocks(write, "write", s.rows, blocks);
  const int64_t* rd = read.data_ptr<int64_t>();
  const int64_t* wr = write.data_ptr<int64_t>();

  // The conv output in float32, each value rounded to x's dtype (what the torch path hands
  // the delta rule); its state windows move before the rule reads the delta-rule states.
  std::vector<float> y(s.rows * s.channels);
  const int64_t chunks = (s.channels + kConvChunk - 1) / kConvChunk;
  at::parallel_for(0, s.rows * chunks, 1, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kBFloat16) {
      conv_rows<uint16_t>(pages, s, static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                          static_cast<const uint16_t*>(conv_weight.data_ptr()),
                          bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr, rd,
                          wr, y.data(), begin, end);
    } else {
      conv_rows<float>(pages, s, x.data_ptr<float>(), x.stride(0),
                       conv_weight.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                       rd, wr, y.data(), begin, end);
    }
  });
  at::parallel_for(0, s.rows * s.heads, 1, [&](int64_t begin, int64_t end) {
    rule_tasks(pages, s, y.data(), g.data_ptr<float>(), per_channel, beta.data_ptr<float>(),
               rd, wr, static_cast<float>(scale), divide_norm, o.data_ptr<float>(), begin,
               end);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shoal_cpu, m) {
  m.def("linear_state_decode(Tensor(a!) words, Tensor(b!) o, Tensor x, Tensor conv_weight, "
        "Tensor? conv_bias, Tensor g, Tensor beta, Tensor read, Tensor write, int key_dim, "
        "int value_dim, float scale, bool divide_norm) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) { m.impl("linear_state_decode", &linear_state_decode); }
