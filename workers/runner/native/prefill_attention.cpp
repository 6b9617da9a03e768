// Causal attention of a prompt chunk over its keys (the chunk's own and any cached context
// before it), fp32 or bf16, for CPUs with AVX-512 (bf16: AVX512-BF16).
//
// torch's CPU flash-attention kernel ran prompts of the bench model at 20-100 GFLOP/s
// (272 tokens: 2.2 ms a layer; 2,048: 46 ms), far below what the vector units give. Here
// the keys are packed once per KV head in blocks of 16, so that a query's scores against
// a block accumulate in one register a dim at a time, with no horizontal sum:
//
//  - fp32: a block is [D][16] (dim-major); one FMA per dim and query row;
//  - bf16: a block is [D/2][16][2] (a dim pair of each key side by side), and values are
//    packed [key pairs][D][2]: every product is one VDPBF16PS (32 bf16 multiply-adds into
//    fp32), for the scores and for the weighted sum of values alike.
//
// A task is (KV head, block of 16 query tokens): its G query heads' scores against every
// key they may see, an exact softmax per row in fp32, then the values. bf16 rounds the
// probabilities to bf16 before weighing values, as torch's kernel does. Scores go eight
// rows by two key blocks at a time (16 accumulators; one broadcast of a query dim for
// both blocks), the key blocks outer so that each is read once for all the task's rows;
// values go in chunks of 32 key groups likewise, their sums waiting in L1 between chunks.
// Against one block of eight rows, each over all keys: bf16 2,048 tokens 8.88 -> 8.04 ms
// a layer (534 GFLOP/s, 2 cores of a Zen 5), 272 tokens and fp32 level, the same bits.
//
// Every call packs its keys and values again (a chunk's context included), with 16 x 16
// transposes of 32-bit units (bf16: values interleaved in pairs by a permute), into
// buffers that live with the thread: a short chunk after a long context paid more for
// the packing than for its attention, and fp32 for faulting fresh buffers in on every
// call. 16 tokens after 2,048: bf16 0.25 -> 0.14 ms a layer, fp32 2.9 -> 0.48 ms; 64
// after 2,048: bf16 0.57 -> 0.46 ms; the same bits.
//
// Numerics: fp32 accumulation throughout, in a different order from torch's: fp32 differs
// from SDPA in the last bits (the fp32 parity tests against transformers run on it); bf16
// is tested against transformers bf16 by closeness, as the rest of the bf16 path.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#define SWITCHYARD_PREFILL 1  // fp32
#if defined(__AVX512BF16__)
#define SWITCHYARD_PREFILL_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#define SWITCHYARD_PREFILL_AVX2 1  // fp32 and bf16, in fp32
#endif

namespace {

#if defined(SWITCHYARD_PREFILL) || defined(SWITCHYARD_PREFILL_AVX2)
constexpr int64_t kQueries = 16;  // query tokens per task
constexpr int64_t kGroups = 32;  // key groups (fp32: keys; bf16: pairs) per chunk of values

// A buffer of at least n elements that lives as long as the thread (the engine's, and
// the OpenMP pool's): a fresh allocation of the packed keys (megabytes) on every call
// page-faulted its way in, about 1 ms a layer in fp32 over 2,048 keys.
template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <typename T>
thread_local std::vector<T> packed_keys;
template <typename T>
thread_local std::vector<T> packed_values;

#endif

#if defined(SWITCHYARD_PREFILL)

constexpr int64_t kKeys = 16;  // keys per packed block (one vector of fp32 scores)

// Storage types: float, or uint16_t holding bf16 bits. kPair: values side by side in a
// packed lane (bf16 pairs for VDPBF16PS).
template <typename T>
constexpr int64_t kPair = std::is_same_v<T, float> ? 1 : 2;

#if defined(SWITCHYARD_PREFILL_BF16)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
#endif

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// In place: r[i] lane j <- r[j] lane i, 32-bit lanes (unpack, then shuffles of 32-bit
// lanes within 128-bit lanes, then of 128-bit lanes twice).
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + k], 128-bit lane L: column 4 L + k, rows 4 i ..
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    t[8 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xDD);
  }
}

// One KV head's keys (n rows of D at k, row stride ks) in blocks of 16 keys:
// out[b][d / P][j][d % P] = k[16 b + j][d], the last block's rows past n written as zeros.
// A block is 16 rows of D / P 32-bit units (a float, or a bf16 pair), transposed 16 units
// at a time.
template <typename T>
void pack_keys(const T* k, int64_t ks, int64_t n, int64_t D, T* out) {
  constexpr int64_t P = kPair<T>;
  const int64_t units = D / P;
  for (int64_t b = 0; b * kKeys < n; ++b) {
    const int64_t rows = std::min<int64_t>(kKeys, n - b * kKeys);
    float* blk = reinterpret_cast<float*>(out + b * kKeys * D);
    for (int64_t c = 0; c < units; c += 16) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) {
        const auto* row = reinterpret_cast<const float*>(k + (b * kKeys + j) * ks);
        r[j] = j < rows ? _mm512_loadu_ps(row + c) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(blk + (c + i) * kKeys, r[i]);
    }
  }
}

// One KV head's values: out[t / P][d][t % P] = v[t][d], zeros past n (fp32: a copy;
// bf16: two rows interleaved, 32 values of each at a time).
template <typename T>
void pack_values(const T* v, int64_t vs, int64_t n, int64_t D, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < n; ++t) std::memcpy(out + t * D, v + t * vs, D * sizeof(float));
  } else {
    alignas(64) static constexpr uint16_t lo_idx[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t g = 0; g < (n + 1) / 2; ++g) {
      const T* a = v + 2 * g * vs;
      const bool pair = 2 * g + 1 < n;
      T* o = out + g * D * 2;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = _mm512_loadu_si512(a + d);
        const __m512i y = pair ? _mm512_loadu_si512(a + vs + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(o + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512(o + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
      }
    }
  }
}

// Scores of ROWS query rows against NB neighbouring packed blocks of 16 keys, scaled,
// into s[r * ld + 16 nb ..]: ROWS x NB accumulators, each query broadcast once per dim
// (pair) for all NB blocks.
template <typename T, int64_t D, int ROWS, int NB = 1>
inline void score_rows(const T* const* q, const T* kb, float scale, float* s, int64_t ld) {
  __m512 acc[NB][ROWS];
  for (int nb = 0; nb < NB; ++nb)
    for (int r = 0; r < ROWS; ++r) acc[nb][r] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t d = 0; d < D; ++d) {
      __m512 kv[NB];
      for (int nb = 0; nb < NB; ++nb) kv[nb] = _mm512_loadu_ps(kb + nb * kKeys * D + d * kKeys);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 qv = _mm512_set1_ps(q[r][d]);
        for (int nb = 0; nb < NB; ++nb) acc[nb][r] = _mm512_fmadd_ps(qv, kv[nb], acc[nb][r]);
      }
    }
  } else {
#if defined(SWITCHYARD_PREFILL_BF16)
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      __m512bh kv[NB];
      for (int nb = 0; nb < NB; ++nb)
        kv[nb] = as_bh(_mm512_loadu_si512(kb + nb * kKeys * D + d2 * kKeys * 2));
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh qv = as_bh(_mm512_set1_epi32(pair_at(q[r] + 2 * d2)));
        for (int nb = 0; nb < NB; ++nb) acc[nb][r] = _mm512_dpbf16_ps(acc[nb][r], qv, kv[nb]);
      }
    }
#endif
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int nb = 0; nb < NB; ++nb)
    for (int r = 0; r < ROWS; ++r)
      _mm512_storeu_ps(s + r * ld + nb * kKeys, _mm512_mul_ps(acc[nb][r], sc));
}

template <typename T, int64_t D>
inline void score_block(const T* const* q, int rows, const T* kb, float scale, float* s,
                        int64_t ld) {
  if (rows == 8) return score_rows<T, D, 8>(q, kb, scale, s, ld);
  for (int r = 0; r < rows; ++r) score_rows<T, D, 1>(q + r, kb, scale, s + r * ld, ld);
}

// R rows of probabilities times the packed values of key groups j0 .. j1 (fp32: keys;
// bf16: key pairs), added to acc[r][0..D) (fp32, in L1 between calls: the sums run over
// the groups in order whatever the chunking). D / 16 register accumulators a row.
template <typename T, int64_t D, int R>
inline void weigh_values(const T* const* p, const T* vp, int64_t j0, int64_t j1,
                         float (*acc_io)[D]) {
  constexpr int C = D / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(acc_io[r] + c * 16);
  for (int64_t j = j0; j < j1; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      const float* vj = vp + j * D;
      __m512 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm512_set1_ps(p[r][j]);
      for (int c = 0; c < C; ++c) {
        const __m512 v = _mm512_loadu_ps(vj + c * 16);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(w[r], v, acc[r][c]);
      }
    } else {
#if defined(SWITCHYARD_PREFILL_BF16)
      const uint16_t* vj = vp + j * D * 2;
      __m512bh w[R];
      for (int r = 0; r < R; ++r) w[r] = as_bh(_mm512_set1_epi32(pair_at(p[r] + 2 * j)));
      for (int c = 0; c < C; ++c) {
        const __m512bh v = as_bh(_mm512_loadu_si512(vj + c * 32));
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[r], v);
      }
#endif
    }
  }
  // Lane l of chunk c holds dim 16 c + l (bf16: the key pairs summed in the instruction).
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_io[r] + c * 16, acc[r][c]);
}

// 16 outputs of a row: fp32 as they are, bf16 rounded to nearest even (as c10::BFloat16).
inline void put16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }
#if defined(SWITCHYARD_PREFILL_BF16)
inline void put16(uint16_t* o, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}
#endif

// q [nq, Hq, D]; k, v [nk, Hkv, D] with nk >= nq: query i sits at position nk - nq + i and
// sees keys 0 .. nk - nq + i.
template <typename T, int64_t D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
         const at::Tensor& out) {
  constexpr int64_t P = kPair<T>;
  constexpr int R = D <= 64 ? 4 : 2;  // rows per value pass: 16 accumulators
  const int64_t nq = q.size(0), nk = k.size(0), offset = nk - nq;
  const int64_t Hq = q.size(1), Hkv = k.size(1), G = Hq / Hkv;
  const auto* qp = reinterpret_cast<const T*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const T*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const T*>(v.data_ptr());
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t blocks = (nk + kKeys - 1) / kKeys, groups = (nk + P - 1) / P;
  const int64_t key_head = blocks * kKeys * D, value_head = groups * P * D;
  // Every element is written by the packing (a partial block's missing keys as zeros).
  T* keys = scratch(packed_keys<T>, Hkv * key_head);
  T* values = scratch(packed_values<T>, Hkv * value_head);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys(kp + h * ks1, ks0, nk, D, keys + h * key_head);
      pack_values(vp + h * vs1, vs0, nk, D, values + h * value_head);
    }
  });
  const int64_t qblocks = (nq + kQueries - 1) / kQueries;
  const int64_t width = blocks * kKeys;  // a score row, padded to whole key blocks
  const int64_t pwidth = width + 2 * R + 2;  // a probability row, and the pad beyond it
  // Tasks head-major: with as many threads as KV heads divide into, each thread gets the
  // same mix of short (early) and long (late) query blocks.
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueries * G;
    // What a row reads of these, it has written first (res is zeroed per task).
    static thread_local std::vector<float> scores_buf, sums_buf, res_buf;
    static thread_local std::vector<T> probs_buf;
    static thread_local std::vector<const T*> qrow_buf;
    float* scores = scratch(scores_buf, max_rows * width);
    float* sums = scratch(sums_buf, max_rows);
    float* res = scratch(res_buf, (max_rows + R) * D);
    T* probs = scratch(probs_buf, max_rows * pwidth);
    const T** qrow = scratch(qrow_buf, max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / qblocks, qb = task % qblocks;
      const int64_t t0 = qb * kQueries, t1 = std::min(nq, t0 + kQueries);
      const int64_t rows = (t1 - t0) * G;  // row r: token t0 + r / G, query head h G + r % G
      const T* kh = keys + h * key_head;
      const T* vh = values + h * value_head;
      // Row r sees len(r) keys; rows are in token order, so a group's last row sees most.
      auto len = [&](int64_t r) { return offset + t0 + r / G + 1; };
      for (int64_t r = 0; r < rows; ++r)
        qrow[r] = qp + (t0 + r / G) * qs0 + (h * G + r % G) * qs1;
      // Two key blocks at a time, outer, so that they are read from L2 once for all the
      // task's rows (rows inner, eight at a time; a group whose rows end before a block
      // skips it).
      for (int64_t b = 0; b * kKeys < len(rows - 1); b += 2) {
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
          const int rr = static_cast<int>(std::min<int64_t>(8, rows - r0));
          const int64_t seen = len(r0 + rr - 1);
          float* sb = scores + r0 * width + b * kKeys;
          const T* kb = kh + b * kKeys * D;
          if (rr == 8 && (b + 1) * kKeys < seen) {
            score_rows<T, D, 8, 2>(qrow + r0, kb, scale, sb, width);
            continue;
          }
          for (int64_t nb = 0; nb < 2 && (b + nb) * kKeys < seen; ++nb)
            score_block<T, D>(qrow + r0, rr, kb + nb * kKeys * D, scale, sb + nb * kKeys,
                              width);
        }
      }
      // Softmax of each row over its keys, in fp32; the probabilities stored in T, with
      // zeros past the row's end as far as the value pass reads (its group's longest row,
      // up to R - 1 rows later, rounded up to a key pair).
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = len(r);
        float* s = scores + r * width;
        T* pr = probs + r * pwidth;
        sums[r] = switchyard::exp_sum(s, n, switchyard::row_max(s, n), pr);
        std::fill(pr + n, pr + std::min(pwidth, n + 2 * R + 2), T(0));
      }
      // Values in chunks of kGroups key groups, each read from L2 once for all the rows
      // (R at a time, their sums kept in `res` between chunks); a short last group of
      // rows repeats its last row into the spare rows of `res`.
      auto* acc = reinterpret_cast<float(*)[D]>(res);
      std::fill(res, res + (max_rows + R) * D, 0.f);
      const auto groups = [&](int64_t r) { return (len(r) + P - 1) / P; };
      for (int64_t j0 = 0; j0 < groups(rows - 1); j0 += kGroups) {
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
          const int64_t rr = std::min<int64_t>(R, rows - r0);
          const int64_t j1 = std::min(j0 + kGroups, groups(r0 + rr - 1));
          if (j0 >= j1) continue;
          const T* prow[R];
          for (int r = 0; r < R; ++r)
            prow[r] = probs + (r0 + std::min<int64_t>(r, rr - 1)) * pwidth;
          weigh_values<T, D, R>(prow, vh, j0, j1, acc + r0);
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const __m512 inv = _mm512_set1_ps(1.f / sums[row]);
        T* o = op + (t0 + row / G) * os0 + (h * G + row % G) * os1;
        for (int64_t c = 0; c < D; c += 16)
          put16(o + c, _mm512_mul_ps(_mm512_loadu_ps(acc[row] + c), inv));
      }
    }
  });
}

#endif  // SWITCHYARD_PREFILL

#if defined(SWITCHYARD_PREFILL_AVX2)
// AVX2 (Zen 3): the same tasks, 8 lanes wide and in fp32 whatever the storage. Keys are
// packed in blocks of 8 ([D][8], dim-major, by 8 x 8 transposes) and values copied, both
// widened from bf16 once per call; a task's bf16 query rows are widened once. Scores go
// six rows by two key blocks at a time (12 accumulators, the two blocks' key vectors and
// a broadcast: 15 of the 16 registers); values three rows by 32 dims. bf16 rounds the
// probabilities and the outputs to bf16 where the AVX-512 path does, so the two differ
// only in the order of fp32 sums.

constexpr int64_t kKeys8 = 8;  // keys per packed block (one vector of fp32 scores)
constexpr int kScoreRows = 6;
constexpr int kValueRows = 3;

// 8 values from p as fp32 (bf16 bits shifted into place).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 outputs of a row: fp32 as they are, bf16 rounded to nearest even (as c10::BFloat16).
inline void put8(float* o, __m256 x) { _mm256_storeu_ps(o, x); }
inline void put8(uint16_t* o, __m256 x) {
  const __m256i r = switchyard::bf16_round8(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
}

// x as it is stored in T, back in fp32 (bf16: rounded to nearest even).
template <typename T>
inline __m256 as_stored8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(switchyard::bf16_round8(x), 16));
  }
}

// In place: r[i] lane j <- r[j] lane i (unpack pairs, shuffle quads, swap 128-bit halves).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4 i + k], 128-bit half L: column 4 L + k, rows 4 i ..
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

// One KV head's keys (n rows of D at k, row stride ks) in fp32 blocks of 8 keys:
// out[b][d][j] = k[8 b + j][d], the last block's rows past n written as zeros.
template <typename T>
void pack_keys8(const T* k, int64_t ks, int64_t n, int64_t D, float* out) {
  for (int64_t b = 0; b * kKeys8 < n; ++b) {
    const int64_t rows = std::min<int64_t>(kKeys8, n - b * kKeys8);
    float* blk = out + b * kKeys8 * D;
    for (int64_t c = 0; c < D; c += 8) {
      __m256 r[8];
      for (int64_t j = 0; j < 8; ++j)
        r[j] = j < rows ? load8(k + (b * kKeys8 + j) * ks + c) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(blk + (c + i) * kKeys8, r[i]);
    }
  }
}

// One KV head's values in fp32: out[t][d] = v[t][d].
template <typename T>
void pack_values8(const T* v, int64_t vs, int64_t n, int64_t D, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(out + t * D + c, load8(v + t * vs + c));
}

// Scores of ROWS query rows against NB neighbouring packed blocks of 8 keys, scaled, into
// s[r * ld + 8 nb ..]: each query dim broadcast once for all NB blocks.
template <int64_t D, int ROWS, int NB = 1>
inline void score_rows8(const float* const* q, const float* kb, float scale, float* s,
                        int64_t ld) {
  __m256 acc[NB][ROWS];
  for (int nb = 0; nb < NB; ++nb)
    for (int r = 0; r < ROWS; ++r) acc[nb][r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 kv[NB];
    for (int nb = 0; nb < NB; ++nb) kv[nb] = _mm256_loadu_ps(kb + nb * kKeys8 * D + d * kKeys8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q[r] + d);
      for (int nb = 0; nb < NB; ++nb) acc[nb][r] = _mm256_fmadd_ps(qv, kv[nb], acc[nb][r]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int nb = 0; nb < NB; ++nb)
    for (int r = 0; r < ROWS; ++r)
      _mm256_storeu_ps(s + r * ld + nb * kKeys8, _mm256_mul_ps(acc[nb][r], sc));
}

template <int64_t D>
inline void score_block8(const float* const* q, int rows, const float* kb, float scale,
                         float* s, int64_t ld) {
  switch (rows) {
    case 6: return score_rows8<D, 6>(q, kb, scale, s, ld);
    case 5: return score_rows8<D, 5>(q, kb, scale, s, ld);
    case 4: return score_rows8<D, 4>(q, kb, scale, s, ld);
    case 3: return score_rows8<D, 3>(q, kb, scale, s, ld);
    case 2: return score_rows8<D, 2>(q, kb, scale, s, ld);
    default: return score_rows8<D, 1>(q, kb, scale, s, ld);
  }
}

// Lanes 0 .. left - 1 of a vector (all 8 from left = 8 up): a row's ragged end.
inline __m256i head_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// max of s[0 .. n).
inline float row_max8(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float best = _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
  for (; j < n; ++j) best = std::max(best, s[j]);
  return best;
}

// out[j] = exp(s[j] - m) as stored in T, j < n; returns the sum of the unrounded exps.
template <typename T>
inline float exp_sum8(const float* s, int64_t n, float m, float* out) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i k = head_mask8(n - j);  // all lanes but at the row's end
    const __m256 e = switchyard::exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), mv));
    const __m256 kept = _mm256_and_ps(e, _mm256_castsi256_ps(k));
    sum = _mm256_add_ps(sum, kept);
    _mm256_maskstore_ps(out + j, k, as_stored8<T>(kept));
  }
  return switchyard::hsum8(sum);
}

// R rows of probabilities times the values of keys j0 .. j1, added to acc[r][0..D) (in L1
// between calls), 32 dims at a time: 4 R register accumulators.
template <int64_t D, int R>
inline void weigh_values8(const float* const* p, const float* vp, int64_t j0, int64_t j1,
                          float (*acc_io)[D]) {
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(acc_io[r] + c0 + 8 * c);
    for (int64_t j = j0; j < j1; ++j) {
      const float* vj = vp + j * D + c0;
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(p[r] + j);
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(vj + 8 * c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], v, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc_io[r] + c0 + 8 * c, acc[r][c]);
  }
}

// q [nq, Hq, D]; k, v [nk, Hkv, D] with nk >= nq: query i sits at position nk - nq + i and
// sees keys 0 .. nk - nq + i. T: float, or uint16_t holding bf16 bits.
template <typename T, int64_t D>
void run8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
          const at::Tensor& out) {
  constexpr int R = kValueRows;
  const int64_t nq = q.size(0), nk = k.size(0), offset = nk - nq;
  const int64_t Hq = q.size(1), Hkv = k.size(1), G = Hq / Hkv;
  const auto* qp = reinterpret_cast<const T*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const T*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const T*>(v.data_ptr());
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t blocks = (nk + kKeys8 - 1) / kKeys8;
  const int64_t key_head = blocks * kKeys8 * D, value_head = nk * D;
  float* keys = scratch(packed_keys<float>, Hkv * key_head);
  float* values = scratch(packed_values<float>, Hkv * value_head);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys8(kp + h * ks1, ks0, nk, D, keys + h * key_head);
      pack_values8(vp + h * vs1, vs0, nk, D, values + h * value_head);
    }
  });
  const int64_t qblocks = (nq + kQueries - 1) / kQueries;
  const int64_t width = blocks * kKeys8;  // a score row, padded to whole key blocks
  const int64_t pwidth = width + R;  // a probability row, and the pad beyond it
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueries * G;
    // What a row reads of these, it has written first (res is zeroed per task).
    static thread_local std::vector<float> scores_buf, sums_buf, res_buf, probs_buf, wide_buf;
    static thread_local std::vector<const float*> qrow_buf;
    float* scores = scratch(scores_buf, max_rows * width);
    float* sums = scratch(sums_buf, max_rows);
    float* res = scratch(res_buf, (max_rows + R) * D);
    float* probs = scratch(probs_buf, max_rows * pwidth);
    float* wide = scratch(wide_buf, std::is_same_v<T, float> ? 0 : max_rows * D);
    const float** qrow = scratch(qrow_buf, max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / qblocks, qb = task % qblocks;
      const int64_t t0 = qb * kQueries, t1 = std::min(nq, t0 + kQueries);
      const int64_t rows = (t1 - t0) * G;  // row r: token t0 + r / G, query head h G + r % G
      const float* kh = keys + h * key_head;
      const float* vh = values + h * value_head;
      auto len = [&](int64_t r) { return offset + t0 + r / G + 1; };
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = qp + (t0 + r / G) * qs0 + (h * G + r % G) * qs1;
        if constexpr (std::is_same_v<T, float>) {
          qrow[r] = row;
        } else {
          for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(wide + r * D + c, load8(row + c));
          qrow[r] = wide + r * D;
        }
      }
      // Two key blocks at a time, outer, so that they are read from L1/L2 once for all
      // the task's rows (six at a time; a group whose rows end before a block skips it).
      for (int64_t b = 0; b * kKeys8 < len(rows - 1); b += 2) {
        for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
          const int rr = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r0));
          const int64_t seen = len(r0 + rr - 1);
          float* sb = scores + r0 * width + b * kKeys8;
          const float* kb = kh + b * kKeys8 * D;
          if (rr == kScoreRows && (b + 1) * kKeys8 < seen) {
            score_rows8<D, kScoreRows, 2>(qrow + r0, kb, scale, sb, width);
            continue;
          }
          for (int64_t nb = 0; nb < 2 && (b + nb) * kKeys8 < seen; ++nb)
            score_block8<D>(qrow + r0, rr, kb + nb * kKeys8 * D, scale, sb + nb * kKeys8,
                            width);
        }
      }
      // Softmax of each row over its keys, in fp32; zeros past the row's end as far as
      // the value pass reads (its group's longest row, up to R - 1 rows later).
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = len(r);
        float* s = scores + r * width;
        float* pr = probs + r * pwidth;
        sums[r] = exp_sum8<T>(s, n, row_max8(s, n), pr);
        std::fill(pr + n, pr + std::min(pwidth, n + R), 0.f);
      }
      // Values in chunks of kGroups keys, each read from L1/L2 once for all the rows (R at
      // a time, their sums kept in `res` between chunks); a short last group of rows
      // repeats its last row into the spare rows of `res`.
      auto* acc = reinterpret_cast<float(*)[D]>(res);
      std::fill(res, res + (max_rows + R) * D, 0.f);
      for (int64_t j0 = 0; j0 < len(rows - 1); j0 += kGroups) {
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
          const int64_t rr = std::min<int64_t>(R, rows - r0);
          const int64_t j1 = std::min(j0 + kGroups, len(r0 + rr - 1));
          if (j0 >= j1) continue;
          const float* prow[R];
          for (int r = 0; r < R; ++r)
            prow[r] = probs + (r0 + std::min<int64_t>(r, rr - 1)) * pwidth;
          weigh_values8<D, R>(prow, vh, j0, j1, acc + r0);
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const __m256 inv = _mm256_set1_ps(1.f / sums[row]);
        T* o = op + (t0 + row / G) * os0 + (h * G + row % G) * os1;
        for (int64_t c = 0; c < D; c += 8)
          put8(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc[row] + c), inv));
      }
    }
  });
}
#endif  // SWITCHYARD_PREFILL_AVX2

}  // namespace

// Whether this build runs `dtype` ("float32" or "bfloat16") at this head dim.
bool supports(int64_t head_dim, const std::string& dtype) {
#if defined(SWITCHYARD_PREFILL) || defined(SWITCHYARD_PREFILL_AVX2)
  const bool bf16 = dtype == "bfloat16";
#if defined(SWITCHYARD_PREFILL) && !defined(SWITCHYARD_PREFILL_BF16)
  if (bf16) return false;
#endif
  return (head_dim == 64 || head_dim == 128) && (dtype == "float32" || bf16);
#else
  (void)head_dim;
  (void)dtype;
  return false;
#endif
}

// Causal attention of q [nq, heads, dim] over k/v [nk, kv_heads, dim] (nk >= nq; one
// dtype, contiguous dims, any row strides): query i sits at position nk - nq + i and
// sees keys 0 .. nk - nq + i. Writes out [nq, heads, dim].
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, const at::Tensor& out) {
  const auto dtype = q.scalar_type();
  for (const auto* t : {&q, &k, &v, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == dtype,
                "prefill_attention: CPU tensors of one dtype");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(2) == q.size(2),
                "prefill_attention: [tokens, heads, dim] with contiguous dims");
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "prefill_attention: fp32 or bf16");
  TORCH_CHECK(k.sizes() == v.sizes() && out.sizes() == q.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q.size(0) > 0 && k.size(0) >= q.size(0), "prefill_attention: a key per query");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(supports(q.size(2), dtype == at::kFloat ? "float32" : "bfloat16"),
              "prefill_attention: head dim 64 or 128 on a CPU with AVX2 or AVX-512 (bf16: "
              "AVX-512 with BF16)");
#if defined(SWITCHYARD_PREFILL)
  const float sc = static_cast<float>(scale);
  const bool wide = q.size(2) == 128;
  if (dtype == at::kFloat) {
    wide ? run<float, 128>(q, k, v, sc, out) : run<float, 64>(q, k, v, sc, out);
  } else {
#if defined(SWITCHYARD_PREFILL_BF16)
    wide ? run<uint16_t, 128>(q, k, v, sc, out) : run<uint16_t, 64>(q, k, v, sc, out);
#endif
  }
#elif defined(SWITCHYARD_PREFILL_AVX2)
  const float sc = static_cast<float>(scale);
  const bool wide = q.size(2) == 128;
  if (dtype == at::kFloat) {
    wide ? run8<float, 128>(q, k, v, sc, out) : run8<float, 64>(q, k, v, sc, out);
  } else {
    wide ? run8<uint16_t, 128>(q, k, v, sc, out) : run8<uint16_t, 64>(q, k, v, sc, out);
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether this build runs a dtype at a head dim");
  m.def("prefill_attention", &prefill_attention, "causal attention of a prompt chunk");
}
