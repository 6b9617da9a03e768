// Linear layers (y = x W^T + b) on AVX-512, fp32 and bf16 (AVX512-BF16), or on AVX2 (both
// dtypes; see the AVX2 section), for the CPU path at every batch size: the decode steps'
// small ones and the prompts' large ones alike.
//
// oneDNN's packed GEMM (what torch runs) streams its weights at about half the memory
// bandwidth at batch 1-16, where a decode step is bound by reading the weights, and
// reaches the vector units' peak only from a few hundred rows. Here the weights are
// packed once, at load, into tiles of 64 output columns, one contiguous run each that the
// hardware prefetcher streams:
//
//   fp32: packed[t][k][c]          = W[64 t + c][k]   ([N / 64, K, 64])
//   bf16: packed[t][k / 2][c][k % 2] = W[64 t + c][k] ([N / 64, K / 2, 64, 2])
//
// so that one 64-byte load holds an input dim (bf16: a pair, for VDPBF16PS) for 16
// columns. Threads take whole tiles, one at a time as they ask (`parallel_claims`, so a
// thread the OS descheduled does not hold the layer up by half the tiles); for each, rows
// of x go six (or four) at a time
// through a block of fp32 accumulators, 4 vectors of 16 columns a row: per input dim (bf16:
// pair) 4 loads of weights, a broadcast of x per row and an FMA (VDPBF16PS) per
// accumulator, with no horizontal sums. Fewer rows keep several partial sums per output
// in flight (the instruction's latency), added at the end. x is taken in blocks of rows
// that stay in L2 while they meet the tiles, every tile of a block before the next.
//
// Measured on this machine's 2 cores (Zen 4; the bench model's shapes, weights of 8
// layers cycled so they come from memory as in a decode step), ours vs oneDNN's packed:
//   bf16: batch 1 2.27 vs 3.73 ms, 4: 2.71 vs 4.15, 16: 4.29 vs 5.59, 64: 10.8 vs 13.4,
//         256: 39.6 vs 39.3;
//   fp32: batch 1 3.80 vs 6.03 ms, 4: 3.79 vs 5.49, 16: 8.73 vs 9.15, 64: 20.2 vs 20.0,
//         256: 81.5 vs 83.3;
// a 2,048-token prompt's step, alternating in one engine (best three of six): bf16
// 421-450 vs 409-482 ms, fp32 736-764 vs 740-751. In the engine: the levers scenario of
// `switchyard bench engine` (decode steps on our tiles and on oneDNN's;
// docs/benchmarks/engine-roofline.md).
//
// An MLP's fused gate_up can instead be packed in pairs of tiles, gate tile j beside up
// tile j (`pack_gated`): `linear_silu` keeps a row block's gate and up sums in fp32 and
// then writes silu(gate) * up, so that the [tokens, 2 x
// intermediate] product is never written and read back (bf16, bench model, a layer:
// batch 64 0.59 -> 0.47 ms, 2,048 tokens 17.8 -> 15.1 ms).
//
// Numerics: fp32 accumulation (in a different order from oneDNN's), the bias added in
// fp32, bf16 rounded once at the end, as torch's linear. `linear_silu` gives the same bits
// as fused_ops.silu_mul(linear(...)) in both dtypes: its gate and up sums are the linear's,
// rounded as the linear stores them; the SiLU and product are vec_math.h's `silu_mul16` (or
// `silu_mul8`), which silu_mul runs too, rounded as silu_mul rounds them.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"
#define SWITCHYARD_LINEAR_AVX512 1
#define SWITCHYARD_LINEAR_F32 1
#if defined(__AVX512BF16__)
#define SWITCHYARD_LINEAR_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"
#define SWITCHYARD_LINEAR_AVX2 1
#define SWITCHYARD_LINEAR_F32 1
#define SWITCHYARD_LINEAR_BF16 1
#endif

namespace {

constexpr int64_t kCols = 64;  // output columns of a tile: four vectors of 16 fp32

// Storage: float, or uint16_t holding bf16 bits. kStep: input dims per instruction.
template <typename T>
constexpr int64_t kStep = std::is_same_v<T, float> ? 1 : 2;

#if defined(SWITCHYARD_LINEAR_F32)
// Lines of the next tile of weights, asked into L2 a few at a time while this one runs.
// At decode batches (a few blocks of rows per tile) the tile's first block would otherwise
// wait on memory for all of it while the later ones find it in L2: bench model, a decode
// step at batch 64, every linear 8-15% faster in bf16 and 3-10% in fp32 (12.6 -> 12.0 ms
// a step), level at batch 1.
struct Prefetch {
  const char* at = nullptr;
  int64_t lines = 0;

  inline void next(int64_t n) {
    for (; n > 0 && lines > 0; --n, --lines, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};
#endif

#if defined(SWITCHYARD_LINEAR_AVX512)
// The fp32 results of 16 columns of a tile, and what the epilogues do with them.
using Lanes = __m512;
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline void lanes_store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }

// silu(g) * u as fused_ops.silu_mul computes it (vec_math.h's, the SiLU rounded to T), and
// its store, rounded as silu_mul rounds.
template <typename T>
inline Lanes silu_mul(Lanes g, Lanes u) {
  return switchyard::silu_mul16<!std::is_same_v<T, float>>(g, u);
}
inline void store_product16(float* out, __m512 y) { _mm512_storeu_ps(out, y); }
inline void store_product16(uint16_t* out, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(switchyard::bf16_round16(y)));
}

inline void store16(float* out, __m512 y) { _mm512_storeu_ps(out, y); }

#if defined(SWITCHYARD_LINEAR_BF16)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

inline void store16(uint16_t* out, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
}
#endif

// acc += x's step s (one dim, or a bf16 pair broadcast as one 32-bit lane) times w.
template <typename T>
struct Step;

template <>
struct Step<float> {
  using Vec = __m512;
  static Vec weights(const float* w) { return _mm512_loadu_ps(w); }
  static Vec input(const float* x, int64_t s) { return _mm512_set1_ps(x[s]); }
  static __m512 fma(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
};

#if defined(SWITCHYARD_LINEAR_BF16)
template <>
struct Step<uint16_t> {
  using Vec = __m512bh;
  static Vec weights(const uint16_t* w) { return as_bh(_mm512_loadu_si512(w)); }
  static Vec input(const uint16_t* x, int64_t s) {
    int pair;
    std::memcpy(&pair, x + 2 * s, sizeof pair);
    return as_bh(_mm512_set1_epi32(pair));
  }
  static __m512 fma(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// One tile's 64 outputs for MR rows of x (row stride xs), over S steps of the input; KU
// independent partial sums per output so that enough chains are in flight. Each sum goes
// to store(row, vector c of the tile, the fp32 sums of columns 16 c .. 16 c + 15); `ahead`
// issues one prefetch per step. Always inlined: out of line (which GCC chose once the
// prefetching variant was instantiated beside it), batch 1's gated MLP took 13% longer.
template <typename T, int MR, int KU, typename Store>
__attribute__((always_inline)) inline void tile(const T* x, int64_t xs, const T* wt, int64_t S,
                                                Store&& store, Prefetch ahead = {}) {
  using St = Step<T>;
  constexpr int64_t W = kCols * kStep<T>;  // weights per step of the input
  __m512 acc[KU][MR][4];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) acc[u][m][c] = _mm512_setzero_ps();
  int64_t s = 0;
  for (; s + KU <= S; s += KU) {
    ahead.next(KU);
    for (int u = 0; u < KU; ++u) {
      const T* w = wt + (s + u) * W;
      typename St::Vec wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = St::weights(w + c * 16 * kStep<T>);
      for (int m = 0; m < MR; ++m) {
        const auto xv = St::input(x + m * xs, s + u);
        for (int c = 0; c < 4; ++c) acc[u][m][c] = St::fma(acc[u][m][c], xv, wv[c]);
      }
    }
  }
  for (; s < S; ++s) {  // the last S % KU steps
    const T* w = wt + s * W;
    for (int m = 0; m < MR; ++m) {
      const auto xv = St::input(x + m * xs, s);
      for (int c = 0; c < 4; ++c)
        acc[0][m][c] = St::fma(acc[0][m][c], xv, St::weights(w + c * 16 * kStep<T>));
    }
  }
  // The partial sums added in this order wherever the tile is inlined: a plain add
  // (_mm512_add_ps is a vector `+`) -ffast-math lets GCC reassociate, and it did so
  // differently in linear's copies and linear_silu's (fp32, 1 or 7 rows: KU 4), so that
  // their sums differed; an add with its rounding named is an instruction it keeps.
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) {
      __m512 y = acc[0][m][c];
      for (int u = 1; u < KU; ++u)
        y = _mm512_add_round_ps(y, acc[u][m][c], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store(m, c, y);
    }
}

// A tile's 64 outputs for n rows of x: six at a time, then the rest in narrower blocks
// (fewer rows, more partial sums each). store(row, c, sums) as for `tile`. kAhead: the
// blocks share the prefetch of `next`, the tile that comes after this one.
template <typename T, bool kAhead, typename Store>
__attribute__((always_inline)) inline void tile_blocks(const T* x, int64_t xs, const T* wt,
                                                       int64_t S, int64_t n, Store&& store,
                                                       const T* next) {
  const auto from = [&store](int64_t base) {
    return [&store, base](int m, int c, __m512 y) { store(base + m, c, y); };
  };
  const int64_t lines = S * kCols * kStep<T> * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t per_block = (lines + (n + 5) / 6 - 1) / ((n + 5) / 6);
  const auto ahead = [&](int64_t m) {
    if constexpr (!kAhead) return Prefetch{};
    const int64_t done = m / 6 * per_block;
    return Prefetch{reinterpret_cast<const char*>(next) + done * 64,
                    std::max<int64_t>(0, std::min(per_block, lines - done))};
  };
  int64_t m = 0;
  for (; m + 6 <= n; m += 6) tile<T, 6, 1>(x + m * xs, xs, wt, S, from(m), ahead(m));
  const T* xr = x + m * xs;
  switch (n - m) {
    case 5:
      tile<T, 3, 1>(xr, xs, wt, S, from(m), ahead(m));
      tile<T, 2, 2>(xr + 3 * xs, xs, wt, S, from(m + 3));
      break;
    case 4: tile<T, 4, 1>(xr, xs, wt, S, from(m), ahead(m)); break;
    case 3: tile<T, 3, 2>(xr, xs, wt, S, from(m), ahead(m)); break;
    case 2: tile<T, 2, 2>(xr, xs, wt, S, from(m), ahead(m)); break;
    case 1: tile<T, 1, 4>(xr, xs, wt, S, from(m), ahead(m)); break;
    default: break;
  }
}

// `tile_blocks`, prefetching `next` (nullptr: none) where the tile meets two or more
// blocks of rows. A single block streams the tile once, which the hardware prefetcher
// follows unaided.
template <typename T, typename Store>
inline void tile_rows(const T* x, int64_t xs, const T* wt, int64_t S, int64_t n, Store&& store,
                      const T* next = nullptr) {
  if (next != nullptr && n >= 12) {
    tile_blocks<T, true>(x, xs, wt, S, n, store, next);
  } else {
    tile_blocks<T, false>(x, xs, wt, S, n, store, next);
  }
}

// v rounded to T (bf16: to nearest even, as the unfused path stores it), back in fp32.
template <typename T>
inline __m512 as_stored(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if defined(SWITCHYARD_LINEAR_BF16)
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
    return v;
#endif
  }
}

// x's rows as the kernel reads them: as stored.
template <typename T>
using Input = T;
#endif  // SWITCHYARD_LINEAR_AVX512

#if defined(SWITCHYARD_LINEAR_AVX2)
// AVX2 (Zen 3 and older x86 CPUs): the same packed tiles, 8-wide fp32 FMAs and 16 vector
// registers. A tile's 64 columns go in four strips of 16 (two vectors), a few rows of x
// at a time (`kRows`); each strip streams its own 64-byte line of every step of the
// tile, so the four strips together read the tile once per block of rows, as the AVX-512
// path does. bf16 has no dot-product instruction here: a 32-byte load holds 8 columns'
// pair of input dims, and a shift (the even dim) and a mask (the odd) widen it to two
// fp32 vectors exactly; x's rows are widened to fp32 once per block of rows (`Input`).
// Zen 3, 2 cores, [6144, 2048] weights cycled from memory, against oneDNN (fp32; its bf16
// does not run without AVX-512) and F.linear (bf16):
//   fp32: batch 1 2.20 vs 2.95 ms, 16: 5.43 vs 6.46, 64: 16.6 vs 17.6, 256: 63.7 vs 42.3
//         (oneDNN wins on prompts; running a 2048-deep tile, 512 KiB, in slices that stay
//         in Zen 3's L2, partial sums kept between them, gained nothing at 16-1,024 rows);
//   bf16: batch 1 1.35 vs 1.60 ms, 16: 3.42 vs 21.0, 64: 10.3 vs 83.2, 256: 47.1 vs 325.

// The fp32 results of 16 columns of a tile, and what the epilogues do with them.
struct Lanes {
  __m256 lo, hi;
};
inline Lanes lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void lanes_store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Lanes lanes_add(Lanes a, Lanes b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}

using switchyard::bf16_round8;

inline void store16(float* out, Lanes y) { lanes_store(out, y); }

inline void store16(uint16_t* out, Lanes y) {
  // packus interleaves 128-bit halves (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute
  // puts them back in column order.
  const __m256i packed = _mm256_packus_epi32(bf16_round8(y.lo), bf16_round8(y.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}

template <typename T>
inline __m256 as_stored8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_round8(v), 16));
  }
}

// v rounded to T (bf16: to nearest even, as the unfused path stores it), back in fp32.
template <typename T>
inline Lanes as_stored(Lanes v) {
  return {as_stored8<T>(v.lo), as_stored8<T>(v.hi)};
}

// silu(g) * u as fused_ops.silu_mul computes it (vec_math.h's, the SiLU rounded to T);
// store16 rounds the product as silu_mul does.
template <typename T>
inline Lanes silu_mul(Lanes g, Lanes u) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  return {switchyard::silu_mul8<kBf16>(g.lo, u.lo), switchyard::silu_mul8<kBf16>(g.hi, u.hi)};
}
inline void store_product16(float* out, Lanes y) { store16(out, y); }
inline void store_product16(uint16_t* out, Lanes y) { store16(out, y); }

template <int MR>
__attribute__((always_inline)) inline void fma_rows(__m256 (&acc)[MR][2], const float* x,
                                                    int64_t xs, __m256 w0, __m256 w1) {
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_broadcast_ss(x + m * xs);
    acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
  }
}

// Strip c (columns 16 c .. 16 c + 15) of a tile for MR rows of fp32 x (rows xs apart),
// over S steps; store(row, c, sums). `ahead` issues one prefetch per step.
template <typename T, int MR, typename Store>
__attribute__((always_inline)) inline void strip(const float* x, int64_t xs, const T* wt,
                                                 int64_t S, int c, Store&& store,
                                                 Prefetch ahead) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const T* w = wt + c * 16 * kStep<T>;
  for (int64_t s = 0; s < S; ++s, w += kCols * kStep<T>) {
    ahead.next(1);
    if constexpr (std::is_same_v<T, float>) {
      fma_rows<MR>(acc, x + s, xs, _mm256_loadu_ps(w), _mm256_loadu_ps(w + 8));
    } else {  // 8 columns' (even, odd) input dims a load
      using switchyard::bf16_even8, switchyard::bf16_odd8;
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
      fma_rows<MR>(acc, x + 2 * s, xs, bf16_even8(p0), bf16_even8(p1));
      fma_rows<MR>(acc, x + 2 * s + 1, xs, bf16_odd8(p0), bf16_odd8(p1));
    }
  }
  for (int m = 0; m < MR; ++m) store(m, c, Lanes{acc[m][0], acc[m][1]});
}

// A whole tile for one row of x: eight accumulators (one per 8 columns) keep as many FMA
// chains in flight as the two FMA units need; a strip would have two.
template <typename T, typename Store>
__attribute__((always_inline)) inline void row_tile(const float* x, const T* wt, int64_t S,
                                                    Store&& store, Prefetch ahead) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const T* w = wt;
  for (int64_t s = 0; s < S; ++s, w += kCols * kStep<T>) {
    ahead.next(1);
    if constexpr (std::is_same_v<T, float>) {
      const __m256 xv = _mm256_broadcast_ss(x + s);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * j), acc[j]);
    } else {
      const __m256 xe = _mm256_broadcast_ss(x + 2 * s), xo = _mm256_broadcast_ss(x + 2 * s + 1);
      for (int j = 0; j < 8; ++j) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
        const __m256 even = switchyard::bf16_even8(p), odd = switchyard::bf16_odd8(p);
        acc[j] = _mm256_fmadd_ps(xo, odd, _mm256_fmadd_ps(xe, even, acc[j]));
      }
    }
  }
  for (int c = 0; c < 4; ++c) store(0, c, Lanes{acc[2 * c], acc[2 * c + 1]});
}

// Rows of x a strip takes at a time: fp32 six (12 accumulators, the strip's two weight
// vectors and a broadcast: 15 registers); bf16 five, since a pair's two dims hold four
// weight vectors (six spilled: 36 -> 81 GFLOP/s on one core with the tile in L2; four
// gave 75).
template <typename T>
constexpr int kRows = std::is_same_v<T, float> ? 6 : 5;

// A tile's 64 outputs for n rows of x: kRows<T> rows at a time through the four strips,
// then the rest (one row: `row_tile`). With `next`, its lines are prefetched, spread over
// the blocks' strips, whatever n: on Zen 3 a single block's four strided passes over a
// tile from memory were not followed well by the hardware prefetcher (8 layers' and the
// LM head's linears of the bench model, weights from memory: fp32 batch 2-6 12-18 ->
// 7.5-9.4 ms, 8 20 -> 13, batch 1 6.2 -> 5.6; bf16 batch 2-5 9-11 -> 4.2-4.9, 8 12 -> 7;
// level from 12 rows up. AVX-512 prefetches from 12 rows, as measured on a Zen 5).
template <typename T, typename Store>
inline void tile_rows(const float* x, int64_t xs, const T* wt, int64_t S, int64_t n,
                      Store&& store, const T* next = nullptr) {
  constexpr int R = kRows<T>;
  const auto from = [&store](int64_t base) {
    return [&store, base](int m, int c, Lanes y) { store(base + m, c, y); };
  };
  const int64_t lines = S * kCols * kStep<T> * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t blocks = (n + R - 1) / R, per_block = (lines + blocks - 1) / blocks;
  // passes: how many times the block goes over the tile (four strips, or `row_tile`'s
  // one, which issues one prefetch a step and so asks for at most S of its share).
  const auto ahead = [&](int64_t m, int c, int passes = 4) {
    if (next == nullptr) return Prefetch{};
    const int64_t share = (per_block + passes - 1) / passes;
    const int64_t done = m / R * per_block + c * share;
    return Prefetch{reinterpret_cast<const char*>(next) + done * 64,
                    std::max<int64_t>(0, std::min(share, lines - done))};
  };
  int64_t m = 0;
  for (; m + R <= n; m += R)
    for (int c = 0; c < 4; ++c) strip<T, R>(x + m * xs, xs, wt, S, c, from(m), ahead(m, c));
  const float* xr = x + m * xs;
  const auto strips = [&](auto rows) {
    for (int c = 0; c < 4; ++c)
      strip<T, decltype(rows)::value>(xr, xs, wt, S, c, from(m), ahead(m, c));
  };
  switch (n - m) {  // fewer than R
    case 5: strips(std::integral_constant<int, 5>{}); break;
    case 4: strips(std::integral_constant<int, 4>{}); break;
    case 3: strips(std::integral_constant<int, 3>{}); break;
    case 2: strips(std::integral_constant<int, 2>{}); break;
    case 1: row_tile<T>(xr, wt, S, from(m), ahead(m, 0, 1)); break;
    default: break;
  }
}

// x's rows as the kernel reads them: fp32 (bf16 rows widened once per block of rows).
template <typename T>
using Input = float;
#endif  // SWITCHYARD_LINEAR_AVX2

#if defined(SWITCHYARD_LINEAR_F32)
// The block of x's rows a thread is on, in the form the kernel reads (`Input<T>`): the
// rows themselves, or on AVX2 in bf16 their fp32 values, widened into this thread's
// buffer (not zeroed first: a vector's resize was 1% of a bf16 decode step at batch 64
// in memset).
template <typename T>
struct RowBlock {
  const Input<T>* x = nullptr;
  int64_t stride = 0;
  int64_t held = -1;  // which block x is
  std::unique_ptr<float[]> wide;
  int64_t capacity = 0;

  // Block b: the n rows at `rows` (xs apart), K wide; widened only if not already held.
  void hold(int64_t b, const T* rows, int64_t xs, int64_t n, int64_t K) {
    if (b == held) return;
    held = b;
    if constexpr (std::is_same_v<Input<T>, T>) {
      x = rows;
      stride = xs;
    } else {
      if (capacity < n * K) {
        wide.reset(new float[n * K]);
        capacity = n * K;
      }
      for (int64_t m = 0; m < n; ++m)
        for (int64_t k = 0; k < K; ++k) {
          const uint32_t bits = static_cast<uint32_t>(rows[m * xs + k]) << 16;
          std::memcpy(&wide[m * K + k], &bits, sizeof bits);
        }
      x = wide.get();
      stride = K;
    }
  }
};

// Rows of x in blocks of about 128 KiB, kept in L2 while they meet the tiles (a prompt's
// x is megabytes), but never fewer than 96: every block streams all the
// weights again, from memory once they outgrow L3, so a decode step of up to 96 rows is
// one block (Zen 3, fp32, K 2048, [6144, 2048] weights: batch 16 13.5 -> 6.7 ms, batch 64
// 33.3 -> 16.4; the 128 KiB rule gave blocks of 12 rows there).
template <typename T>
int64_t row_block(int64_t K) {
  return std::max<int64_t>(96, (128 * 1024 / (K * sizeof(T))) / 6 * 6);
}

// x [M, K] (rows xs apart) times the packed tiles [T] into out [M, 64 T].
template <typename T>
void run(const T* xp, int64_t xs, int64_t M, int64_t K, const T* wp, int64_t T_, const float* bf,
         T* op) {
  const int64_t N = T_ * kCols, S = K / kStep<T>, block = row_block<T>(K);
  const int64_t items = (M + block - 1) / block * T_;  // (row block, tile), by row block
  switchyard::parallel_claims(items, 1, [&](switchyard::Claims& claims) {
    RowBlock<T> rows;
    for (int64_t item = claims.next(), after; item < items; item = after) {
      after = claims.next();  // this thread's next tile: prefetched while this one runs
      const int64_t t = item % T_, m0 = item / T_ * block, n = std::min(M, m0 + block) - m0;
      rows.hold(item / T_, xp + m0 * xs, xs, n, K);
      const float* b = bf ? bf + t * kCols : nullptr;
      T* o = op + m0 * N + t * kCols;
      const T* next = after < items ? wp + after % T_ * K * kCols : nullptr;
      tile_rows<T>(
          rows.x, rows.stride, wp + t * K * kCols, S, n,
          [&](int64_t m, int c, Lanes y) {
            if (b) y = lanes_add(y, lanes_load(b + c * 16));
            store16(o + m * N + c * 16, y);
          },
          next);
    }
  });
}

// out[m, :64] = silu(g) * u for the n rows of a pair's fp32 sums (as stored in T). Apart
// from the tiles' loops on purpose: inlined into the up tile's epilogue, the SiLU's
// constants were hoisted into the registers the AVX2 strip needs for its 12 accumulators,
// and the whole tile spilled (Zen 3, bench model's [2816, 512] gate_up, fp32: batch 16
// 0.60 -> 0.42 ms, 64 2.35 -> 1.34 ms, 256 10.2 -> 5.9 ms; bf16 64 1.6 -> 1.2-1.4 ms).
template <typename T>
__attribute__((noinline)) void silu_mul_rows(const float* g, const float* u, int64_t n, T* o,
                                             int64_t N) {
  for (int64_t m = 0; m < n; ++m)
    for (int c = 0; c < 4; ++c) {
      const int64_t i = m * kCols + c * 16;
      store_product16(o + m * N + c * 16, silu_mul<T>(lanes_load(g + i), lanes_load(u + i)));
    }
}

// silu(x W_gate^T) * (x W_up^T) into out [M, 64 P] from the pairs [P] of (gate tile, up
// tile) that `pack_gated` makes: a pair's gate and up sums wait in fp32 (a row block's,
// in L1/L2) and `silu_mul_rows` writes the pair's outputs. bf16 rounds where
// the unfused path (linear, then fused_ops.silu_mul) stores: gate and up, SiLU, product.
template <typename T>
void run_gated(const T* xp, int64_t xs, int64_t M, int64_t K, const T* wp, int64_t P_, T* op) {
  const int64_t N = P_ * kCols, S = K / kStep<T>, block = row_block<T>(K);
  const int64_t items = (M + block - 1) / block * P_;  // (row block, pair), by row block
  switchyard::parallel_claims(items, 1, [&](switchyard::Claims& claims) {
    std::vector<float> gates(std::min(M, block) * kCols), ups(gates.size());
    RowBlock<T> rows;
    for (int64_t item = claims.next(), after; item < items; item = after) {
      after = claims.next();  // this thread's next pair: its gate prefetched under the up
      const int64_t p = item % P_, m0 = item / P_ * block, n = std::min(M, m0 + block) - m0;
      rows.hold(item / P_, xp + m0 * xs, xs, n, K);
      const T* wg = wp + 2 * p * K * kCols;
      float* g = gates.data();
      const T* wu = wg + K * kCols;  // its up tile, prefetched while the gate runs
      tile_rows<T>(
          rows.x, rows.stride, wg, S, n,
          [g](int64_t m, int c, Lanes y) {
            lanes_store(g + m * kCols + c * 16, as_stored<T>(y));
          },
          wu);
      float* u = ups.data();
      tile_rows<T>(
          rows.x, rows.stride, wu, S, n,
          [u](int64_t m, int c, Lanes y) {
            lanes_store(u + m * kCols + c * 16, as_stored<T>(y));
          },
          after < items ? wp + 2 * (after % P_) * K * kCols : nullptr);
      silu_mul_rows(g, u, n, op + m0 * N + p * kCols, N);
    }
  });
}
#endif

bool runs(at::ScalarType dtype) {
#if defined(SWITCHYARD_LINEAR_BF16)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(SWITCHYARD_LINEAR_F32)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

int64_t pair_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

void check_packed(const at::Tensor& packed) {
  const auto dt = packed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "linear: fp32 or bf16 weights");
  const int64_t dims = dt == at::kBFloat16 ? 4 : 3;
  TORCH_CHECK(packed.dim() == dims && packed.size(2) == kCols && packed.is_contiguous() &&
                  (dims == 3 || packed.size(3) == 2),
              "linear: a weight from linear.pack");
}

// A gated pack: [pairs, 2, K / P, 64, P] (P = 1 fp32, 2 bf16).
void check_gated(const at::Tensor& packed) {
  const auto dt = packed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "linear_silu: fp32 or bf16 weights");
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == 2 && packed.size(3) == kCols &&
                  packed.size(4) == pair_of(dt) && packed.is_contiguous(),
              "linear_silu: a weight from linear.pack_gated");
}

void check_x(const at::Tensor& x, at::ScalarType dt, int64_t K, const char* what) {
  TORCH_CHECK(runs(dt), what, ": this CPU cannot run ", dt,
              " (AVX-512, bf16 also AVX512-BF16; or AVX2 with FMA)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dt && x.dim() == 2 && x.stride(1) == 1,
              what, ": x a CPU [M, K] in the weight's dtype with contiguous rows");
  TORCH_CHECK(x.size(1) == K, what, ": x has ", x.size(1), " columns, the weight ", K);
}

uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

}  // namespace

// Whether this build runs `dtype` ("float32" or "bfloat16"): AVX-512, and for bf16
// AVX512-BF16; or AVX2 with FMA, both.
bool supports(const std::string& dtype) {
  return runs(dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kDouble);
}

// W [N, K] (fp32 or bf16), N a multiple of 64 (bf16: K even) -> its tiles.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "linear.pack: a CPU fp32 or bf16 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1), P = pair_of(w.scalar_type());
  TORCH_CHECK(N % kCols == 0 && K % P == 0 && K > 0,
              "linear.pack: N a multiple of 64 (and for bf16 K even)");
  // [N / 64, 64, K / P, P] -> [N / 64, K / P, 64, P]
  auto out = w.contiguous().view({N / kCols, kCols, K / P, P}).transpose(1, 2).contiguous();
  return P == 1 ? out.view({N / kCols, K, kCols}) : out;
}

// [2 I, K] -> [I / 64, 2, K / P, 64, P]: gate tile j beside up tile j, for `linear_silu`
// (W the fused gate_up of an MLP: the gate's I rows, then the up's; I a multiple of 64).
at::Tensor pack_gated(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "linear.pack_gated: a CPU fp32 or bf16 [2 I, K] weight");
  const int64_t N = w.size(0), K = w.size(1), P = pair_of(w.scalar_type());
  TORCH_CHECK(N % (2 * kCols) == 0 && K % P == 0 && K > 0,
              "linear.pack_gated: halves of a multiple of 64 rows (and for bf16 K even)");
  // [2, I / 64, 64, K / P, P] -> [I / 64, 2, K / P, 64, P]
  return w.contiguous()
      .view({2, N / 2 / kCols, kCols, K / P, P})
      .permute({1, 0, 3, 2, 4})
      .contiguous();
}

// The inverse of `pack` (or of `pack_gated`): W [N, K].
at::Tensor unpack(const at::Tensor& packed) {
  if (packed.dim() == 5) {
    check_gated(packed);
    const int64_t pairs = packed.size(0), P = packed.size(4), K = packed.size(2) * P;
    return packed.permute({1, 0, 3, 2, 4}).reshape({2 * pairs * kCols, K}).contiguous();
  }
  check_packed(packed);
  const int64_t N = packed.size(0) * kCols, P = pair_of(packed.scalar_type());
  const int64_t K = packed.size(1) * P;
  return packed.view({packed.size(0), packed.size(1), kCols, P})
      .transpose(1, 2)
      .reshape({N, K})
      .contiguous();
}

// x [M, K] (rows contiguous) times packed W, plus an optional bias [N]: y [M, N], in x's
// dtype (that of the weight).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias) {
  check_packed(packed);
  const auto dt = packed.scalar_type();
  const int64_t T = packed.size(0), N = T * kCols;
  check_x(x, dt, packed.size(1) * pair_of(dt), "linear");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: a bias of [N]");
    const auto b = bias->to(at::kFloat).contiguous();
    bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* b = bf.empty() ? nullptr : bf.data();
#if defined(SWITCHYARD_LINEAR_F32)
  if (dt == at::kFloat) {
    run<float>(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), T, b,
               out.data_ptr<float>());
  }
#endif
#if defined(SWITCHYARD_LINEAR_BF16)
  if (dt == at::kBFloat16) run<uint16_t>(bits(x), x.stride(0), M, K, bits(packed), T, b, bits(out));
#endif
  return out;
}

// silu(x W_gate^T) * (x W_up^T) for a weight from `pack_gated`: [M, I], in x's dtype; the
// same values as fused_ops.silu_mul(linear(x, pack(W))) without the [M, 2 I] in between.
at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& packed) {
  check_gated(packed);
  const auto dt = packed.scalar_type();
  const int64_t pairs = packed.size(0), N = pairs * kCols;
  check_x(x, dt, packed.size(2) * pair_of(dt), "linear_silu");
  const int64_t M = x.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(SWITCHYARD_LINEAR_F32)
  if (dt == at::kFloat) {
    run_gated<float>(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), pairs,
                     out.data_ptr<float>());
  }
#endif
#if defined(SWITCHYARD_LINEAR_BF16)
  if (dt == at::kBFloat16) {
    run_gated<uint16_t>(bits(x), x.stride(0), M, K, bits(packed), pairs, bits(out));
  }
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether this build runs a dtype (\"float32\" / \"bfloat16\")");
  m.def("pack", &pack, "an [N, K] weight into the kernel's tiles");
  m.def("pack_gated", &pack_gated, "an MLP's [2 I, K] gate_up into (gate, up) tile pairs");
  m.def("unpack", &unpack, "a packed weight (pack or pack_gated) back to [N, K]");
  m.def("linear", &linear, "x W^T + b, W packed", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
  m.def("linear_silu", &linear_silu, "silu(x W_gate^T) * (x W_up^T), W from pack_gated");
}
