// bf16 linear layers (y = x W^T + b) on AVX512-BF16, for the CPU's bf16 path at every
// batch size: the decode steps' small ones and the prompts' large ones alike.
//
// oneDNN's packed bf16 GEMM (what torch runs) streams its weights at about half the
// memory bandwidth at batch 1-16, where a decode step is bound by reading the weights,
// and reaches the matrix units' peak only from a few hundred rows. Here the weights are
// packed once, at load, into tiles of 64 output columns laid out for VDPBF16PS:
//
//   packed[t][k / 2][c][k % 2] = W[64 t + c][k]   ([N / 64, K / 2, 64, 2])
//
// so that one 64-byte load holds a pair of input dims for 16 columns, and a tile's
// weights are one contiguous run that the hardware prefetcher streams. A thread takes
// whole tiles (contiguous memory); for each, rows of x go four at a time through a 4 x 64
// block of fp32 accumulators (16 registers): per input pair, 4 loads of weights, 4
// broadcasts of x and 16 VDPBF16PS, with no horizontal sums. Fewer than four rows keep
// more partial sums per output in flight (the instruction's latency), added at the end.
//
// Measured on this machine's 2 cores (Zen 4, bench model shapes, weights of 8 layers
// cycled so they come from memory as in a decode step): batch 1: 2.33 vs oneDNN's 3.55
// ms, batch 4: 1.93 vs 2.67, 16: 3.54 vs 4.41, 64: 9.58 vs 10.53, 256: 36.1 vs 37.5; a
// 2,048-token prompt's step: the same (399-412 vs 398-408 ms, alternating in one engine).
// In the engine, the levers scenario of `switchyard bench engine` (decode steps with our
// tiles and with oneDNN's): oneDNN's layout 1.50x slower at batch 1, 1.25x at 16, 1.09x
// at 64 (docs/benchmarks/engine-roofline.md).
//
// Numerics: fp32 accumulation (in a different order from oneDNN's), the bias added in
// fp32, one rounding to bf16 at the end, as torch's bf16 linear.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define SWITCHYARD_BF16_LINEAR 1
#endif

namespace {

constexpr int64_t kCols = 64;  // output columns of a tile: four vectors of 16 fp32

#if defined(SWITCHYARD_BF16_LINEAR)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

inline int pair_at(const uint16_t* p) {
  int x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// One tile's 64 outputs for MR rows of x (row stride xs), over K2 input pairs; KU
// independent partial sums per output so that MR * KU >= 4 chains are in flight.
template <int MR, int KU>
inline void tile(const uint16_t* x, int64_t xs, const uint16_t* wt, int64_t K2,
                 const float* bias, uint16_t* out, int64_t os) {
  __m512 acc[KU][MR][4];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) acc[u][m][c] = _mm512_setzero_ps();
  int64_t kp = 0;
  for (; kp + KU <= K2; kp += KU) {
    for (int u = 0; u < KU; ++u) {
      const uint16_t* w = wt + (kp + u) * kCols * 2;
      __m512bh wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = as_bh(_mm512_loadu_si512(w + c * 32));
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = as_bh(_mm512_set1_epi32(pair_at(x + m * xs + 2 * (kp + u))));
        for (int c = 0; c < 4; ++c) acc[u][m][c] = _mm512_dpbf16_ps(acc[u][m][c], xv, wv[c]);
      }
    }
  }
  for (; kp < K2; ++kp) {  // the last K2 % KU pairs
    const uint16_t* w = wt + kp * kCols * 2;
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = as_bh(_mm512_set1_epi32(pair_at(x + m * xs + 2 * kp)));
      for (int c = 0; c < 4; ++c)
        acc[0][m][c] = _mm512_dpbf16_ps(acc[0][m][c], xv, as_bh(_mm512_loadu_si512(w + c * 32)));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) {
      __m512 y = acc[0][m][c];
      for (int u = 1; u < KU; ++u) y = _mm512_add_ps(y, acc[u][m][c]);
      if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + c * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * os + c * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    }
}
#endif

}  // namespace

// Whether this build has the kernel (a CPU with AVX512-BF16).
bool supported() {
#if defined(SWITCHYARD_BF16_LINEAR)
  return true;
#else
  return false;
#endif
}

// W [N, K] bf16, N a multiple of 64 and K even -> its tiles [N / 64, K / 2, 64, 2].
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "bf16_linear.pack: a CPU bf16 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kCols == 0 && K % 2 == 0 && K > 0, "bf16_linear.pack: N a multiple of 64, K even");
  const auto wc = w.contiguous();
  auto out = at::empty({N / kCols, K / 2, kCols, 2}, w.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, N / kCols, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < kCols; ++c) {
        const uint16_t* row = wp + (t * kCols + c) * K;
        uint16_t* dst = op + t * K * kCols + c * 2;
        for (int64_t k = 0; k < K; k += 2) {
          dst[k * kCols] = row[k];
          dst[k * kCols + 1] = row[k + 1];
        }
      }
  });
  return out;
}

// The inverse of `pack`: W [N, K].
at::Tensor unpack(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear.unpack: a packed weight");
  const int64_t N = packed.size(0) * kCols, K = packed.size(1) * 2;
  return packed.permute({0, 2, 1, 3}).reshape({N, K}).contiguous();
}

// x [M, K] bf16 (rows contiguous) times packed W [N / 64, K / 2, 64, 2], plus an optional
// bias [N]: y [M, N] bf16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "bf16_linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1, "bf16_linear: x a CPU bf16 [M, K] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_linear: a weight from bf16_linear.pack");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), K2 = packed.size(1);
  const int64_t N = T * kCols;
  TORCH_CHECK(K == 2 * K2, "bf16_linear: x has ", K, " columns, the weight ", 2 * K2);
  std::vector<float> bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_linear: a bias of [N]");
    const auto b = bias->to(at::kFloat).contiguous();
    bf.assign(b.data_ptr<float>(), b.data_ptr<float>() + N);
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(SWITCHYARD_BF16_LINEAR)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t xs = x.stride(0);
  // Rows in blocks of about 128 KiB of x, so that a block stays in L2 while it meets each
  // of the thread's tiles (a prompt's x is megabytes; decode steps are one block).
  const int64_t block = std::max<int64_t>(4, (128 * 1024 / (2 * K)) / 4 * 4);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block);
      for (int64_t t = t0; t < t1; ++t) {
        const uint16_t* wt = wp + t * K2 * kCols * 2;
        const float* b = bf.empty() ? nullptr : bf.data() + t * kCols;
        uint16_t* o = op + t * kCols;
        int64_t m = m0;
        for (; m + 4 <= m1; m += 4) tile<4, 1>(xp + m * xs, xs, wt, K2, b, o + m * N, N);
        const int64_t rest = m1 - m;
        const uint16_t* xr = xp + m * xs;
        if (rest == 3) tile<3, 2>(xr, xs, wt, K2, b, o + m * N, N);
        if (rest == 2) tile<2, 2>(xr, xs, wt, K2, b, o + m * N, N);
        if (rest == 1) tile<1, 4>(xr, xs, wt, K2, b, o + m * N, N);
      }
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the kernel (AVX512-BF16)");
  m.def("pack", &pack, "a bf16 [N, K] weight into the kernel's tiles");
  m.def("unpack", &unpack, "a packed weight back to [N, K]");
  m.def("linear", &linear, "x W^T + b in bf16, W packed", py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none());
}
