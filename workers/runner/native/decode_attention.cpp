// Decode attention over the decode workspace (workers/decode_workspace.py), for CPUs.
//
// One query token per sequence; sequence s owns row s of every layer's workspace
// ([kv_heads, rows, max_tokens, head_dim], contiguous) and has lengths[s] valid tokens
// once this step's key/value, written here at position lengths[s] - 1, is appended.
// The query heads that share a KV head are scored together, so each key and value is
// read from memory once per step: the step is bound by streaming the KV, which is what
// the roofline assumes. torch's SDPA kernel tiles for long queries and moved the same
// bytes 2-3x slower at decode shapes (docs/benchmarks/engine-roofline.md).
//
// bf16 on a CPU with AVX512-BF16 takes `task_bf16`: every product is a VDPBF16PS, so keys
// and values are never widened to fp32 one by one (8 layers at batch 64, 257 tokens, one
// core with the KV in L2: 15.0 -> 6.6 us per sequence and layer; from memory, two cores:
// the step's attention 7.7 -> 6.3 ms in the engine, now bound by the KV's bytes).
//
// Numerics: fp32 accumulation and softmax whatever the storage dtype (fp32 or bf16); bf16
// rounds the probabilities to bf16 before weighing values, as torch's CPU kernels do.

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

inline float load(const float* p) { return *p; }

inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, float x) { *p = x; }

inline void store(at::BFloat16* p, float x) { *p = at::BFloat16(x); }

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

// A run of n keys stored contiguously (D values each), and their values likewise: a
// workspace row is one run; a sequence in the paged cache is one run per block.
template <typename T>
struct Run {
  const T* k;
  const T* v;
  int64_t n;
};

#if defined(__AVX512F__)
// 16 values from p as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// r[j] = sum of the 16 lanes of a[j], for j < 16: a transpose-and-add tree, 45 shuffles
// and adds for 16 dot products instead of a horizontal sum (about 8 ops) for each.
inline __m512 sum16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i)  // lanes of a pair (x, y): x y x y
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // four dot products per 128-bit lane, in order
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // fold the four 128-bit lanes: pairs first
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88),
                       _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

// Scores (unscaled q.k) of 16 consecutive keys [16, D] for one query: D / 16 chunks.
template <typename T, int C>
inline __m512 scores16(const __m512* q, const T* k) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_mul_ps(q[0], load16(k + j * C * 16));
    for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(q[c], load16(k + j * C * 16 + c * 16), a);
    acc[j] = a;
  }
  return sum16(acc);
}

// Asks for n values from p to be brought into L2. The KV rows stream from memory, and a
// core that computes while its loads are in flight reads them ~20% faster (8 layers at
// batch 64: bf16 9.0 -> 7.1 ms, fp32 14.8 -> 12.4 ms, cold caches; into L1 instead: no gain).
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(T)))
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// One (sequence, KV head) task with head_dim = 16 * C, over its keys in `runs`: scores in
// 16-key blocks, softmax, then the values weighted into C accumulators per query head.
// While it scores keys it prefetches their values and the next run's keys; while it
// weighs values, the first `next_n` keys of `next_k` (the next task's).
template <typename T, int C>
void task_avx512(const T* q_heads, int64_t q_stride, int64_t G, const Run<T>* runs,
                 int64_t num_runs, int64_t L, float scale, float* scores, float* inv, T* out,
                 int64_t o_stride, const T* next_k, int64_t next_n) {
  constexpr int64_t D = 16 * C;
  for (int64_t g = 0; g < G; ++g) {
    __m512 q[C];
    for (int c = 0; c < C; ++c) q[c] = load16(q_heads + g * q_stride + c * 16);
    float* sg = scores + g * L;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < num_runs; ++r) {
      const T* kr = runs[r].k;
      const T* vr = runs[r].v;
      const int64_t n = runs[r].n;
      if (g == 0 && r + 1 < num_runs) prefetch(runs[r + 1].k, runs[r + 1].n * D);
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        if (g == 0) prefetch(vr + t * D, 16 * D);
        _mm512_storeu_ps(sg + t, _mm512_mul_ps(scores16<T, C>(q, kr + t * D), sc));
      }
      if (g == 0 && t < n) prefetch(vr + t * D, (n - t) * D);
      for (; t < n; ++t) {  // the last < 16 keys of the run
        __m512 a = _mm512_mul_ps(q[0], load16(kr + t * D));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(q[c], load16(kr + t * D + c * 16), a);
        sg[t] = _mm512_reduce_add_ps(a) * scale;
      }
      sg += n;
    }
    inv[g] = softmax_unnormalised(scores + g * L, L);
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    const float* sg = scores + g * L;
    int64_t seen = 0;
    for (int64_t r = 0; r < num_runs; ++r) {
      const T* vr = runs[r].v;
      const int64_t n = runs[r].n;
      for (int64_t t = 0; t < n; ++t) {
        if (g == 0 && seen + t < next_n) prefetch(next_k + (seen + t) * D, D);
        const __m512 p = _mm512_set1_ps(sg[t]);
        for (int c = 0; c < C; ++c)
          acc[c] = _mm512_fmadd_ps(p, load16(vr + t * D + c * 16), acc[c]);
      }
      sg += n;
      seen += n;
    }
    const __m512 w = _mm512_set1_ps(inv[g]);
    alignas(64) float res[D];
    for (int c = 0; c < C; ++c) _mm512_store_ps(res + c * 16, _mm512_mul_ps(acc[c], w));
    T* og = out + g * o_stride;
    for (int64_t d = 0; d < D; ++d) store(og + d, res[d]);
  }
}
#endif

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Scores (unscaled q.k) of 16 consecutive bf16 keys [16, D] for one query, D = 32 * C2:
// a key's D products are C2 VDPBF16PS (32 bf16 multiply-adds each, into fp32 lanes),
// with no conversion of keys to fp32.
template <int C2>
inline __m512 scores16_bf16(const __m512bh* q, const uint16_t* k) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0],
                                as_bh(_mm512_loadu_si512(k + j * C2 * 32)));
    for (int c = 1; c < C2; ++c)
      a = _mm512_dpbf16_ps(a, q[c], as_bh(_mm512_loadu_si512(k + j * C2 * 32 + c * 32)));
    acc[j] = a;
  }
  return sum16(acc);
}

// Lane l of value accumulator 2c + h (h: unpacklo 0 / unpackhi 1 of chunk c) holds dim
// 32 c + 8 (l / 4) + 4 h + l % 4: VDPBF16PS over two keys' values interleaved by
// unpacklo/hi_epi16, which work within 128-bit lanes.
constexpr int64_t value_dim(int64_t acc, int64_t lane) {
  return 32 * (acc / 2) + 8 * (lane / 4) + 4 * (acc % 2) + lane % 4;
}

// The bf16 task (head_dim = 32 * C2), as `task_avx512` but with every product a VDPBF16PS:
// q.k of a key is C2 instructions; the values are weighed two keys at a time (their
// values interleaved in registers), by probabilities rounded to bf16 as torch's CPU
// attention kernels round them. Scores, softmax and sums stay fp32. Query heads go
// through the values GB at a time, so a pair of values is loaded and interleaved once
// for all of them.
template <int C2>
void task_bf16(const uint16_t* q_heads, int64_t q_stride, int64_t G, const Run<uint16_t>* runs,
               int64_t num_runs, int64_t L, float scale, float* scores, uint16_t* probs,
               float* inv, uint16_t* out, int64_t o_stride, const uint16_t* next_k,
               int64_t next_n) {
  constexpr int64_t D = 32 * C2;
  constexpr int C = 2 * C2;  // fp32 accumulators per head
  constexpr int GB = C2 == 2 ? 4 : 2;  // heads per pass over the values: 16 accumulators
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh q[C2];
    for (int c = 0; c < C2; ++c)
      q[c] = as_bh(_mm512_loadu_si512(q_heads + g * q_stride + c * 32));
    float* sg = scores + g * L;
    for (int64_t r = 0; r < num_runs; ++r) {
      const uint16_t* kr = runs[r].k;
      const uint16_t* vr = runs[r].v;
      const int64_t n = runs[r].n;
      if (g == 0 && r + 1 < num_runs) prefetch(runs[r + 1].k, runs[r + 1].n * D);
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        if (g == 0) prefetch(vr + t * D, 16 * D);
        _mm512_storeu_ps(sg + t, _mm512_mul_ps(scores16_bf16<C2>(q, kr + t * D), sc));
      }
      if (g == 0 && t < n) prefetch(vr + t * D, (n - t) * D);
      for (; t < n; ++t) {  // the last < 16 keys of the run
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C2; ++c)
          a = _mm512_dpbf16_ps(a, q[c], as_bh(_mm512_loadu_si512(kr + t * D + c * 32)));
        sg[t] = _mm512_reduce_add_ps(a) * scale;
      }
      sg += n;
    }
    // The probabilities go to bf16 (nearest even) as exp writes them, in the same pass.
    const float* s = scores + g * L;
    inv[g] = 1.f / switchyard::exp_sum(s, L, switchyard::row_max(s, L), probs + g * L);
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t nh = std::min<int64_t>(GB, G - g0);
    __m512 acc[GB][C];
    for (int h = 0; h < GB; ++h)
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
    int64_t seen = 0;
    for (int64_t r = 0; r < num_runs; ++r) {
      const uint16_t* vr = runs[r].v;
      const int64_t n = runs[r].n;
      for (int64_t t = 0; t < n; t += 2) {
        const bool pair = t + 1 < n;
        if (g0 == 0 && seen + t < next_n) prefetch(next_k + (seen + t) * D, 2 * D);
        __m512bh v[C];
        for (int c = 0; c < C2; ++c) {
          const __m512i a = _mm512_loadu_si512(vr + t * D + c * 32);
          const __m512i b = pair ? _mm512_loadu_si512(vr + (t + 1) * D + c * 32) : zero;
          v[2 * c] = as_bh(_mm512_unpacklo_epi16(a, b));
          v[2 * c + 1] = as_bh(_mm512_unpackhi_epi16(a, b));
        }
        for (int h = 0; h < GB; ++h) {
          if (h >= nh) break;
          const uint16_t* ph = probs + (g0 + h) * L + seen + t;
          const uint32_t w2 = pair ? pair_at(ph) : static_cast<uint32_t>(ph[0]);
          const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(w2)));
          for (int c = 0; c < C; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], w, v[c]);
        }
      }
      seen += n;
    }
    for (int h = 0; h < nh; ++h) {
      alignas(64) float lanes[C][16];
      for (int c = 0; c < C; ++c)
        _mm512_store_ps(lanes[c], _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[g0 + h])));
      alignas(64) float res[D];
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < 16; ++l) res[value_dim(c, l)] = lanes[c][l];
      uint16_t* og = out + (g0 + h) * o_stride;
      for (int64_t c = 0; c < D; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(og + c),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(res + c))));
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2 (Zen 3): task_avx512's method 8 lanes wide; fp32 without its prefetches (this
// CPU's hardware prefetcher follows a run's keys and values unaided, and they cost fp32
// 5-10%), bf16 with them where heads go in pairs (`task_avx2_pairs`). A row of D values is
// D / 8 vectors, in an order that costs one instruction per vector to widen: fp32 in
// order; bf16 16 values at a time, a shift giving the even ones and a mask the odd
// (vector 2c holds dims 16c, 16c + 2, .., vector 2c + 1 dims 16c + 1, 16c + 3, ..). Query
// and output take the same order, so the dot products and the weighted sums are those
// of the rows as stored (Zen 3, 8 layers at batch 64, 256 tokens: bf16 16.3 -> 12.1 ms
// against the scalar loops, medians of five alternating rounds; fp32 25.3 -> 17.9).

// The dim of lane i of vector j.
template <typename T>
inline int64_t dim_of(int64_t j, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return 8 * j + i;
  } else {
    return 16 * (j / 2) + 2 * i + j % 2;
  }
}

// The D / 8 vectors (V) of a row of D values, as fp32.
template <int V>
inline void widen(const float* p, __m256* out) {
  for (int j = 0; j < V; ++j) out[j] = _mm256_loadu_ps(p + 8 * j);
}

template <int V>
inline void widen(const at::BFloat16* p, __m256* out) {
  for (int c = 0; c < V / 2; ++c) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c));
    out[2 * c] = switchyard::bf16_even8(x);
    out[2 * c + 1] = switchyard::bf16_odd8(x);
  }
}

// r[j] = sum of the 8 lanes of a[j], j < 8: two rounds of pairwise adds, then the two
// 128-bit halves.
inline __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

using switchyard::hsum8;

// The unscaled q.k of one key (V vectors), in 8 lanes to be summed.
template <typename T, int V>
inline __m256 dot_lanes(const __m256* q, const T* k) {
  __m256 kv[V];
  widen<V>(k, kv);
  __m256 a = _mm256_mul_ps(q[0], kv[0]);
  for (int j = 1; j < V; ++j) a = _mm256_fmadd_ps(q[j], kv[j], a);
  return a;
}

// Scores of one query head (q: V vectors) against the runs' keys, 8 keys per sum8,
// into sg.
template <typename T, int V>
inline void scores_one(const __m256* q, const Run<T>* runs, int64_t num_runs, float scale,
                       float* sg) {
  constexpr int64_t D = 8 * V;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < num_runs; ++r) {
    const T* kr = runs[r].k;
    const int64_t n = runs[r].n;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = dot_lanes<T, V>(q, kr + (t + j) * D);
      _mm256_storeu_ps(sg + t, _mm256_mul_ps(sum8(acc), sc));
    }
    for (; t < n; ++t) sg[t] = hsum8(dot_lanes<T, V>(q, kr + t * D)) * scale;
    sg += n;
  }
}

// One query head's values weighed by its probabilities sg, times w, into lanes (vector
// order).
template <typename T, int V>
inline void values_one(const float* sg, const Run<T>* runs, int64_t num_runs, float w,
                       float* lanes) {
  constexpr int64_t D = 8 * V;
  __m256 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t r = 0; r < num_runs; ++r) {
    const T* vr = runs[r].v;
    const int64_t n = runs[r].n;
    for (int64_t t = 0; t < n; ++t) {
      const __m256 p = _mm256_set1_ps(sg[t]);
      __m256 vv[V];
      widen<V>(vr + t * D, vv);
      for (int j = 0; j < V; ++j) acc[j] = _mm256_fmadd_ps(p, vv[j], acc[j]);
    }
    sg += n;
  }
  const __m256 wv = _mm256_set1_ps(w);
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(lanes + 8 * j, _mm256_mul_ps(acc[j], wv));
}

// Query head g's D values in vector order (dim_of), as fp32.
template <typename T, int V>
inline void query_lanes(const T* qg, float* lanes) {
  for (int64_t j = 0; j < V; ++j)
    for (int64_t i = 0; i < 8; ++i) lanes[8 * j + i] = load(qg + dim_of<T>(j, i));
}

// lanes (vector order) to a head's D outputs.
template <typename T, int V>
inline void store_lanes(const float* lanes, T* og) {
  for (int64_t j = 0; j < V; ++j)
    for (int64_t i = 0; i < 8; ++i) store(og + dim_of<T>(j, i), lanes[8 * j + i]);
}

// One (sequence, KV head) task with head_dim = 8 * V, a query head at a time: scores in
// 8-key blocks, softmax, then the values weighted into V accumulators.
template <typename T, int V>
void task_avx2(const T* q_heads, int64_t q_stride, int64_t G, const Run<T>* runs,
               int64_t num_runs, int64_t L, float scale, float* scores, float* inv, T* out,
               int64_t o_stride) {
  constexpr int64_t D = 8 * V;
  alignas(32) float lanes[D];
  for (int64_t g = 0; g < G; ++g) {
    query_lanes<T, V>(q_heads + g * q_stride, lanes);
    __m256 q[V];
    for (int j = 0; j < V; ++j) q[j] = _mm256_load_ps(lanes + 8 * j);
    scores_one<T, V>(q, runs, num_runs, scale, scores + g * L);
    inv[g] = softmax_unnormalised(scores + g * L, L);
  }
  for (int64_t g = 0; g < G; ++g) {
    values_one<T, V>(scores + g * L, runs, num_runs, inv[g], lanes);
    store_lanes<T, V>(lanes, out + g * o_stride);
  }
}

// Asks for n values from p into L2, a cache line at a time.
inline void prefetch_rows(const at::BFloat16* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// Vectors 2c and 2c + 1 of a bf16 row (dims 16c ..) as fp32, from p = row + 16c.
inline void widen2(const at::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = switchyard::bf16_even8(x);
  odd = switchyard::bf16_odd8(x);
}

// Scores of two query heads (qa, qb: V vectors each, vector order) against a run's n bf16
// keys, 4 keys x 2 heads per sum8: each key is widened once for both heads, and each dot
// product summed in dot_lanes' order. The same bits as `scores_one` but where a run's
// last n % 8 keys hold a block of 4: their lanes are summed by sum8 here, by hsum8 there
// (in another order). Asks for the run's values (vr) as it goes.
template <int V>
inline void scores_pair(const float* qa, const float* qb, const at::BFloat16* kr,
                        const at::BFloat16* vr, int64_t n, float scale, float* sa, float* sb) {
  constexpr int64_t D = 8 * V;
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    prefetch_rows(vr + t * D, 4 * D);
    __m256 acc[8];
    for (int i = 0; i < 4; ++i) {
      const at::BFloat16* k = kr + (t + i) * D;
      __m256 e, o;
      widen2(k, e, o);
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qa), e);
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(qb), e);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 8), o, a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 8), o, b);
      for (int c = 1; c < V / 2; ++c) {
        widen2(k + 16 * c, e, o);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 16 * c), e, a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 16 * c), e, b);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qa + 16 * c + 8), o, a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 16 * c + 8), o, b);
      }
      acc[i] = a;
      acc[4 + i] = b;
    }
    const __m256 s = _mm256_mul_ps(sum8(acc), sc);
    _mm_storeu_ps(sa + t, _mm256_castps256_ps128(s));
    _mm_storeu_ps(sb + t, _mm256_extractf128_ps(s, 1));
  }
  if (t < n) prefetch_rows(vr + t * D, (n - t) * D);
  for (; t < n; ++t) {
    __m256 qv[V];
    for (int j = 0; j < V; ++j) qv[j] = _mm256_loadu_ps(qa + 8 * j);
    sa[t] = hsum8(dot_lanes<at::BFloat16, V>(qv, kr + t * D)) * scale;
    for (int j = 0; j < V; ++j) qv[j] = _mm256_loadu_ps(qb + 8 * j);
    sb[t] = hsum8(dot_lanes<at::BFloat16, V>(qv, kr + t * D)) * scale;
  }
}

// Two query heads' values weighed by their probabilities (sa, sb), times (wa, wb), into
// la and lb (vector order): 16 keys at a time through a row's dims, 32 dims (8
// accumulators, 4 a head) a pass, so each row comes from memory once and again from L1.
// Asks for the next task's keys (next_k, next_n of them) as it goes when `fetch`.
template <int V>
inline void values_pair(const float* sa, const float* sb, const Run<at::BFloat16>* runs,
                        int64_t num_runs, float wa, float wb, float* la, float* lb,
                        const at::BFloat16* next_k, int64_t next_n) {
  constexpr int64_t D = 8 * V;
  __m256 acc[V / 4][8];
  for (int64_t c4 = 0; c4 < V / 4; ++c4)
    for (int j = 0; j < 8; ++j) acc[c4][j] = _mm256_setzero_ps();
  int64_t seen = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    const at::BFloat16* vr = runs[r].v;
    const int64_t n = runs[r].n;
    if (seen < next_n) prefetch_rows(next_k + seen * D, std::min(n, next_n - seen) * D);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t t1 = std::min(n, t0 + 16);
      for (int64_t c4 = 0; c4 < V / 4; ++c4) {
        __m256 a0 = acc[c4][0], a1 = acc[c4][1], a2 = acc[c4][2], a3 = acc[c4][3];
        __m256 b0 = acc[c4][4], b1 = acc[c4][5], b2 = acc[c4][6], b3 = acc[c4][7];
        for (int64_t t = t0; t < t1; ++t) {
          const __m256 pa = _mm256_set1_ps(sa[t]);
          const __m256 pb = _mm256_set1_ps(sb[t]);
          __m256 e0, o0, e1, o1;
          widen2(vr + t * D + 32 * c4, e0, o0);
          widen2(vr + t * D + 32 * c4 + 16, e1, o1);
          a0 = _mm256_fmadd_ps(pa, e0, a0);
          a1 = _mm256_fmadd_ps(pa, o0, a1);
          a2 = _mm256_fmadd_ps(pa, e1, a2);
          a3 = _mm256_fmadd_ps(pa, o1, a3);
          b0 = _mm256_fmadd_ps(pb, e0, b0);
          b1 = _mm256_fmadd_ps(pb, o0, b1);
          b2 = _mm256_fmadd_ps(pb, e1, b2);
          b3 = _mm256_fmadd_ps(pb, o1, b3);
        }
        acc[c4][0] = a0, acc[c4][1] = a1, acc[c4][2] = a2, acc[c4][3] = a3;
        acc[c4][4] = b0, acc[c4][5] = b1, acc[c4][6] = b2, acc[c4][7] = b3;
      }
    }
    sa += n;
    sb += n;
    seen += n;
  }
  for (int64_t c4 = 0; c4 < V / 4; ++c4)
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(la + 32 * c4 + 8 * j, _mm256_mul_ps(acc[c4][j], _mm256_set1_ps(wa)));
      _mm256_storeu_ps(lb + 32 * c4 + 8 * j, _mm256_mul_ps(acc[c4][4 + j], _mm256_set1_ps(wb)));
    }
}

// bf16 with two or more query heads per KV head: `task_avx2` with the heads taken two at
// a time, so a key or value is widened once for a pair, and with software prefetch (the
// run's values while the first pair scores, the next task's keys while it weighs). A
// head left over (G odd) goes alone. The same bits as `task_avx2` but for the scores of
// a block of 4 among a run's last n % 8 keys (see `scores_pair`). Zen 3, 8 layers at batch 64, ~256 tokens, alternating
// in one process: 12.0-12.9 -> 9.8-10.9 ms with 2 heads a KV head, 18.4-20.1 -> 15.8-16.8
// with 5. fp32 (bound by the KV's bytes) and a single head were 5-15% slower this way.
template <int V>
void task_avx2_pairs(const at::BFloat16* q_heads, int64_t q_stride, int64_t G,
                     const Run<at::BFloat16>* runs, int64_t num_runs, int64_t L, float scale,
                     float* scores, float* inv, float* qf, at::BFloat16* out, int64_t o_stride,
                     const at::BFloat16* next_k, int64_t next_n) {
  using T = at::BFloat16;
  constexpr int64_t D = 8 * V;
  for (int64_t g = 0; g < G; ++g) query_lanes<T, V>(q_heads + g * q_stride, qf + g * D);
  const int64_t pairs = G / 2;
  for (int64_t g = 0; g < 2 * pairs; g += 2) {
    float* sa = scores + g * L;
    float* sb = sa + L;
    for (int64_t r = 0; r < num_runs; ++r) {
      const int64_t n = runs[r].n;
      if (g == 0 && r + 1 < num_runs) prefetch_rows(runs[r + 1].k, runs[r + 1].n * D);
      scores_pair<V>(qf + g * D, qf + (g + 1) * D, runs[r].k, runs[r].v, n, scale, sa, sb);
      sa += n;
      sb += n;
    }
  }
  if (G % 2) {
    __m256 q[V];
    for (int j = 0; j < V; ++j) q[j] = _mm256_loadu_ps(qf + (G - 1) * D + 8 * j);
    scores_one<T, V>(q, runs, num_runs, scale, scores + (G - 1) * L);
  }
  for (int64_t g = 0; g < G; ++g) inv[g] = softmax_unnormalised(scores + g * L, L);
  // The outputs (vector order) take qf's place.
  for (int64_t g = 0; g < 2 * pairs; g += 2)
    values_pair<V>(scores + g * L, scores + (g + 1) * L, runs, num_runs, inv[g], inv[g + 1],
                   qf + g * D, qf + (g + 1) * D, g == 0 ? next_k : nullptr, g == 0 ? next_n : 0);
  if (G % 2) values_one<T, V>(scores + (G - 1) * L, runs, num_runs, inv[G - 1], qf + (G - 1) * D);
  for (int64_t g = 0; g < G; ++g) store_lanes<T, V>(qf + g * D, out + g * o_stride);
}
#endif

// The same without AVX-512 or AVX2 (or at another head dim): q_heads are G rows, scaled
// first.
template <typename T>
void task_scalar(const T* q_heads, int64_t q_stride, int64_t G, int64_t D, const Run<T>* runs,
                 int64_t num_runs, int64_t L, float scale, float* scores, float* inv, float* qf,
                 float* acc, T* out, int64_t o_stride) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q_heads + g * q_stride + d) * scale;
  int64_t t0 = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    for (int64_t t = 0; t < runs[r].n; ++t) {
      const T* kt = runs[r].k + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kt + d);
        scores[g * L + t0 + t] = dot;
      }
    }
    t0 += runs[r].n;
  }
  for (int64_t g = 0; g < G; ++g) inv[g] = softmax_unnormalised(scores + g * L, L);
  std::fill(acc, acc + G * D, 0.f);
  t0 = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    for (int64_t t = 0; t < runs[r].n; ++t) {
      const T* vt = runs[r].v + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + t0 + t];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vt + d);
      }
    }
    t0 += runs[r].n;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) store(out + g * o_stride + d, acc[g * D + d] * inv[g]);
}

// Runs every (sequence, KV head) task, 8 at a time to whichever thread asks
// (`parallel_claims`): `runs_of(task, runs)` fills the task's runs and returns how many,
// with L = lengths[s] keys in all. A thread knows its next task before it starts the
// current one, for the prefetch of its keys.
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
    std::vector<float> scores(G * max_len), qf(G * D), acc(G * D), inv(G);
    std::vector<uint16_t> probs(std::is_same_v<T, float> ? 0 : G * max_len);
    std::vector<Run<T>> runs(max_runs), next(max_runs);
    int64_t num_runs = runs_of(task, runs.data());
    for (int64_t after; task < tasks; task = after) {
      after = claims.next();  // this thread's next task: its keys are prefetched
      const int64_t s = task / Hkv, h = task % Hkv, L = lp[s];
      const T* qh = qp + s * q_s0 + h * G * q_s1;
      T* oh = op + s * o_s0 + h * G * o_s1;
      const int64_t next_runs = after < tasks ? runs_of(after, next.data()) : 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (D == 64 || D == 128) {
          const auto bits = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
          const uint16_t* next_k = next_runs ? bits(next[0].k) : nullptr;
          const int64_t next_n = next_runs ? next[0].n : 0;
          const auto* rb = reinterpret_cast<const Run<uint16_t>*>(runs.data());
          auto* ob = reinterpret_cast<uint16_t*>(oh);
          if (D == 64) {
            task_bf16<2>(bits(qh), q_s1, G, rb, num_runs, L, scale, scores.data(), probs.data(),
                         inv.data(), ob, o_s1, next_k, next_n);
          } else {
            task_bf16<4>(bits(qh), q_s1, G, rb, num_runs, L, scale, scores.data(), probs.data(),
                         inv.data(), ob, o_s1, next_k, next_n);
          }
          std::swap(runs, next);
          num_runs = next_runs;
          continue;
        }
      }
#endif
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        const T* next_k = next_runs ? next[0].k : nullptr;
        const int64_t next_n = next_runs ? next[0].n : 0;
        if (D == 64) {
          task_avx512<T, 4>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                            inv.data(), oh, o_s1, next_k, next_n);
        } else {
          task_avx512<T, 8>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                            inv.data(), oh, o_s1, next_k, next_n);
        }
      } else
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (G >= 2 && (D == 64 || D == 128)) {
          const T* next_k = next_runs ? next[0].k : nullptr;
          const int64_t next_n = next_runs ? next[0].n : 0;
          if (D == 64) {
            task_avx2_pairs<8>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                               inv.data(), qf.data(), oh, o_s1, next_k, next_n);
          } else {
            task_avx2_pairs<16>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                                inv.data(), qf.data(), oh, o_s1, next_k, next_n);
          }
          std::swap(runs, next);
          num_runs = next_runs;
          continue;
        }
      }
      if (D == 64 || D == 128) {
        if (D == 64) {
          task_avx2<T, 8>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                          inv.data(), oh, o_s1);
        } else {
          task_avx2<T, 16>(qh, q_s1, G, runs.data(), num_runs, L, scale, scores.data(),
                           inv.data(), oh, o_s1);
        }
      } else
#endif
        task_scalar<T>(qh, q_s1, G, D, runs.data(), num_runs, L, scale, scores.data(),
                       inv.data(), qf.data(), acc.data(), oh, o_s1);
      std::swap(runs, next);
      num_runs = next_runs;
    }
  });
}

// Workspace rows: appends this step's key/value at position lengths[s] - 1 of row s, then
// attends over the row (one run).
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
         const at::Tensor& k_ws, const at::Tensor& v_ws, const at::Tensor& lengths,
         float scale, const at::Tensor& out) {
  const int64_t S = q.size(0), D = q.size(2);
  const int64_t Hkv = k_ws.size(0), R = k_ws.size(1), Tmax = k_ws.size(2);
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  T* kp = k_ws.data_ptr<T>();
  T* vp = v_ws.data_ptr<T>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t k_s0 = k_new.stride(0), k_s1 = k_new.stride(1);
  const int64_t v_s0 = v_new.stride(0), v_s1 = v_new.stride(1);
  at::parallel_for(0, S * Hkv, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hkv, h = task % Hkv, L = lp[s];
      std::memcpy(kp + ((h * R + s) * Tmax + L - 1) * D, knp + s * k_s0 + h * k_s1, D * sizeof(T));
      std::memcpy(vp + ((h * R + s) * Tmax + L - 1) * D, vnp + s * v_s0 + h * v_s1, D * sizeof(T));
    }
  });
  attend<T>(q, Hkv, lp, 1, scale, out, [&](int64_t task, Run<T>* runs) {
    const int64_t s = task / Hkv, h = task % Hkv;
    const int64_t row = (h * R + s) * Tmax * D;
    runs[0] = Run<T>{kp + row, vp + row, lp[s]};
    return int64_t{1};
  });
}

// The paged cache in place: sequence s's keys are the first lengths[s] slots of the blocks
// tables[s] (block b holds slots b * block_size ..), this step's already written there.
template <typename T>
void run_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size,
               float scale, const at::Tensor& out) {
  const int64_t Hkv = k_cache.size(0), slots = k_cache.size(1), D = k_cache.size(2);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  const int64_t* lp = lengths.data_ptr<int64_t>();
  attend<T>(q, Hkv, lp, width, scale, out, [&](int64_t task, Run<T>* runs) {
    const int64_t s = task / Hkv, h = task % Hkv, L = lp[s];
    const int64_t n = (L + block_size - 1) / block_size;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t at = (h * slots + tp[s * width + b] * block_size) * D;
      runs[b] = Run<T>{kp + at, vp + at, std::min(block_size, L - b * block_size)};
    }
    return n;
  });
}

void check(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
           const at::Tensor& k_ws, const at::Tensor& v_ws, const at::Tensor& lengths,
           const at::Tensor& out) {
  for (const auto* t : {&q, &k_new, &v_new, &k_ws, &v_ws, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "decode_attention: CPU tensors only");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "decode_attention: one dtype");
    TORCH_CHECK(t->dim() >= 3 && t->stride(-1) == 1, "decode_attention: last dim contiguous");
  }
  TORCH_CHECK(k_ws.is_contiguous() && v_ws.is_contiguous(), "workspace must be contiguous");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous(), "int64 lengths");
  const int64_t S = q.size(0);
  TORCH_CHECK(S > 0 && lengths.size(0) == S && out.size(0) == S, "one length per query");
  TORCH_CHECK(S <= k_ws.size(1), "more queries than workspace rows");
  TORCH_CHECK(q.size(1) % k_ws.size(0) == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_ws.size(3) && out.size(1) == q.size(1), "head shapes differ");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= k_ws.size(2), "length outside the workspace row");
}

void check_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size,
                 const at::Tensor& out) {
  for (const auto* t : {&q, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: CPU tensors only");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "paged_decode_attention: one dtype");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "paged_decode_attention: 3 dims, contiguous last");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "paged_decode_attention: caches of one shape");
  TORCH_CHECK(block_size > 0 && k_cache.size(1) % block_size == 0, "block_size must divide slots");
  const int64_t S = q.size(0);
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == S, "one int64 length per query");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == S, "int64 block tables [seqs, max_blocks]");
  TORCH_CHECK(S > 0 && out.size(0) == S && out.size(1) == q.size(1), "one output per query");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && out.size(2) == q.size(2), "head shapes differ");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t width = tables.size(1), num_blocks = k_cache.size(1) / block_size;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= width * block_size, "length beyond the block table");
    for (int64_t b = 0; b < (lp[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[s * width + b] >= 0 && tp[s * width + b] < num_blocks, "block id out of range");
  }
}

}  // namespace

// Attention of q ([seqs, heads, dim]) over each sequence's first lengths[s] tokens in the
// paged cache (k_cache/v_cache [kv_heads, slots, dim]; tables [seqs, max_blocks] of block
// ids), read in place, block by block; this step's keys/values must be written already.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lengths, int64_t block_size, double scale,
                            const at::Tensor& out) {
  check_paged(q, k_cache, v_cache, tables, lengths, block_size, out);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run_paged<float>(q, k_cache, v_cache, tables, lengths, block_size, sc, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run_paged<at::BFloat16>(q, k_cache, v_cache, tables, lengths, block_size, sc, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16");
  }
}

// Appends k_new/v_new ([seqs, kv_heads, dim]) at position lengths - 1 of rows 0..seqs-1
// and writes the attention of q ([seqs, heads, dim]) into out ([seqs, heads, dim]).
void decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                      const at::Tensor& k_ws, const at::Tensor& v_ws, const at::Tensor& lengths,
                      double scale, const at::Tensor& out) {
  check(q, k_new, v_new, k_ws, v_ws, lengths, out);
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_new, v_new, k_ws, v_ws, lengths, sc, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_new, v_new, k_ws, v_ws, lengths, sc, out);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over the workspace");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged cache, in place");
}
