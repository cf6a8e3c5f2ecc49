// Decode attention (one query token per sequence) over the paged KV cache, on the CPU.
//
// Why: the torch reference gathers every request's whole context out of the cache (a full
// copy of K and V per layer per step) before a padded, masked SDPA. Here each task, one
// sequence and a run of its KV heads, walks the sequence's block table and reads each key and
// value row of those heads exactly once, for all the query heads that share them (GQA), with
// an online softmax in fp32. Tasks are spread over OpenMP threads (torch's own pool: the same
// libgomp). With many sequences a task takes as many KV heads as its state holds: a block's
// rows are then read as one contiguous stretch instead of one head's slice of every row.
//
// Portability: built with plain -O3 (no -march), the hot loop is compiled for x86-64-v4
// (AVX-512, 16-float vectors), and for v3 (AVX2 + FMA) and the baseline with 8-float vectors
// (target_clones); the CPU's features pick one at run time, so one build runs on any x86-64
// and uses what the CPU has. 16-float vectors on an AVX2 CPU made GCC spill every one of them
// through the stack: 3.4x slower on a Zen 3 (15.7 against 4.7 ms for a layer at 64 x 600).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace shoal_cpu;

constexpr int64_t kTile = 16;        // keys per online-softmax update
constexpr int64_t kMaxGroup = 16;    // query heads per KV head
constexpr int64_t kMaxDim = 256;     // head dim
constexpr int kPrefetchTiles = 2;    // how far ahead rows are prefetched (measured: 1 and 4 slower)
constexpr float kNegBig = -1.0e30f;  // finite "-inf": exp(kNegBig - m) is ~0, never nan

struct Args {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int64_t* tables;
  const int64_t* lens;
  int64_t q_sb, q_sh, o_sb, o_sh;  // strides (elements) over sequence and head
  int64_t table_stride, kv_heads, group, dim, block_size, window;
  float scale;
};

// A cache row as fp32: fp32 rows are used in place, bf16 rows converted into buf.
SHOAL_INLINE const float* row_f32(const float* src, float*, int64_t) { return src; }
SHOAL_INLINE const float* row_f32(const uint16_t* src, float* buf, int64_t d) {
  for (int64_t i = 0; i < d; ++i) buf[i] = bf16_to_f32(src[i]);
  return buf;
}
SHOAL_INLINE float exp_nonpos(float x) { return exp_clamped(x); }  // x <= 0 here

template <typename V, typename W>
SHOAL_INLINE V part(const W& w, int half) {  // the low (0) or high (1) half of w
  V v;
  std::memcpy(&v, reinterpret_cast<const char*>(&w) + half * sizeof(V), sizeof v);
  return v;
}

// Wide: 16-float vectors (the AVX-512 build); narrow: 8-float ones (AVX2 and the baseline).
template <int64_t kDim, bool kWide>
SHOAL_INLINE float dot(const float* a, const float* b, int64_t d) {
  if constexpr (kDim % 16 == 0 && kDim > 0 && kWide) {
    V16 acc = load16(a) * load16(b);
    for (int64_t i = 16; i < kDim; i += 16) acc += load16(a + i) * load16(b + i);
    const V8 s8 = part<V8>(acc, 0) + part<V8>(acc, 1);
    const V4 s4 = part<V4>(s8, 0) + part<V4>(s8, 1);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  } else if constexpr (kDim % 16 == 0 && kDim > 0) {
    V8 acc0 = load8(a) * load8(b), acc1 = load8(a + 8) * load8(b + 8);
    for (int64_t i = 16; i < kDim; i += 16) {
      acc0 += load8(a + i) * load8(b + i);
      acc1 += load8(a + i + 8) * load8(b + i + 8);
    }
    const V8 s8 = acc0 + acc1;
    const V4 s4 = part<V4>(s8, 0) + part<V4>(s8, 1);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  } else {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
  }
}

// acc = acc * corr + sum_t p[t] * rows[t]; with a known head dim the accumulator is held in
// registers over the tile (GCC turns the plain loop into scalar code).
template <int64_t kDim, bool kWide>
SHOAL_INLINE void accumulate(float* acc, float corr, const float* p, const float* const* rows,
                             int64_t n, int64_t d) {
  if constexpr (kDim % 16 == 0 && kDim > 0 && kWide) {
    V16 r[kDim / 16];
    for (int64_t c = 0; c < kDim / 16; ++c) r[c] = load16(acc + 16 * c) * corr;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < kDim / 16; ++c) r[c] += p[t] * load16(rows[t] + 16 * c);
    std::memcpy(acc, r, sizeof r);
  } else if constexpr (kDim % 16 == 0 && kDim > 0) {
    V8 r[kDim / 8];
    for (int64_t c = 0; c < kDim / 8; ++c) r[c] = load8(acc + 8 * c) * corr;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < kDim / 8; ++c) r[c] += p[t] * load8(rows[t] + 8 * c);
    std::memcpy(acc, r, sizeof r);
  } else {
    for (int64_t i = 0; i < d; ++i) acc[i] *= corr;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < d; ++i) acc[i] += p[t] * rows[t][i];
  }
}

template <typename T>
SHOAL_INLINE void prefetch_rows(const T* k, const T* v, int64_t n, int64_t stride,
                                int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + t * stride) + byte);
      __builtin_prefetch(reinterpret_cast<const char*>(v + t * stride) + byte);
    }
  }
}

// Softmax state of one task: per query head the running max, sum and weighted values.
struct State {
  alignas(64) float q[kMaxGroup][kMaxDim];  // pre-scaled
  alignas(64) float acc[kMaxGroup][kMaxDim];
  alignas(64) float s[kMaxGroup][kTile];  // this tile's scores, then weights
  alignas(64) float kbuf[kTile][kMaxDim];
  alignas(64) float vbuf[kTile][kMaxDim];
  float m[kMaxGroup], l[kMaxGroup];
};

// Keys [pos, pos + n) of one block for KV heads [0, nkh) of the task (query heads
// [0, nkh * g) of its state): scores, online-softmax update, values. Loops run head by head
// over the tile's rows, so a head's query and accumulator stay in registers.
template <typename T, int64_t kDim, bool kWide>
SHOAL_INLINE void attend_tile(const Args& a, State& st, const T* k, const T* v, int64_t g,
                              int64_t nkh, int64_t n) {
  const int64_t d = kDim ? kDim : a.dim;
  const int64_t row_stride = a.kv_heads * d;
  const float* rows[kTile];
  for (int64_t j = 0; j < nkh; ++j) {
    for (int64_t t = 0; t < n; ++t)
      rows[t] = row_f32(k + t * row_stride + j * d, st.kbuf[t], d);
    for (int64_t h = j * g; h < (j + 1) * g; ++h)
      for (int64_t t = 0; t < n; ++t) st.s[h][t] = dot<kDim, kWide>(st.q[h], rows[t], d);
  }
  float corr[kMaxGroup];
  for (int64_t h = 0; h < nkh * g; ++h) {
    float* s = st.s[h];
    for (int64_t t = n; t < kTile; ++t) s[t] = kNegBig;
    float mx = st.m[h];
    for (int64_t t = 0; t < kTile; ++t) mx = std::max(mx, s[t]);
    corr[h] = exp_nonpos(st.m[h] - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < kTile; ++t) {
      s[t] = t < n ? exp_nonpos(s[t] - mx) : 0.f;
      sum += s[t];
    }
    st.l[h] = st.l[h] * corr[h] + sum;
    st.m[h] = mx;
  }
  for (int64_t j = 0; j < nkh; ++j) {
    for (int64_t t = 0; t < n; ++t)
      rows[t] = row_f32(v + t * row_stride + j * d, st.vbuf[t], d);
    for (int64_t h = j * g; h < (j + 1) * g; ++h)
      accumulate<kDim, kWide>(st.acc[h], corr[h], st.s[h], rows, n, d);
  }
}

// One task: sequence b, KV heads [kh, kh + nkh), query heads [kh * g, (kh + nkh) * g).
template <typename T, int64_t kDim, bool kWide>
SHOAL_INLINE void attend(const Args& a, int64_t b, int64_t kh, int64_t nkh) {
  const int64_t d = kDim ? kDim : a.dim, bs = a.block_size, g = a.group, heads = nkh * g;
  const T* q = static_cast<const T*>(a.q) + b * a.q_sb + kh * g * a.q_sh;
  T* out = static_cast<T*>(a.out) + b * a.o_sb + kh * g * a.o_sh;
  const int64_t len = a.lens[b];
  // The query at len - 1 sees keys (len - 1 - window, len - 1].
  int64_t pos = a.window > 0 ? std::max<int64_t>(len - a.window, 0) : 0;
  State st;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) {
      st.q[h][i] = to_f32(q[h * a.q_sh + i]) * a.scale;
      st.acc[h][i] = 0.f;
    }
    st.m[h] = kNegBig;
    st.l[h] = 0.f;
  }
  const T* kc = static_cast<const T*>(a.k);
  const T* vc = static_cast<const T*>(a.v);
  const int64_t* table = a.tables + b * a.table_stride;
  // A tile: n <= kTile keys from pos, all in one block, the first at element `first`.
  auto tile_at = [&](int64_t p, int64_t& n, int64_t& first) {
    const int64_t off = p % bs;
    n = std::min({len - p, bs - off, kTile});
    first = ((table[p / bs] * bs + off) * a.kv_heads + kh) * d;
  };
  // Rows are prefetched kPrefetchTiles tiles ahead of the one computed: blocks sit anywhere
  // in the cache, so the hardware prefetcher cannot see the next one coming.
  int64_t ahead = pos;
  auto prefetch_next = [&] {
    if (ahead >= len) return;
    int64_t n, first;
    tile_at(ahead, n, first);
    prefetch_rows(kc + first, vc + first, n, a.kv_heads * d, nkh * d * sizeof(T));
    ahead += n;
  };
  for (int i = 0; i < kPrefetchTiles; ++i) prefetch_next();
  while (pos < len) {
    int64_t n, first;
    tile_at(pos, n, first);
    prefetch_next();
    attend_tile<T, kDim, kWide>(a, st, kc + first, vc + first, g, nkh, n);
    pos += n;
  }
  for (int64_t h = 0; h < heads; ++h) {  // an empty row (len 0: padding) gives zeros
    const float inv = st.l[h] > 0.f ? 1.f / st.l[h] : 0.f;
    for (int64_t i = 0; i < d; ++i) store(out + h * a.o_sh + i, st.acc[h][i] * inv);
  }
}

using TaskFn = void (*)(const Args&, int64_t, int64_t, int64_t);

#define SHOAL_TASK(name, T, D)                                                       \
  SHOAL_WIDE void name##_wide(const Args& a, int64_t b, int64_t kh, int64_t nkh) {   \
    attend<T, D, true>(a, b, kh, nkh);                                               \
  }                                                                                  \
  SHOAL_NARROW_CLONES void name(const Args& a, int64_t b, int64_t kh, int64_t nkh) { \
    attend<T, D, false>(a, b, kh, nkh);                                              \
  }
SHOAL_TASK(f32_d64, float, 64)
SHOAL_TASK(f32_d128, float, 128)
SHOAL_TASK(f32_any, float, 0)
SHOAL_TASK(bf16_d64, uint16_t, 64)
SHOAL_TASK(bf16_d128, uint16_t, 128)
SHOAL_TASK(bf16_any, uint16_t, 0)
#undef SHOAL_TASK

// KV heads per task: as many as the state holds (a divisor of the KV head count), while
// that still leaves at least 4 tasks per thread to balance sequences of unequal length.
int64_t heads_per_task(int64_t batch, int64_t kv_heads, int64_t group, int64_t threads) {
  for (int64_t c = kv_heads; c > 1; --c)
    if (kv_heads % c == 0 && c * group <= kMaxGroup && batch * (kv_heads / c) >= 4 * threads)
      return c;
  return 1;
}

TaskFn pick(bool bf16, int64_t d) {
  static const bool wide = has_avx512();
  if (wide && bf16) return d == 64 ? bf16_d64_wide : d == 128 ? bf16_d128_wide : bf16_any_wide;
  if (wide) return d == 64 ? f32_d64_wide : d == 128 ? f32_d128_wide : f32_any_wide;
  if (bf16) return d == 64 ? bf16_d64 : d == 128 ? bf16_d128 : bf16_any;
  return d == 64 ? f32_d64 : d == 128 ? f32_d128 : f32_any;
}

void check(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
           const at::Tensor& v, const at::Tensor& tables, const at::Tensor& lens) {
  for (const at::Tensor* t : {&out, &q, &k, &v, &tables, &lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, Hq, D]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous(),
              "key and value caches must be contiguous [slots, Hk, D]");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "paged_decode: float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == dt && k.scalar_type() == dt && v.scalar_type() == dt,
              "q, out and the caches must share a dtype");
  const int64_t hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(2) == d && hq % hk == 0 && hq / hk <= kMaxGroup && d <= kMaxDim,
              "head counts or head dim outside the kernel's limits");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "the head dim must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 &&
                  tables.size(0) >= q.size(0) && tables.stride(1) == 1,
              "block_tables must be int64 [>= B, N] with contiguous rows");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 1 &&
                  lens.size(0) >= q.size(0) && lens.is_contiguous(),
              "seq_lens must be contiguous int64 [>= B]");
}

// Every block a sequence reads must be in the cache: a bad table raises here, not a read
// out of bounds (B x N integers, microseconds).
void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t batch,
                  int64_t block_size, int64_t num_blocks) {
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), stride = tables.stride(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (l[b] + block_size - 1) / block_size;
    TORCH_CHECK(l[b] >= 0 && used <= width, "sequence ", b, ": length ", l[b],
                " does not fit its block table of ", width, " blocks");
    for (int64_t j = 0; j < used; ++j)
      TORCH_CHECK(t[b * stride + j] >= 0 && t[b * stride + j] < num_blocks, "sequence ", b,
                  ": block ", t[b * stride + j], " is outside the cache's ", num_blocks);
  }
}

void paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, int64_t block_size, double scale,
                  int64_t window) {
  check(out, q, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(block_size > 0 && key_cache.size(0) % block_size == 0,
              "cache slots are not whole blocks");
  check_tables(block_tables, seq_lens, q.size(0), block_size, key_cache.size(0) / block_size);
  const int64_t hk = key_cache.size(1);
  const Args a{q.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
               block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
               q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               block_tables.stride(0), hk, q.size(1) / hk, q.size(2), block_size, window,
               static_cast<float>(scale)};
  const TaskFn fn = pick(q.scalar_type() == at::kBFloat16, a.dim);
  const int64_t nkh = heads_per_task(q.size(0), hk, a.group, at::get_num_threads());
  const int64_t per_seq = hk / nkh, tasks = q.size(0) * per_seq;
  if (tasks == 0) return;
  // Context lengths differ between sequences, so tasks are handed out one at a time.
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < tasks; ++i) fn(a, i / per_seq, (i % per_seq) * nkh, nkh);
}

}  // namespace

TORCH_LIBRARY(shoal_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, int block_size, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(shoal_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
