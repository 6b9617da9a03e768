// Linear layers (y = x W^T + b) on quantized weights, decoded inside the tile loop so that
// the weights stay quantized in memory: a decode step at small batch is bound by the bytes
// of weights it reads, and these read 8 or 5 bits a weight instead of 16 or 32.
//
//   int8: symmetric, one fp32 scale per output row: W[n][k] = scale[n] q[n][k], q in
//         [-127, 127]. The scale factors out of the row's sum and is applied once, at the
//         end.
//   q4:   groups of 32 input dims, a scale d and a minimum m per (row, group), both fp16,
//         4-bit q in [0, 15]: W[n][k] = d[n][g] q[n][k] + m[n][g], g = k / 32. This is
//         GGUF's Q4_1 block (Q4_0 is m = -8 d), 5 bits a weight with its scales.
//
// Tiles of 64 output columns, as linear.cpp's, each one contiguous run that the hardware
// prefetcher streams:
//
//   int8: packed[t][k][c] = q[64 t + c][k]                        (int8 [N/64, K, 64])
//   q4:   packed[t][g] = 1,280 bytes for group g of tile t:        (uint8 [N/64, K/32, 1280])
//           d of its 64 columns (fp16, 128 bytes), m (128 bytes), then 16 steps of 64
//           bytes, one per pair of input dims: step s's 128 nibbles are the 64 columns'
//           values at k = 32 g + 2 s and 2 s + 1. Column 16 j + c, dim parity p sits in
//           byte 16 (c / 4) + 8 (j % 2) + 2 (c % 4) + p, in its low nibble for j < 2, its
//           high one for j >= 2: the order in which AVX-512's unpacklo/hi_epi8 (per 128-bit
//           lane) of the low and the high nibbles give the four vectors of 16 columns' pairs
//           (AVX2's do the same for each half, 8 columns, of a vector).
//
// The paths (`path` names the CPU's):
//   - Few rows of x (a block under kWideRows, decode steps at small batch), the weights are
//     decoded in the tile loop: int8 by a widening load and a conversion to fp32 per 16
//     weights, then one FMA per weight and row (x fp32; bf16 x widened once per block of
//     rows). q4 with bf16 x on AVX512-BF16: each nibble ORed into the bits of bf16 128.0
//     (0x4300 | q is 128 + q, exact), so a group's products are VDPBF16PS of x's pairs,
//     sum x (128 + q), and the group adds d times that plus (m - 128 d) times the group's
//     sum of x: no per-weight multiply. q4 otherwise: fma(q, d, m) per weight, then FMAs.
//   - More rows: each tile is decoded once into fp32 [K][64] in L2 and the rows run
//     linear.cpp's fp32 FMA tile over it, six at a time, so the decode is paid once per
//     tile, not once per six rows (Sapphire Rapids, one core, 8 layers of the default
//     model, batch 32: int8 37.9 -> 19.6 ms, q4 31.5 -> 19.2, bf16 weights 26.8; there an
//     FMA pair runs as many products as a VDPBF16PS, so fp32 arithmetic costs nothing).
//   - AVX2 with FMA and F16C (Zen 3): the same in 8-wide strips of 16 columns, as
//     linear.cpp's AVX2 path, fp32 throughout.
// Elsewhere `path` is "" and the caller dequantizes with torch (workers/runner/quant.py).
//
// Numerics: fp32 sums (another order than torch's), bias added in fp32, bf16 rounded once
// at the end; against x times the dequantized weights in float64 they are within fp32
// error (fp32 x) or a bf16 rounding (bf16 x). The q4 VDPBF16PS path's offset costs about
// four bits of its fp32 sum's precision, far below the bf16 output's. `linear_silu` gives
// the same bits as fused_ops.silu_mul(linear(...)), as linear.cpp's does.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "vec_math.h"
#define QL_AVX512 1
#if defined(__AVX512BF16__)
#define QL_BF16DOT 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "vec_math.h"
#define QL_AVX2 1
#endif

namespace {

constexpr int64_t kCols = 64;          // output columns of a tile
constexpr int64_t kGroup = 32;         // q4: input dims per (d, m)
constexpr int64_t kQ4Head = 256;       // q4: d[64] and m[64], fp16
constexpr int64_t kQ4Step = 64;        // q4: bytes of one pair of input dims
constexpr int64_t kQ4Steps = kGroup / 2;
constexpr int64_t kQ4GroupBytes = kQ4Head + kQ4Steps * kQ4Step;  // 1,280
constexpr int64_t kI8Step = kCols;  // int8: bytes of one input dim

enum class Fmt { kInt8, kQ4 };

// Bytes of one tile of K input dims.
int64_t tile_bytes(Fmt f, int64_t K) {
  return f == Fmt::kInt8 ? K * kI8Step : K / kGroup * kQ4GroupBytes;
}

#if defined(QL_AVX512) || defined(QL_AVX2)
// Lines of the next tile, asked into L2 a few at a time while this one runs (linear.cpp).
struct Prefetch {
  const char* at = nullptr;
  int64_t lines = 0;

  inline void next(int64_t n) {
    for (; n > 0 && lines > 0; --n, --lines, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

// f(rows, m) for the n rows in blocks of R, then the rest in one narrower block.
template <int R, typename F>
__attribute__((always_inline)) inline void by_blocks(int64_t n, F&& f) {
  int64_t m = 0;
  for (; m + R <= n; m += R) f(std::integral_constant<int, R>{}, m);
  switch (n - m) {
    case 5:
      if constexpr (R > 5) f(std::integral_constant<int, 5>{}, m);
      break;
    case 4:
      if constexpr (R > 4) f(std::integral_constant<int, 4>{}, m);
      break;
    case 3:
      if constexpr (R > 3) f(std::integral_constant<int, 3>{}, m);
      break;
    case 2:
      if constexpr (R > 2) f(std::integral_constant<int, 2>{}, m);
      break;
    case 1:
      if constexpr (R > 1) f(std::integral_constant<int, 1>{}, m);
      break;
    default: break;
  }
}

// The prefetch of block `m / R` of n rows: the next tile's lines shared out over the blocks.
struct Ahead {
  const char* next;
  int64_t lines, per_block;

  Ahead(const void* next_tile, int64_t bytes, int64_t n, int R)
      : next(static_cast<const char*>(next_tile)), lines(bytes / 64) {
    const int64_t blocks = (n + R - 1) / R;
    per_block = (lines + blocks - 1) / blocks;
  }
  Prefetch of(int64_t block) const {
    if (next == nullptr) return {};
    const int64_t done = block * per_block;
    return {next + done * 64, std::max<int64_t>(0, std::min(per_block, lines - done))};
  }
};
#endif

#if defined(QL_AVX512)
// The fp32 results of 16 columns of a tile, and their stores.
using Lanes = __m512;
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline void lanes_store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline void store16(float* out, Lanes y) { _mm512_storeu_ps(out, y); }
inline void store16(uint16_t* out, Lanes y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(switchyard::bf16_round16(y)));
}
// v rounded to T (bf16: to nearest even, as a bf16 linear stores it), back in fp32.
template <typename T>
inline Lanes as_stored(Lanes v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(switchyard::bf16_round16(v), 16));
  }
}
template <typename T>
inline Lanes silu_mul(Lanes g, Lanes u) {
  return switchyard::silu_mul16<!std::is_same_v<T, float>>(g, u);
}
inline __m512 add_exact(__m512 a, __m512 b) {  // an add GCC does not reassociate
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Lanes fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 i8x16(const int8_t* p) {  // 16 int8 as fp32, exactly
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// --- fp32 path: x fp32 rows (xs apart), weights decoded to fp32 --------------------------

// int8: one tile's 64 outputs for MR rows over K input dims: per dim, 4 x (16 int8 widened
// to int32, converted to fp32) and an FMA per row; KU partial sums per output for few rows.
template <int MR, int KU, typename Store>
__attribute__((always_inline)) inline void i8_f32(const float* x, int64_t xs, const int8_t* wt,
                                                  int64_t K, Store&& store, Prefetch ahead) {
  __m512 acc[KU][MR][4];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) acc[u][m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    ahead.next(KU);
    for (int u = 0; u < KU; ++u) {
      const int8_t* w = wt + (k + u) * kI8Step;
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = i8x16(w + 16 * j);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * xs + k + u]);
        for (int j = 0; j < 4; ++j) acc[u][m][j] = _mm512_fmadd_ps(xv, wv[j], acc[u][m][j]);
      }
    }
  }
  for (; k < K; ++k) {
    const int8_t* w = wt + k * kI8Step;
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * xs + k]);
      for (int j = 0; j < 4; ++j)
        acc[0][m][j] = _mm512_fmadd_ps(xv, i8x16(w + 16 * j), acc[0][m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) {
      __m512 y = acc[0][m][j];
      for (int u = 1; u < KU; ++u) y = add_exact(y, acc[u][m][j]);
      store(m, j, y);
    }
}

// q4: one tile's 64 outputs for MR rows over G groups, each weight decoded as fma(q, d, m).
template <int MR, typename Store>
__attribute__((always_inline)) inline void q4_f32(const float* x, int64_t xs, const uint8_t* wt,
                                                  int64_t G, Store&& store, Prefetch ahead) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), low16 = _mm512_set1_epi32(0xFFFF);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = wt + g * kQ4GroupBytes;
    ahead.next(4);
    __m512 d[4], mn[4];
    for (int j = 0; j < 4; ++j) {
      d[j] = fp16x16(gp + 32 * j);
      mn[j] = fp16x16(gp + 128 + 32 * j);
    }
    for (int64_t s = 0; s < kQ4Steps; ++s) {
      ahead.next(1);
      const __m512i v = _mm512_loadu_si512(gp + kQ4Head + s * kQ4Step);
      const __m512i nib[2] = {_mm512_and_si512(v, low4),
                              _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
      const int64_t k = kGroup * g + 2 * s;
      for (int j = 0; j < 4; ++j) {
        const __m512i q = (j & 1) ? _mm512_unpackhi_epi8(nib[j >> 1], zero)
                                  : _mm512_unpacklo_epi8(nib[j >> 1], zero);
        const __m512 we =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low16)), d[j], mn[j]);
        const __m512 wo =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 16)), d[j], mn[j]);
        for (int m = 0; m < MR; ++m) {
          const float* xr = x + m * xs + k;
          acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), we, acc[m][j]);
          acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), wo, acc[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) store(m, j, acc[m][j]);
}

// A tile for n rows of fp32 x in blocks; store(row, j, sums of columns 16 j ..).
template <Fmt F, typename Store>
__attribute__((noinline)) void tile_rows_f32(
    const float* x, int64_t xs, const uint8_t* wt, int64_t K, int64_t n, Store&& store,
    const uint8_t* next) {
  constexpr int R = F == Fmt::kInt8 ? 6 : 4;
  const Ahead ahead(n >= 2 * R ? next : nullptr, tile_bytes(F, K), n, R);
  by_blocks<R>(n, [&](auto rows, int64_t m0) {
    constexpr int MR = decltype(rows)::value;
    const auto at = [&](int m, int j, __m512 y) { store(m0 + m, j, y); };
    if constexpr (F == Fmt::kInt8) {
      constexpr int KU = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;
      i8_f32<MR, KU>(x + m0 * xs, xs, reinterpret_cast<const int8_t*>(wt), K, at,
                     ahead.of(m0 / R));
    } else {
      q4_f32<MR>(x + m0 * xs, xs, wt, K / kGroup, at, ahead.of(m0 / R));
    }
  });
}

// --- a block of many rows: the tile decoded once into fp32, then fp32 FMAs --------------

// The tile's weights as fp32 [K][64] (int8: q, unscaled; q4: fma(q, d, m), as the inline
// paths decode them).
template <Fmt F>
inline void decode_tile(const uint8_t* wt, int64_t K, float* out) {
  if constexpr (F == Fmt::kInt8) {
    const int8_t* w8 = reinterpret_cast<const int8_t*>(wt);
    for (int64_t k = 0; k < K; ++k, out += kCols)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(out + 16 * j, i8x16(w8 + k * kI8Step + 16 * j));
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low16 = _mm512_set1_epi32(0xFFFF);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t g = 0; g < K / kGroup; ++g) {
      const uint8_t* gp = wt + g * kQ4GroupBytes;
      __m512 d[4], mn[4];
      for (int j = 0; j < 4; ++j) {
        d[j] = fp16x16(gp + 32 * j);
        mn[j] = fp16x16(gp + 128 + 32 * j);
      }
      for (int64_t s = 0; s < kQ4Steps; ++s, out += 2 * kCols) {
        const __m512i v = _mm512_loadu_si512(gp + kQ4Head + s * kQ4Step);
        const __m512i nib[2] = {_mm512_and_si512(v, low4),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
        for (int j = 0; j < 4; ++j) {
          const __m512i q = (j & 1) ? _mm512_unpackhi_epi8(nib[j >> 1], zero)
                                    : _mm512_unpacklo_epi8(nib[j >> 1], zero);
          const __m512 qe = _mm512_cvtepi32_ps(_mm512_and_si512(q, low16));
          const __m512 qo = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 16));
          _mm512_store_ps(out + 16 * j, _mm512_fmadd_ps(qe, d[j], mn[j]));
          _mm512_store_ps(out + kCols + 16 * j, _mm512_fmadd_ps(qo, d[j], mn[j]));
        }
      }
    }
  }
}

// linear.cpp's fp32 tile: 64 outputs for MR rows over fp32 weights [K][64] (in L2), KU
// partial sums per output for few rows.
template <int MR, int KU, typename Store>
__attribute__((always_inline)) inline void f32_tile(const float* x, int64_t xs, const float* wt,
                                                    int64_t K, Store&& store, Prefetch ahead) {
  __m512 acc[KU][MR][4];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) acc[u][m][j] = _mm512_setzero_ps();
  // No lambda for the step: in one instantiation GCC then kept the sums in memory.
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    ahead.next(1);
    for (int u = 0; u < KU; ++u) {
      const float* w = wt + (k + u) * kCols;
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_load_ps(w + 16 * j);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * xs + k + u]);
        for (int j = 0; j < 4; ++j) acc[u][m][j] = _mm512_fmadd_ps(xv, wv[j], acc[u][m][j]);
      }
    }
  }
  for (; k < K; ++k) {
    const float* w = wt + k * kCols;
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * xs + k]);
      for (int j = 0; j < 4; ++j)
        acc[0][m][j] = _mm512_fmadd_ps(xv, _mm512_load_ps(w + 16 * j), acc[0][m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) {
      __m512 y = acc[0][m][j];
      for (int u = 1; u < KU; ++u) y = add_exact(y, acc[u][m][j]);
      store(m, j, y);
    }
}

// n rows of fp32 x against a decoded tile, six at a time; the next (quantized) tile's
// lines prefetched over the blocks.
template <Fmt F, typename Store>
__attribute__((noinline)) void tile_rows_wide(
    const float* x, int64_t xs, const float* wide, int64_t K, int64_t n, Store&& store,
    const uint8_t* next) {
  constexpr int R = 6;
  const Ahead ahead(next, tile_bytes(F, K), n, R);
  by_blocks<R>(n, [&](auto rows, int64_t m0) {
    constexpr int MR = decltype(rows)::value;
    constexpr int KU = MR >= 4 ? 1 : MR >= 2 ? 2 : 4;
    f32_tile<MR, KU>(x + m0 * xs, xs, wide, K,
                     [&](int m, int j, __m512 y) { store(m0 + m, j, y); }, ahead.of(m0 / R));
  });
}
#endif  // QL_AVX512

#if defined(QL_BF16DOT)
// --- bf16 path: x bf16 rows (pairs broadcast as one 32-bit lane), VDPBF16PS --------------
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }
inline __m512bh pair_of(const uint16_t* x) {
  int pair;
  std::memcpy(&pair, x, sizeof pair);
  return as_bh(_mm512_set1_epi32(pair));
}

// q4: a group's products sum x (128 + q) in `part` (KU sets over alternate steps), then
// acc += d part + (m - 128 d) sum_x. xsum: the rows' group sums of x ([MR][G], gs apart).
template <int MR, int KU, typename Store>
__attribute__((always_inline)) inline void q4_bf16(const uint16_t* x, int64_t xs,
                                                   const float* xsum, int64_t gs,
                                                   const uint8_t* wt, int64_t G, Store&& store,
                                                   Prefetch ahead) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
  const __m512 c128 = _mm512_set1_ps(128.0f);
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = wt + g * kQ4GroupBytes;
    ahead.next(4);
    __m512 part[KU][MR][4];
    for (int u = 0; u < KU; ++u)
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < 4; ++j) part[u][m][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < kQ4Steps; s += KU) {
      for (int u = 0; u < KU; ++u) {
        ahead.next(1);
        const __m512i v = _mm512_loadu_si512(gp + kQ4Head + (s + u) * kQ4Step);
        const __m512i nib[2] = {_mm512_and_si512(v, low4),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
        const int64_t k = kGroup * g + 2 * (s + u);
        for (int j = 0; j < 4; ++j) {
          const __m512bh wv = as_bh((j & 1) ? _mm512_unpackhi_epi8(nib[j >> 1], c43)
                                            : _mm512_unpacklo_epi8(nib[j >> 1], c43));
          for (int m = 0; m < MR; ++m)
            part[u][m][j] = _mm512_dpbf16_ps(part[u][m][j], pair_of(x + m * xs + k), wv);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 d = fp16x16(gp + 32 * j);
      const __m512 mo = _mm512_fnmadd_ps(c128, d, fp16x16(gp + 128 + 32 * j));  // m - 128 d
      for (int m = 0; m < MR; ++m) {
        __m512 p = part[0][m][j];
        for (int u = 1; u < KU; ++u) p = add_exact(p, part[u][m][j]);
        acc[m][j] = _mm512_fmadd_ps(p, d, acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * gs + g]), mo, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) store(m, j, acc[m][j]);
}

// A q4 tile for n rows of bf16 x in blocks of three; xsum their group sums of x.
template <typename Store>
__attribute__((noinline)) void tile_rows_bf16(const uint16_t* x, int64_t xs, const float* xsum,
                                              int64_t gs, const uint8_t* wt, int64_t K,
                                              int64_t n, Store&& store, const uint8_t* next) {
  constexpr int R = 3;
  const Ahead ahead(n >= 2 * R ? next : nullptr, tile_bytes(Fmt::kQ4, K), n, R);
  by_blocks<R>(n, [&](auto rows, int64_t m0) {
    constexpr int MR = decltype(rows)::value;
    const auto at = [&](int m, int j, __m512 y) { store(m0 + m, j, y); };
    q4_bf16<MR, (MR == 1 ? 2 : 1)>(x + m0 * xs, xs, xsum + m0 * gs, gs, wt, K / kGroup, at,
                                   ahead.of(m0 / R));
  });
}
#endif  // QL_BF16DOT

#if defined(QL_AVX2)
// The fp32 results of 16 columns (two 8-wide halves), and their stores.
struct Lanes {
  __m256 lo, hi;
};
inline Lanes lanes_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void lanes_store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Lanes lanes_mul(Lanes a, Lanes b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline Lanes lanes_add(Lanes a, Lanes b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline void store16(float* out, Lanes y) { lanes_store(out, y); }
inline void store16(uint16_t* out, Lanes y) {
  using switchyard::bf16_round8;
  const __m256i packed = _mm256_packus_epi32(bf16_round8(y.lo), bf16_round8(y.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}
template <typename T>
inline __m256 as_stored8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(switchyard::bf16_round8(v), 16));
  }
}
template <typename T>
inline Lanes as_stored(Lanes v) {
  return {as_stored8<T>(v.lo), as_stored8<T>(v.hi)};
}
template <typename T>
inline Lanes silu_mul(Lanes g, Lanes u) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  return {switchyard::silu_mul8<kBf16>(g.lo, u.lo), switchyard::silu_mul8<kBf16>(g.hi, u.hi)};
}
inline __m256 fp16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 i8x8(const int8_t* p) {  // 8 int8 as fp32, exactly
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Strip c (columns 16 c .. 16 c + 15) of an int8 tile for MR rows of fp32 x.
template <int MR, typename Store>
__attribute__((always_inline)) inline void i8_strip(const float* x, int64_t xs, const int8_t* wt,
                                                    int64_t K, int c, Store&& store,
                                                    Prefetch ahead) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const int8_t* w = wt + 16 * c;
  for (int64_t k = 0; k < K; ++k, w += kI8Step) {
    ahead.next(1);
    const __m256 w0 = i8x8(w), w1 = i8x8(w + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * xs + k);
      acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) store(m, c, Lanes{acc[m][0], acc[m][1]});
}

// Strip c of a q4 tile for MR rows of fp32 x: its 16 columns' nibbles are the low (c < 2)
// or high (c >= 2) nibbles of the step's bytes, unpacked low (c even) or high (c odd), the
// first 8 columns from the step's first 32 bytes and the next 8 from its last 32.
template <int MR, typename Store>
__attribute__((always_inline)) inline void q4_strip(const float* x, int64_t xs, const uint8_t* wt,
                                                    int64_t G, int c, Store&& store,
                                                    Prefetch ahead) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low16 = _mm256_set1_epi32(0xFFFF);
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = wt + g * kQ4GroupBytes;
    ahead.next(1);
    for (int64_t s = 0; s < kQ4Steps; ++s) {
      ahead.next(1);
      const int64_t k = kGroup * g + 2 * s;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* at = gp + kQ4Head + s * kQ4Step + 32 * h;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        const __m256i nib = c < 2 ? _mm256_and_si256(v, low4)
                                  : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256i q =
            (c & 1) ? _mm256_unpackhi_epi8(nib, zero) : _mm256_unpacklo_epi8(nib, zero);
        const __m256 d = fp16x8(gp + 32 * c + 16 * h), mn = fp16x8(gp + 128 + 32 * c + 16 * h);
        const __m256 we = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low16)), d, mn);
        const __m256 wo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 16)), d, mn);
        for (int m = 0; m < MR; ++m) {
          const float* xr = x + m * xs + k;
          acc[m][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), we, acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), wo, acc[m][h]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) store(m, c, Lanes{acc[m][0], acc[m][1]});
}

// A tile for n rows of fp32 x: blocks of rows through the four strips, every block
// prefetching its share of the next tile (linear.cpp's AVX2 rule).
template <Fmt F, typename Store>
__attribute__((noinline)) void tile_rows_f32(
    const float* x, int64_t xs, const uint8_t* wt, int64_t K, int64_t n, Store&& store,
    const uint8_t* next) {
  constexpr int R = F == Fmt::kInt8 ? 4 : 3;
  const Ahead ahead(next, tile_bytes(F, K), n, R);
  by_blocks<R>(n, [&](auto rows, int64_t m0) {
    constexpr int MR = decltype(rows)::value;
    const auto at = [&](int m, int c, Lanes y) { store(m0 + m, c, y); };
    Prefetch share = ahead.of(m0 / R);
    const int64_t quarter = (share.lines + 3) / 4;
    for (int c = 0; c < 4; ++c) {
      Prefetch p{share.at + c * quarter * 64,
                 std::max<int64_t>(0, std::min(quarter, share.lines - c * quarter))};
      if constexpr (F == Fmt::kInt8) {
        i8_strip<MR>(x + m0 * xs, xs, reinterpret_cast<const int8_t*>(wt), K, c, at, p);
      } else {
        q4_strip<MR>(x + m0 * xs, xs, wt, K / kGroup, c, at, p);
      }
    }
  });
}

// The tile's weights as fp32 [K][64], as the strips decode them.
template <Fmt F>
inline void decode_tile(const uint8_t* wt, int64_t K, float* out) {
  if constexpr (F == Fmt::kInt8) {
    const int8_t* w8 = reinterpret_cast<const int8_t*>(wt);
    for (int64_t k = 0; k < K; ++k, out += kCols)
      for (int h = 0; h < 8; ++h) _mm256_store_ps(out + 8 * h, i8x8(w8 + k * kI8Step + 8 * h));
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < K / kGroup; ++g) {
      const uint8_t* gp = wt + g * kQ4GroupBytes;
      for (int64_t s = 0; s < kQ4Steps; ++s, out += 2 * kCols)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(gp + kQ4Head + s * kQ4Step + 32 * h));
          const __m256i nib[2] = {_mm256_and_si256(v, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
          for (int c = 0; c < 4; ++c) {
            const __m256i q = (c & 1) ? _mm256_unpackhi_epi8(nib[c >> 1], zero)
                                      : _mm256_unpacklo_epi8(nib[c >> 1], zero);
            const __m256 d = fp16x8(gp + 32 * c + 16 * h), mn = fp16x8(gp + 128 + 32 * c + 16 * h);
            float* o = out + 16 * c + 8 * h;
            const __m256 qe = _mm256_cvtepi32_ps(_mm256_and_si256(q, low16));
            const __m256 qo = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 16));
            _mm256_store_ps(o, _mm256_fmadd_ps(qe, d, mn));
            _mm256_store_ps(o + kCols, _mm256_fmadd_ps(qo, d, mn));
          }
        }
    }
  }
}

// linear.cpp's fp32 strip: columns 16 c .. 16 c + 15 for MR rows over fp32 weights [K][64].
template <int MR, typename Store>
__attribute__((always_inline)) inline void f32_strip(const float* x, int64_t xs, const float* wt,
                                                     int64_t K, int c, Store&& store,
                                                     Prefetch ahead) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* w = wt + 16 * c;
  for (int64_t k = 0; k < K; ++k, w += kCols) {
    ahead.next(1);
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * xs + k);
      acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) store(m, c, Lanes{acc[m][0], acc[m][1]});
}

template <Fmt F, typename Store>
__attribute__((noinline)) void tile_rows_wide(
    const float* x, int64_t xs, const float* wide, int64_t K, int64_t n, Store&& store,
    const uint8_t* next) {
  constexpr int R = 6;
  const Ahead ahead(next, tile_bytes(F, K), n, R);
  by_blocks<R>(n, [&](auto rows, int64_t m0) {
    constexpr int MR = decltype(rows)::value;
    Prefetch share = ahead.of(m0 / R);
    const int64_t quarter = (share.lines + 3) / 4;
    for (int c = 0; c < 4; ++c) {
      Prefetch p{share.at + c * quarter * 64,
                 std::max<int64_t>(0, std::min(quarter, share.lines - c * quarter))};
      f32_strip<MR>(x + m0 * xs, xs, wide, K, c,
                    [&](int m, int cc, Lanes y) { store(m0 + m, cc, y); }, p);
    }
  });
}
#endif  // QL_AVX2

#if defined(QL_AVX512) || defined(QL_AVX2)
// 64-byte aligned storage for a decoded tile (aligned loads and stores).
template <typename V>
struct Aligned {
  using value_type = V;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>&) {}
  V* allocate(std::size_t n) {
    return static_cast<V*>(::operator new(n * sizeof(V), std::align_val_t(64)));
  }
  void deallocate(V* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const Aligned<U>&) const {
    return false;
  }
};

// A block of x's rows as the fp32 path reads them: x itself (fp32), or bf16 rows widened
// once per block into this thread's buffer.
template <typename T>
struct F32Rows {
  const float* x = nullptr;
  int64_t stride = 0, held = -1;
  std::unique_ptr<float[]> wide;
  int64_t capacity = 0;

  void hold(int64_t b, const T* rows, int64_t xs, int64_t n, int64_t K) {
    if (b == held) return;
    held = b;
    if constexpr (std::is_same_v<T, float>) {
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

// Rows of x in blocks that stay in L2 while they meet the tiles, at least 96 (a decode
// step's rows are one block, so each weight is read once a step).
int64_t row_block(int64_t K) { return std::max<int64_t>(96, 128 * 1024 / (K * 4) / 12 * 12); }

// Blocks of this many rows or more decode each tile once into fp32 in L2 and run fp32
// FMAs over it (`tile_rows_wide`); fewer decode it in the tile loop, once per few rows.
constexpr int64_t kWideRows = 8;

// One (row block, tile) item after another, as threads claim them: `body(tile, t, m0, n,
// w, next)`, where tile(store, w, next) runs the block's rows against the tile at w (its
// sums to store(row, j, lanes)) in the path that suits them, prefetching `next`.
template <Fmt F, typename T, typename Body>
void for_items(const T* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* wp, int64_t T_,
               int64_t stride, Body&& body) {
  const int64_t block = row_block(K), items = (M + block - 1) / block * T_;
  switchyard::parallel_claims(items, 1, [&](switchyard::Claims& claims) {
    thread_local std::vector<float, Aligned<float>> wide;  // a decoded tile, [K][64]
#if defined(QL_BF16DOT)
    std::vector<float> sums;  // q4, bf16 x, few rows: the block's group sums of x, [n][G]
    int64_t summed = -1;
#endif
    F32Rows<T> rows;
    for (int64_t item = claims.next(), after; item < items; item = after) {
      after = claims.next();
      const int64_t t = item % T_, b = item / T_, m0 = b * block, n = std::min(M, m0 + block) - m0;
      const uint8_t* next = after < items ? wp + after % T_ * stride : nullptr;
      const uint8_t* wt = wp + t * stride;
#if defined(QL_BF16DOT)
      if constexpr (!std::is_same_v<T, float> && F == Fmt::kQ4) {
        if (n < kWideRows) {
          const int64_t G = K / kGroup;
          if (summed != b) {
            summed = b;
            sums.assign(n * G, 0.0f);
            for (int64_t m = 0; m < n; ++m)
              for (int64_t k = 0; k < K; ++k) {
                const uint32_t bits = static_cast<uint32_t>(xp[(m0 + m) * xs + k]) << 16;
                float v;
                std::memcpy(&v, &bits, sizeof v);
                sums[m * G + k / kGroup] += v;
              }
          }
          body(
              [&](auto&& store, const uint8_t* w, const uint8_t* nx) {
                tile_rows_bf16(xp + m0 * xs, xs, sums.data(), G, w, K, n, store, nx);
              },
              t, m0, n, wt, next);
          continue;
        }
      }
#endif
      rows.hold(b, xp + m0 * xs, xs, n, K);
      body(
          [&](auto&& store, const uint8_t* w, const uint8_t* nx) {
            if (n < kWideRows) {
              tile_rows_f32<F>(rows.x, rows.stride, w, K, n, store, nx);
            } else {
              wide.resize(K * kCols);
              decode_tile<F>(w, K, wide.data());
              tile_rows_wide<F>(rows.x, rows.stride, wide.data(), K, n, store, nx);
            }
          },
          t, m0, n, wt, next);
    }
  });
}

// out [M, 64 T] = x W^T (times the int8 row scales) + bias.
template <Fmt F, typename T>
void run(const T* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* wp, int64_t T_,
         const float* scales, const float* bias, T* op) {
  const int64_t N = T_ * kCols;
  for_items<F>(xp, xs, M, K, wp, T_, tile_bytes(F, K),
               [&](auto&& tile, int64_t t, int64_t m0, int64_t, const uint8_t* w,
                   const uint8_t* next) {
                 const float* sc = scales ? scales + t * kCols : nullptr;
                 const float* b = bias ? bias + t * kCols : nullptr;
                 T* o = op + m0 * N + t * kCols;
                 tile(
                     [&](int64_t m, int j, Lanes y) {
                       if (sc) y = lanes_mul(y, lanes_load(sc + 16 * j));
                       if (b) y = lanes_add(y, lanes_load(b + 16 * j));
                       store16(o + m * N + 16 * j, y);
                     },
                     w, next);
               });
}

// out[m, :64] = silu(g) * u for n rows of a pair's fp32 sums (as stored in T); apart from
// the tile loops, as linear.cpp's (inlined, the SiLU's constants took their registers).
template <typename T>
__attribute__((noinline)) void silu_mul_rows(const float* g, const float* u, int64_t n, T* o,
                                             int64_t N) {
  for (int64_t m = 0; m < n; ++m)
    for (int j = 0; j < 4; ++j) {
      const int64_t i = m * kCols + 16 * j;
      store16(o + m * N + 16 * j, silu_mul<T>(lanes_load(g + i), lanes_load(u + i)));
    }
}

// silu(x W_gate^T) * (x W_up^T) into out [M, 64 P] from P pairs (gate tile, up tile); int8
// scales: the gate's I rows, then the up's.
template <Fmt F, typename T>
void run_gated(const T* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* wp, int64_t P_,
               const float* scales, T* op) {
  const int64_t N = P_ * kCols, tb = tile_bytes(F, K), block = row_block(K);
  for_items<F>(xp, xs, M, K, wp, P_, 2 * tb,
               [&](auto&& tile, int64_t p, int64_t m0, int64_t n, const uint8_t* wg,
                   const uint8_t* next) {
                 thread_local std::vector<float> gates, ups;
                 gates.resize(std::min(M, block) * kCols);
                 ups.resize(gates.size());
                 const uint8_t* wu = wg + tb;
                 for (int half = 0; half < 2; ++half) {
                   float* buf = half == 0 ? gates.data() : ups.data();
                   const float* sc = scales ? scales + half * N + p * kCols : nullptr;
                   tile(
                       [&](int64_t m, int j, Lanes y) {
                         if (sc) y = lanes_mul(y, lanes_load(sc + 16 * j));
                         lanes_store(buf + m * kCols + 16 * j, as_stored<T>(y));
                       },
                       half == 0 ? wg : wu, half == 0 ? wu : next);
                 }
                 silu_mul_rows(gates.data(), ups.data(), n, op + m0 * N + p * kCols, N);
               });
}
#endif  // QL_AVX512 || QL_AVX2

// --- checks and entry points -------------------------------------------------------------

bool runs() {
#if defined(QL_AVX512) || defined(QL_AVX2)
  return true;
#else
  return false;
#endif
}

uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_x(const at::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(runs(), what, ": this CPU has no quantized kernel (AVX-512 or AVX2 with FMA, F16C)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": x a CPU fp32 or bf16 [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) == K, what, ": x has ", x.size(1), " columns, the weight ", K);
}

// packed int8 [T, K, 64] (gated: [P, 2, K, 64]) -> (tiles, K).
std::pair<int64_t, int64_t> int8_shape(const at::Tensor& packed, bool gated) {
  const int64_t d = gated ? 4 : 3, o = gated ? 1 : 0;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == d && packed.is_contiguous() &&
                  packed.size(o + 2) == kCols && (!gated || packed.size(1) == 2),
              gated ? "linear_silu_int8: a weight from pack_int8_gated"
                    : "linear_int8: a weight from pack_int8");
  return {packed.size(0), packed.size(o + 1)};
}

// packed q4 [T, G, 1280] (gated: [P, 2, G, 1280]) -> (tiles, K).
std::pair<int64_t, int64_t> q4_shape(const at::Tensor& packed, bool gated) {
  const int64_t d = gated ? 4 : 3, o = gated ? 1 : 0;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == d && packed.is_contiguous() &&
                  packed.size(o + 2) == kQ4GroupBytes && (!gated || packed.size(1) == 2),
              gated ? "linear_silu_q4: a weight from pack_q4_gated"
                    : "linear_q4: a weight from pack_q4");
  return {packed.size(0), packed.size(o + 1) * kGroup};
}

std::vector<float> fp32_vector(const c10::optional<at::Tensor>& t, int64_t n, const char* what) {
  if (!t || !t->defined()) return {};
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n, what, " of [", n, "]");
  const auto f = t->to(at::kFloat).contiguous();
  return {f.data_ptr<float>(), f.data_ptr<float>() + n};
}

template <Fmt F>
at::Tensor linear_any(const at::Tensor& x, const at::Tensor& packed, int64_t T_, int64_t K,
                      const std::vector<float>& scales, const std::vector<float>& bias) {
  const int64_t N = T_ * kCols;
  check_x(x, K, F == Fmt::kInt8 ? "linear_int8" : "linear_q4");
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
#if defined(QL_AVX512) || defined(QL_AVX2)
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const float* sc = scales.empty() ? nullptr : scales.data();
  const float* b = bias.empty() ? nullptr : bias.data();
  if (x.scalar_type() == at::kFloat) {
    run<F>(x.data_ptr<float>(), x.stride(0), x.size(0), K, w, T_, sc, b, out.data_ptr<float>());
  } else {
    run<F>(bits(x), x.stride(0), x.size(0), K, w, T_, sc, b, bits(out));
  }
#endif
  return out;
}

template <Fmt F>
at::Tensor linear_silu_any(const at::Tensor& x, const at::Tensor& packed, int64_t P_, int64_t K,
                           const std::vector<float>& scales) {
  const int64_t N = P_ * kCols;
  check_x(x, K, F == Fmt::kInt8 ? "linear_silu_int8" : "linear_silu_q4");
  auto out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return out;
#if defined(QL_AVX512) || defined(QL_AVX2)
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const float* sc = scales.empty() ? nullptr : scales.data();
  if (x.scalar_type() == at::kFloat) {
    run_gated<F>(x.data_ptr<float>(), x.stride(0), x.size(0), K, w, P_, sc, out.data_ptr<float>());
  } else {
    run_gated<F>(bits(x), x.stride(0), x.size(0), K, w, P_, sc, bits(out));
  }
#endif
  return out;
}

// Byte b (0..63) of a q4 step holds, in its low / high nibble, the value at position
// 2 col + p of the step's 128 (column, parity) values.
at::Tensor q4_byte_sources(int nibble) {
  std::vector<int64_t> idx(64);
  for (int b = 0; b < 64; ++b) {
    const int L = b / 16, u = (b % 16) / 8, i = b % 8, r = i / 2, p = i % 2;
    const int col = 16 * (2 * nibble + u) + 4 * L + r;
    idx[b] = 2 * col + p;
  }
  return at::tensor(idx, at::kLong);
}

}  // namespace

// Which path this build runs for x of `dtype` ("float32" / "bfloat16"): "avx512-bf16",
// "avx512", "avx2", or "" (none: the caller dequantizes with torch).
std::string path(const std::string& dtype) {
#if defined(QL_BF16DOT)
  if (dtype == "bfloat16") return "avx512-bf16";
#endif
#if defined(QL_AVX512)
  return dtype == "float32" || dtype == "bfloat16" ? "avx512" : "";
#elif defined(QL_AVX2)
  return dtype == "float32" || dtype == "bfloat16" ? "avx2" : "";
#else
  (void)dtype;
  return "";
#endif
}

// q int8 [N, K], N a multiple of 64 -> its tiles [N/64, K, 64].
at::Tensor pack_int8(const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar,
              "pack_int8: a CPU int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % kCols == 0 && N > 0 && K > 0, "pack_int8: N a multiple of 64");
  return q.contiguous().view({N / kCols, kCols, K}).transpose(1, 2).contiguous();
}

// An MLP's [2 I, K] gate_up -> (gate tile, up tile) pairs [I/64, 2, K, 64].
at::Tensor pack_int8_gated(const at::Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar,
              "pack_int8_gated: a CPU int8 [2 I, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % (2 * kCols) == 0 && N > 0 && K > 0,
              "pack_int8_gated: halves of a multiple of 64 rows");
  return q.contiguous().view({2, N / 2 / kCols, kCols, K}).permute({1, 0, 3, 2}).contiguous();
}

// q uint8 [N, K] (values 0..15), d and m fp16 [N, K/32] -> tiles [N/64, K/32, 1280].
at::Tensor pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kByte,
              "pack_q4: a CPU uint8 [N, K] of values 0..15");
  const int64_t N = q.size(0), K = q.size(1), T = N / kCols, G = K / kGroup;
  TORCH_CHECK(N % kCols == 0 && N > 0 && K % kGroup == 0 && K > 0,
              "pack_q4: N a multiple of 64, K a multiple of 32");
  for (const auto* s : {&d, &m})
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 2 && s->size(0) == N &&
                    s->size(1) == G,
                "pack_q4: d and m fp16 [N, K / 32]");
  TORCH_CHECK(q.max().item<int>() <= 15, "pack_q4: values 0..15");
  const auto head = [&](const at::Tensor& s) {  // [T, G, 64] fp16 as [T, G, 128] bytes
    return s.contiguous().view({T, kCols, G}).transpose(1, 2).contiguous().view(at::kByte);
  };
  // [T, 64, G, 16, 2] -> [T, G, 16, 64, 2] -> [T, G, 16, 128 (column, parity)]
  const auto steps =
      q.contiguous().view({T, kCols, G, kQ4Steps, 2}).permute({0, 2, 3, 1, 4}).reshape(
          {T, G, kQ4Steps, 2 * kCols});
  const auto high = steps.index_select(3, q4_byte_sources(1)).bitwise_left_shift(4);
  const auto bytes = steps.index_select(3, q4_byte_sources(0))
                         .bitwise_or(high)
                         .reshape({T, G, kQ4Steps * kQ4Step});
  return at::cat({head(d), head(m), bytes}, 2).contiguous();
}

// An MLP's [2 I, K] gate_up -> (gate tile, up tile) pairs [I/64, 2, K/32, 1280].
at::Tensor pack_q4_gated(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  const int64_t N = q.size(0);
  TORCH_CHECK(q.dim() == 2 && N % (2 * kCols) == 0,
              "pack_q4_gated: halves of a multiple of 64 rows");
  const int64_t I = N / 2;
  const auto gate = pack_q4(q.narrow(0, 0, I), d.narrow(0, 0, I), m.narrow(0, 0, I));
  const auto up = pack_q4(q.narrow(0, I, I), d.narrow(0, I, I), m.narrow(0, I, I));
  return at::stack({gate, up}, 1).contiguous();
}

// The inverse of pack_int8 / pack_int8_gated: q [N, K].
at::Tensor unpack_int8(const at::Tensor& packed) {
  const bool gated = packed.dim() == 4;
  const auto [T, K] = int8_shape(packed, gated);
  if (gated) return packed.permute({1, 0, 3, 2}).reshape({2 * T * kCols, K}).contiguous();
  return packed.transpose(1, 2).reshape({T * kCols, K}).contiguous();
}

// The inverse of pack_q4 / pack_q4_gated: (q [N, K], d [N, K/32], m [N, K/32]).
std::vector<at::Tensor> unpack_q4(const at::Tensor& packed) {
  const bool gated = packed.dim() == 4;
  const auto [T0, K] = q4_shape(packed, gated);
  const auto flat = gated ? packed.transpose(0, 1).reshape({2 * T0, K / kGroup, kQ4GroupBytes})
                          : packed;
  const int64_t T = flat.size(0), G = K / kGroup;
  const auto scale = [&](int64_t at_byte) {  // [T, G, 64] fp16 -> [N, G]
    return flat.narrow(2, at_byte, 128).contiguous().view(at::kHalf).transpose(1, 2).reshape(
        {T * kCols, G});
  };
  const auto bytes = flat.narrow(2, kQ4Head, kQ4Steps * kQ4Step)
                         .reshape({T, G, kQ4Steps, kQ4Step})
                         .to(at::kLong);
  auto steps = at::zeros({T, G, kQ4Steps, 2 * kCols}, at::kLong);
  steps.index_copy_(3, q4_byte_sources(0), bytes.bitwise_and(15));
  steps.index_copy_(3, q4_byte_sources(1), bytes.bitwise_right_shift(4));
  const auto q = steps.view({T, G, kQ4Steps, kCols, 2})
                     .permute({0, 3, 1, 2, 4})
                     .reshape({T * kCols, K})
                     .to(at::kByte);
  return {q, scale(0).contiguous(), scale(128).contiguous()};
}

// x [M, K] (fp32 or bf16, rows contiguous) times an int8 weight from pack_int8, its row
// scales fp32 [N] and an optional bias [N]: y [M, N] in x's dtype.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  const auto [T, K] = int8_shape(packed, false);
  const int64_t N = T * kCols;
  return linear_any<Fmt::kInt8>(x, packed, T, K, fp32_vector(scales, N, "linear_int8: scales"),
                                fp32_vector(bias, N, "linear_int8: a bias"));
}

// x [M, K] times a q4 weight from pack_q4, plus an optional bias [N].
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias) {
  const auto [T, K] = q4_shape(packed, false);
  return linear_any<Fmt::kQ4>(x, packed, T, K, {},
                              fp32_vector(bias, T * kCols, "linear_q4: a bias"));
}

// silu(x W_gate^T) * (x W_up^T) from pack_int8_gated, scales [2 I] (gate's rows, then up's).
at::Tensor linear_silu_int8(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales) {
  const auto [P, K] = int8_shape(packed, true);
  const auto sc = fp32_vector(scales, 2 * P * kCols, "linear_silu_int8: scales");
  return linear_silu_any<Fmt::kInt8>(x, packed, P, K, sc);
}

// silu(x W_gate^T) * (x W_up^T) from pack_q4_gated.
at::Tensor linear_silu_q4(const at::Tensor& x, const at::Tensor& packed) {
  const auto [P, K] = q4_shape(packed, true);
  return linear_silu_any<Fmt::kQ4>(x, packed, P, K, {});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("path", &path, "the code path for x of a dtype (\"\" where none runs)");
  m.def("pack_int8", &pack_int8, "int8 [N, K] into tiles");
  m.def("pack_int8_gated", &pack_int8_gated, "an MLP's int8 [2 I, K] gate_up into tile pairs");
  m.def("pack_q4", &pack_q4, "q4 values [N, K], d and m [N, K/32] into tiles");
  m.def("pack_q4_gated", &pack_q4_gated, "an MLP's q4 gate_up into tile pairs");
  m.def("unpack_int8", &unpack_int8, "the inverse of pack_int8 (or its gated form)");
  m.def("unpack_q4", &unpack_q4, "the inverse of pack_q4 (or its gated form): q, d, m");
  m.def("linear_int8", &linear_int8, "x W^T + b, W int8 tiles with row scales", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("linear_q4", &linear_q4, "x W^T + b, W q4 tiles", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
  m.def("linear_silu_int8", &linear_silu_int8, "silu(x Wg^T) * (x Wu^T), int8 tile pairs");
  m.def("linear_silu_q4", &linear_silu_q4, "silu(x Wg^T) * (x Wu^T), q4 tile pairs");
}
