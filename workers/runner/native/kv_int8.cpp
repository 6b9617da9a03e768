// The int8 KV cache's kernels (workers/runner/kv_int8.py), for CPUs: the write (quantize
// new rows into their slots), decode attention over int8 rows (the decode workspace) and
// over int8 blocks of the paged cache in place, and the dequantized copy of blocks that
// prompt chunks after cached context attend over (with the float prefill kernel).
//
// A row is one token of one KV head: D int8 values q and a bf16 scale s, read as q * s.
// The write quantizes as kv_int8.quantize does, to the same bits: s = bf16(amax / 127)
// (amax * (1 / 127) in fp32), q = round_half_even(x * (1 / s)) clamped to +-127, 0 where
// s is 0. q * s is exact in fp32 (8 by 8 significant bits).
//
// Decode attention is task_avx512's method of decode_attention.cpp (a (sequence, KV head)
// task scores all its query heads, fp32 softmax, then weighs the values), with the
// dequantization in its inner loops: keys W at a time (W = 16 lanes on AVX-512, 8 on
// AVX2) are widened to fp32 once into a small buffer in L1 and scored against every query
// head from there; a key's scale multiplies its score (q.k * s), a value's its
// probability (p * s), so no row is ever multiplied out. Keys are taken W at a time across
// the task's runs (a workspace row is one run, the paged cache a run per block), so small
// blocks cost no partial vectors. The task reads half the bytes of bf16 (the scales add
// 2 / D) and does about twice bf16's arithmetic per byte; the values and the next task's
// keys are prefetched as in decode_attention.cpp.
//
// Numerics: fp32 products, sums and softmax whatever the model's dtype; the output is
// rounded to it once.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vec_math.h"

namespace {

constexpr float kQmax = 127.f;

inline float bf16_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> bf16 bits, round to nearest even (c10's rounding of finite values), with no
// NaN branch so that loops vectorise.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Items per thread of a parallel loop whose items each touch `width` numbers: work under
// 32k numbers stays on the calling thread (a decode step's write), where waking a second
// thread, or waiting for one another process took its core from, costs more than it saves.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  return bf16_float(*reinterpret_cast<const uint16_t*>(p));
}
inline void store(float* p, float x) { *p = x; }
inline void store(at::BFloat16* p, float x) { *reinterpret_cast<uint16_t*>(p) = bf16_bits(x); }

// ---- the write -------------------------------------------------------------------------

// Quantizes row x (D values, contiguous) into q and *scale, and overwrites x with q * s in
// its own dtype.
template <typename T>
inline void quantize_row(T* x, int64_t D, int8_t* q, uint16_t* scale) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(load(x + d)));
  const uint16_t sb = bf16_bits(amax * (1.f / kQmax));
  const float s = bf16_float(sb);
  // 1 / s in double, rounded once to float: the correctly rounded quotient that torch's
  // fp32 division gives (a float division here may become a reciprocal estimate).
  const float inv = s > 0.f ? static_cast<float>(1.0 / static_cast<double>(s)) : 0.f;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::min(std::max(std::nearbyint(load(x + d) * inv), -kQmax), kQmax);
    q[d] = static_cast<int8_t>(r);
    store(x + d, r * s);
  }
  *scale = sb;
}

// Stores k and v ([tokens, kv_heads, dim], rows contiguous, any token and head stride) into
// slots[i] of k_data/v_data ([kv_heads, slots, dim] int8) and k_scale/v_scale ([kv_heads,
// slots] bf16), and replaces k and v by what is stored (q * s in their dtype).
void write_kv(const at::Tensor& k_data, const at::Tensor& k_scale, const at::Tensor& v_data,
              const at::Tensor& v_scale, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  for (const auto* t : {&k_data, &v_data})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kChar && t->dim() == 3 &&
                    t->is_contiguous() && t->sizes() == k_data.sizes(),
                "write_kv: int8 caches [kv_heads, slots, dim], contiguous, of one shape");
  for (const auto* t : {&k_scale, &v_scale})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == k_data.size(0) && t->size(1) == k_data.size(1),
                "write_kv: bf16 scales [kv_heads, slots]");
  TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "write_kv: k and v float32 or bfloat16, on the CPU");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_data.size(0) &&
                  k.size(2) == k_data.size(2) && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv: k/v of [tokens, kv_heads, dim] with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0), "write_kv: one int64 slot per token");
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), num_slots = k_data.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " out of range");
  auto* kd = k_data.data_ptr<int8_t>();
  auto* vd = v_data.data_ptr<int8_t>();
  auto* ks = reinterpret_cast<uint16_t*>(k_scale.data_ptr<at::BFloat16>());
  auto* vs = reinterpret_cast<uint16_t*>(v_scale.data_ptr<at::BFloat16>());
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    T* kp = k.data_ptr<T>();
    T* vp = v.data_ptr<T>();
    const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
    at::parallel_for(0, n * H, grain(2 * D), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / H, h = task % H, at = h * num_slots + sp[i];
        quantize_row(kp + i * ks0 + h * ks1, D, kd + at * D, ks + at);
        quantize_row(vp + i * vs0 + h * vs1, D, vd + at * D, vs + at);
      }
    });
  };
  if (k.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
}

// ---- dequantized blocks, for prompt chunks ---------------------------------------------

// out[h, i * block_size + t] = block block_ids[i]'s row t of head h, as q * s in out's
// dtype; out [kv_heads, len(block_ids) * block_size, dim].
void dequantize_blocks(const at::Tensor& data, const at::Tensor& scale,
                       const at::Tensor& block_ids, int64_t block_size, const at::Tensor& out) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kChar && data.dim() == 3 &&
                  data.is_contiguous(), "dequantize_blocks: int8 [kv_heads, slots, dim]");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == data.size(0) &&
                  scale.size(1) == data.size(1), "dequantize_blocks: bf16 scales [kv_heads, slots]");
  TORCH_CHECK(block_size > 0 && data.size(1) % block_size == 0, "block_size must divide slots");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1 &&
                  block_ids.is_contiguous(), "dequantize_blocks: int64 block ids");
  const int64_t H = data.size(0), num_slots = data.size(1), D = data.size(2);
  const int64_t nb = block_ids.size(0), num_blocks = num_slots / block_size;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == H &&
                  out.size(1) == nb * block_size && out.size(2) == D &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "dequantize_blocks: out [kv_heads, blocks * block_size, dim], float32 or bfloat16");
  const int64_t* bp = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < nb; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < num_blocks, "dequantize_blocks: block id out of range");
  const int8_t* dp = data.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    T* op = out.data_ptr<T>();
    at::parallel_for(0, H * nb, grain(block_size * D), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / nb, i = task % nb;
        const int64_t src = h * num_slots + bp[i] * block_size;
        T* dst = op + (h * nb * block_size + i * block_size) * D;
        for (int64_t t = 0; t < block_size; ++t) {
          const float s = bf16_float(sp[src + t]);
          const int8_t* row = dp + (src + t) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) store(dst + t * D + d, static_cast<float>(row[d]) * s);
        }
      }
    });
  };
  if (out.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
}

// ---- decode attention ------------------------------------------------------------------

// n rows of keys and values of one KV head, contiguous: a workspace row is one run, a
// sequence in the paged cache one run per block.
struct Run {
  const int8_t* k;
  const uint16_t* ks;
  const int8_t* v;
  const uint16_t* vs;
  int64_t n;
};

// A position in a task's runs, read one row at a time.
struct Cursor {
  const Run* runs;
  int64_t r = 0, off = 0;
  void next() {
    if (++off == runs[r].n) {
      ++r;
      off = 0;
    }
  }
};

// Per thread: the buffers of a task with G query heads, D dims and up to L keys.
struct Scratch {
  std::vector<float> qf, scores, acc, kb, ksb, inv;
  void size(int64_t G, int64_t D, int64_t L, int64_t W) {
    qf.assign(G * D, 0.f);
    scores.assign(G * L + W, 0.f);
    acc.assign(G * D, 0.f);
    kb.assign(W * D, 0.f);
    ksb.assign(W, 0.f);
    inv.assign(G, 0.f);
  }
};

// s[0..L) <- exp(s - max(s)) in place; returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t L) {
#if defined(__AVX512F__)
  return 1.f / switchyard::exp_sum(s, L, switchyard::row_max(s, L), s);
#else
  float m = s[0];
  for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
#endif
}

template <typename T>
void task_scalar(const T* q, int64_t q_stride, int64_t G, int64_t D, const Run* runs,
                 int64_t L, float scale, Scratch& b, T* out, int64_t o_stride) {
  float* qf = b.qf.data();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q + g * q_stride + d);
  Cursor cur{runs};
  for (int64_t t = 0; t < L; ++t, cur.next()) {
    const Run& r = runs[cur.r];
    const int8_t* k = r.k + cur.off * D;
    const float ks = bf16_float(r.ks[cur.off]) * scale;
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qf[g * D + d] * static_cast<float>(k[d]);
      b.scores[g * L + t] = dot * ks;
    }
  }
  for (int64_t g = 0; g < G; ++g) b.inv[g] = softmax_unnormalised(b.scores.data() + g * L, L);
  std::fill(b.acc.begin(), b.acc.end(), 0.f);
  cur = Cursor{runs};
  for (int64_t t = 0; t < L; ++t, cur.next()) {
    const Run& r = runs[cur.r];
    const int8_t* v = r.v + cur.off * D;
    const float vs = bf16_float(r.vs[cur.off]);
    for (int64_t g = 0; g < G; ++g) {
      const float p = b.scores[g * L + t] * vs;
      float* a = b.acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) store(out + g * o_stride + d, b.acc[g * D + d] * b.inv[g]);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SWITCHYARD_KV_INT8_VECTOR 1

#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf widen_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// W lanes rounded to bf16 (c10's rounding) at p.
inline void store_bf16(uint16_t* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(switchyard::bf16_round16(x)));
}
// r[j] = sum of the lanes of a[j]: decode_attention.cpp's sum16.
inline vf lane_sums(const vf* a) {
  vf s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                       _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}
#else
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf widen_bf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store_bf16(uint16_t* p, vf x) {
  // The rounded bits sit in each 32-bit lane's low half: pack them (within 128-bit
  // halves), then bring the two halves' results together.
  const __m256i r = switchyard::bf16_round8(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// r[j] = sum of the lanes of a[j]: decode_attention.cpp's sum8.
inline vf lane_sums(const vf* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

inline vf widen(const float* p) { return vload(p); }
inline vf widen(const at::BFloat16* p) { return widen_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline void vstore_as(float* p, vf x) { vstore(p, x); }
inline void vstore_as(at::BFloat16* p, vf x) { store_bf16(reinterpret_cast<uint16_t*>(p), x); }

inline void prefetch_line(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// One task with D = W * CV: scores W keys at a time, softmax, values W rows at a time.
// While it widens a key it prefetches that row's value; while it widens values, the
// next task's first keys (`next`, its first run; null when none).
template <typename T, int CV>
void task_vec(const T* q, int64_t q_stride, int64_t G, const Run* runs, int64_t L, float scale,
              Scratch& b, T* out, int64_t o_stride, const Run* next) {
  constexpr int64_t D = W * CV;
  constexpr int NC = CV > 8 ? 8 : CV;  // value accumulators per pass over a head's dims
  float* qf = b.qf.data();
  float* kb = b.kb.data();  // W rows, keys then values, widened to fp32
  float* ksb = b.ksb.data();
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < CV; ++c) vstore(qf + g * D + c * W, widen(q + g * q_stride + c * W));
  const vf sc = vset1(scale);
  Cursor cur{runs};
  for (int64_t t0 = 0; t0 < L; t0 += W) {
    const int64_t m = std::min<int64_t>(W, L - t0);
    for (int64_t j = 0; j < m; ++j, cur.next()) {
      const Run& r = runs[cur.r];
      const int8_t* k = r.k + cur.off * D;
      for (int64_t at = 0; at < D; at += 64) prefetch_line(r.v + cur.off * D + at);
      ksb[j] = bf16_float(r.ks[cur.off]);
      for (int c = 0; c < CV; ++c) vstore(kb + j * D + c * W, widen_i8(k + c * W));
    }
    const vf kscale = vmul(vload(ksb), sc);
    for (int64_t g = 0; g < G; ++g) {
      vf acc[W];
      for (int j = 0; j < W; ++j) acc[j] = vzero();
      for (int c = 0; c < CV; ++c) {
        const vf qv = vload(qf + g * D + c * W);
        for (int j = 0; j < W; ++j) acc[j] = vfma(qv, vload(kb + j * D + c * W), acc[j]);
      }
      // Lane j is key j's score; lanes from m on are stale rows, never stored.
      alignas(64) float dots[W];
      vstore(dots, vmul(lane_sums(acc), kscale));
      std::memcpy(b.scores.data() + g * L + t0, dots, m * sizeof(float));
    }
  }
  for (int64_t g = 0; g < G; ++g) b.inv[g] = softmax_unnormalised(b.scores.data() + g * L, L);
  float* acc = b.acc.data();
  std::fill(b.acc.begin(), b.acc.end(), 0.f);
  cur = Cursor{runs};
  for (int64_t t0 = 0; t0 < L; t0 += W) {
    const int64_t m = std::min<int64_t>(W, L - t0);
    for (int64_t j = 0; j < m; ++j, cur.next()) {
      const Run& r = runs[cur.r];
      const int8_t* v = r.v + cur.off * D;
      if (next != nullptr && t0 + j < next->n)
        for (int64_t at = 0; at < D; at += 64) prefetch_line(next->k + (t0 + j) * D + at);
      ksb[j] = bf16_float(r.vs[cur.off]);
      for (int c = 0; c < CV; ++c) vstore(kb + j * D + c * W, widen_i8(v + c * W));
    }
    const vf vscale = vload(ksb);
    for (int64_t g = 0; g < G; ++g) {
      // Each key's weight: its probability (unnormalised) times its value's scale.
      alignas(64) float w[W];
      vstore(w, vmul(vload(b.scores.data() + g * L + t0), vscale));
      for (int c0 = 0; c0 < CV; c0 += NC) {
        float* ag = acc + g * D + c0 * W;
        vf a[NC];
        for (int c = 0; c < NC; ++c) a[c] = vload(ag + c * W);
        for (int64_t j = 0; j < m; ++j) {
          const vf p = vset1(w[j]);
          for (int c = 0; c < NC; ++c) a[c] = vfma(p, vload(kb + j * D + (c0 + c) * W), a[c]);
        }
        for (int c = 0; c < NC; ++c) vstore(ag + c * W, a[c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const vf w = vset1(b.inv[g]);
    for (int c = 0; c < CV; ++c)
      vstore_as(out + g * o_stride + c * W, vmul(vload(acc + g * D + c * W), w));
  }
}
#endif

// The vector task for this D (a multiple of W, 2 to 16 vectors), else false.
template <typename T>
bool task_vector(const T* q, int64_t q_stride, int64_t G, int64_t D, const Run* runs,
                 int64_t L, float scale, Scratch& b, T* out, int64_t o_stride, const Run* next) {
#if defined(SWITCHYARD_KV_INT8_VECTOR)
  switch (D == W * (D / W) ? D / W : 0) {
    case 2:
      task_vec<T, 2>(q, q_stride, G, runs, L, scale, b, out, o_stride, next);
      return true;
    case 4:
      task_vec<T, 4>(q, q_stride, G, runs, L, scale, b, out, o_stride, next);
      return true;
    case 8:
      task_vec<T, 8>(q, q_stride, G, runs, L, scale, b, out, o_stride, next);
      return true;
    case 16:
      task_vec<T, 16>(q, q_stride, G, runs, L, scale, b, out, o_stride, next);
      return true;
    default:
      return false;
  }
#else
  return false;
#endif
}

// Runs every (sequence, KV head) task, 8 at a time to whichever thread asks: `runs_of(task,
// runs)` fills the task's runs (lengths[s] keys in all) and returns how many.
template <typename T, typename RunsOf>
void attend(const at::Tensor& q, int64_t Hkv, const int64_t* lp, int64_t max_runs, float scale,
            const at::Tensor& out, RunsOf runs_of) {
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2), G = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t max_len = *std::max_element(lp, lp + S);
  const int64_t tasks = S * Hkv;
  switchyard::parallel_claims(tasks, 8, [&](switchyard::Claims& claims) {
    int64_t task = claims.next();
    if (task == tasks) return;
    Scratch buffers;
    buffers.size(G, D, max_len, 16);
    std::vector<Run> runs(max_runs), next(max_runs);
    runs_of(task, runs.data());
    for (int64_t after; task < tasks; task = after) {
      after = claims.next();  // this thread's next task: its keys are prefetched
      const int64_t s = task / Hkv, h = task % Hkv, L = lp[s];
      const T* qh = qp + s * q_s0 + h * G * q_s1;
      T* oh = op + s * o_s0 + h * G * o_s1;
      const bool has_next = after < tasks && runs_of(after, next.data()) > 0;
      if (!task_vector<T>(qh, q_s1, G, D, runs.data(), L, scale, buffers, oh, o_s1,
                          has_next ? next.data() : nullptr))
        task_scalar<T>(qh, q_s1, G, D, runs.data(), L, scale, buffers, oh, o_s1);
      std::swap(runs, next);
    }
  });
}

// Calls f(T{}) with T the C++ type of q (float32 or bfloat16).
template <typename F>
void dispatch(const at::Tensor& q, F&& f) {
  if (q.scalar_type() == at::kFloat) {
    f(float{});
  } else if (q.scalar_type() == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, "int8 KV decode attention: q float32 or bfloat16");
  }
}

void check_store(const at::Tensor& data, const at::Tensor& scale, int64_t dims, const char* what) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kChar &&
                  data.dim() == dims && data.is_contiguous(), what, ": int8 data, contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  scale.dim() == dims - 1 &&
                  scale.sizes() == data.sizes().slice(0, dims - 1), what, ": a bf16 scale per row");
}

void check_query(const at::Tensor& q, const at::Tensor& out, const at::Tensor& lengths,
                 int64_t kv_heads, int64_t dim) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q [seqs, heads, dim]");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 3 && out.stride(2) == 1 &&
                  out.sizes() == q.sizes(), "out like q");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == dim, "head shapes differ");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == q.size(0) && q.size(0) > 0,
              "one int64 length per query");
}

}  // namespace

// Copies each sequence's new key/value (int8 rows and scales at cache_slots[s] of the
// paged cache, [kv_heads, slots, dim] + [kv_heads, slots]) to position lengths[s] - 1 of
// workspace row s ([kv_heads, rows, tokens, dim] + [kv_heads, rows, tokens]), then writes
// the attention of q ([seqs, heads, dim]) over the row's first lengths[s] tokens to out.
void decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& kcs,
                      const at::Tensor& vc, const at::Tensor& vcs, const at::Tensor& cache_slots,
                      const at::Tensor& kw, const at::Tensor& kws, const at::Tensor& vw,
                      const at::Tensor& vws, const at::Tensor& lengths, double scale,
                      const at::Tensor& out) {
  check_store(kc, kcs, 3, "decode_attention (k cache)");
  check_store(vc, vcs, 3, "decode_attention (v cache)");
  check_store(kw, kws, 4, "decode_attention (k workspace)");
  check_store(vw, vws, 4, "decode_attention (v workspace)");
  TORCH_CHECK(kc.sizes() == vc.sizes() && kw.sizes() == vw.sizes(), "K and V of one shape");
  TORCH_CHECK(kw.size(0) == kc.size(0) && kw.size(3) == kc.size(2), "cache and rows differ");
  check_query(q, out, lengths, kw.size(0), kw.size(3));
  const int64_t S = q.size(0), Hkv = kw.size(0), R = kw.size(1), Tmax = kw.size(2);
  const int64_t D = kw.size(3), num_slots = kc.size(1);
  TORCH_CHECK(S <= R, "more queries than workspace rows");
  TORCH_CHECK(cache_slots.scalar_type() == at::kLong && cache_slots.is_contiguous() &&
                  cache_slots.dim() == 1 && cache_slots.size(0) == S, "one int64 slot per query");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = cache_slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= Tmax, "length outside the workspace row");
    TORCH_CHECK(sp[s] >= 0 && sp[s] < num_slots, "cache slot out of range");
  }
  const int8_t* kcp = kc.data_ptr<int8_t>();
  const int8_t* vcp = vc.data_ptr<int8_t>();
  const auto* kcsp = reinterpret_cast<const uint16_t*>(kcs.data_ptr<at::BFloat16>());
  const auto* vcsp = reinterpret_cast<const uint16_t*>(vcs.data_ptr<at::BFloat16>());
  int8_t* kwp = kw.data_ptr<int8_t>();
  int8_t* vwp = vw.data_ptr<int8_t>();
  auto* kwsp = reinterpret_cast<uint16_t*>(kws.data_ptr<at::BFloat16>());
  auto* vwsp = reinterpret_cast<uint16_t*>(vws.data_ptr<at::BFloat16>());
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t src = h * num_slots + sp[s], dst = (h * R + s) * Tmax + lp[s] - 1;
      std::memcpy(kwp + dst * D, kcp + src * D, D);
      std::memcpy(vwp + dst * D, vcp + src * D, D);
      kwsp[dst] = kcsp[src];
      vwsp[dst] = vcsp[src];
    }
  }
  dispatch(q, [&](auto zero) {
    using T = decltype(zero);
    attend<T>(q, Hkv, lp, 1, static_cast<float>(scale), out, [&](int64_t task, Run* runs) {
      const int64_t s = task / Hkv, h = task % Hkv, row = (h * R + s) * Tmax;
      runs[0] = Run{kwp + row * D, kwsp + row, vwp + row * D, vwsp + row, lp[s]};
      return int64_t{1};
    });
  });
}

// Attention of q ([seqs, heads, dim]) over each sequence's first lengths[s] tokens in the
// int8 paged cache (data [kv_heads, slots, dim], scales [kv_heads, slots]; tables [seqs,
// max_blocks] of block ids), read in place, block by block.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& kcs,
                            const at::Tensor& vc, const at::Tensor& vcs, const at::Tensor& tables,
                            const at::Tensor& lengths, int64_t block_size, double scale,
                            const at::Tensor& out) {
  check_store(kc, kcs, 3, "paged_decode_attention (k cache)");
  check_store(vc, vcs, 3, "paged_decode_attention (v cache)");
  TORCH_CHECK(kc.sizes() == vc.sizes(), "K and V of one shape");
  check_query(q, out, lengths, kc.size(0), kc.size(2));
  TORCH_CHECK(block_size > 0 && kc.size(1) % block_size == 0, "block_size must divide slots");
  const int64_t S = q.size(0), Hkv = kc.size(0), num_slots = kc.size(1), D = kc.size(2);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == S, "int64 block tables [seqs, max_blocks]");
  const int64_t width = tables.size(1), num_blocks = num_slots / block_size;
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= width * block_size, "length beyond the block table");
    for (int64_t i = 0; i < (lp[s] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[s * width + i] >= 0 && tp[s * width + i] < num_blocks,
                  "block id out of range");
  }
  const int8_t* kp = kc.data_ptr<int8_t>();
  const int8_t* vp = vc.data_ptr<int8_t>();
  const auto* ksp = reinterpret_cast<const uint16_t*>(kcs.data_ptr<at::BFloat16>());
  const auto* vsp = reinterpret_cast<const uint16_t*>(vcs.data_ptr<at::BFloat16>());
  dispatch(q, [&](auto zero) {
    using T = decltype(zero);
    attend<T>(q, Hkv, lp, width, static_cast<float>(scale), out, [&](int64_t task, Run* runs) {
      const int64_t s = task / Hkv, h = task % Hkv, L = lp[s];
      const int64_t n = (L + block_size - 1) / block_size;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = h * num_slots + tp[s * width + i] * block_size;
        runs[i] = Run{kp + at * D, ksp + at, vp + at * D, vsp + at,
                      std::min(block_size, L - i * block_size)};
      }
      return n;
    });
  });
}

// The lanes this build's vector path runs (16: AVX-512, 8: AVX2 and FMA, 0: scalar).
int64_t vector_lanes() {
#if defined(SWITCHYARD_KV_INT8_VECTOR)
  return W;
#else
  return 0;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "quantize new keys and values into their int8 cache slots");
  m.def("dequantize_blocks", &dequantize_blocks, "blocks of an int8 cache as float rows");
  m.def("decode_attention", &decode_attention, "decode attention over int8 workspace rows");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over int8 blocks of the paged cache, in place");
  m.def("vector_lanes", &vector_lanes, "this build's vector width (0: scalar)");
}
