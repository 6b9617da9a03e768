// Causal attention of a whole prompt (no cached context) in bf16, for CPUs with
// AVX512-BF16.
//
// torch's CPU flash-attention kernel ran bf16 prompts at 20-100 GFLOP/s on the bench
// model (prompts of 272 tokens: 2.2 ms a layer), a fraction of what the bf16 dot-product
// instruction (VDPBF16PS: 32 multiply-adds of bf16 pairs into fp32) gives. Here every
// product is one of those, laid out so that no horizontal sum is needed:
//
//  - keys are packed per KV head in blocks of 16 keys as [D/2][16][2] (two dims of one
//    key side by side), so one vector holds a dim pair of 16 keys and a query's score
//    against all 16 accumulates in one register, a broadcast query pair at a time;
//  - values are packed as [key pairs][D][2] (one dim of two keys side by side), so the
//    weighted sum over keys accumulates a broadcast pair of probabilities at a time.
//
// A task is (KV head, block of 16 query tokens): its G query heads' scores against every
// key it may see, an exact softmax per row in fp32, the probabilities rounded to bf16 (as
// torch's kernel rounds them before its second matrix product), then the values.
//
// Numerics: exact bf16 products summed in fp32 (in a different order from torch's), fp32
// softmax, bf16 probabilities, fp32 normalisation. Not the bits of torch's kernel: bf16
// output is tested against transformers bf16 by closeness, as the rest of the bf16 path.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define SWITCHYARD_PREFILL 1
#endif

namespace {

#if defined(SWITCHYARD_PREFILL)

constexpr int64_t kKeys = 16;  // keys per packed block (one vector of fp32 scores)
constexpr int64_t kQueries = 16;  // query tokens per task

inline uint16_t bf16_bits(float x) {  // round to nearest even, as c10::BFloat16
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

inline uint32_t pair_at(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// Packs one KV head's keys ([n] rows of D at `k`, row stride ks) into blocks of 16:
// out[b][d2][j][0..1] = k[16b + j][2 d2 .. 2 d2 + 1], zeros past n.
void pack_keys(const uint16_t* k, int64_t ks, int64_t n, int64_t D, uint16_t* out) {
  const int64_t blocks = (n + kKeys - 1) / kKeys;
  std::memset(out, 0, blocks * kKeys * D * sizeof(uint16_t));
  for (int64_t t = 0; t < n; ++t) {
    uint16_t* blk = out + (t / kKeys) * kKeys * D + (t % kKeys) * 2;
    const uint16_t* row = k + t * ks;
    for (int64_t d2 = 0; d2 < D / 2; ++d2) std::memcpy(blk + d2 * kKeys * 2, row + 2 * d2, 4);
  }
}

// Packs one KV head's values in key pairs: out[p][d][0..1] = v[2p][d], v[2p + 1][d].
void pack_values(const uint16_t* v, int64_t vs, int64_t n, int64_t D, uint16_t* out) {
  const int64_t pairs = (n + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* a = v + 2 * p * vs;
    const bool has_b = 2 * p + 1 < n;
    const uint16_t* b = a + vs;
    uint16_t* o = out + p * D * 2;
    for (int64_t d = 0; d < D; ++d) {
      o[2 * d] = a[d];
      o[2 * d + 1] = has_b ? b[d] : 0;
    }
  }
}

// Scores of ROWS query rows against the 16 keys of one packed block, scaled, into
// s[r * ld ..]: for each dim pair, one load of the block and one VDPBF16PS per row.
template <int64_t D, int ROWS>
inline void score_rows(const uint16_t* const* q, const uint16_t* kb, float scale, float* s,
                       int64_t ld) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    const __m512bh kv = as_bh(_mm512_loadu_si512(kb + d2 * kKeys * 2));
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_set1_epi32(pair_at(q[r] + 2 * d2))), kv);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(s + r * ld, _mm512_mul_ps(acc[r], sc));
}

template <int64_t D>
inline void score_block(const uint16_t* const* q, int rows, const uint16_t* kb, float scale,
                        float* s, int64_t ld) {
  if (rows == 8) return score_rows<D, 8>(q, kb, scale, s, ld);
  for (int r = 0; r < rows; ++r) score_rows<D, 1>(q + r, kb, scale, s + r * ld, ld);
}

// out rows = p rows (bf16, key pairs) times the packed values, over `pairs` key pairs:
// R rows at a time, D / 16 accumulators each.
template <int64_t D, int R>
inline void weigh_values(const uint16_t* const* p, const uint16_t* vp, int64_t pairs,
                         float (*out)[D]) {
  constexpr int C = D / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* vj = vp + j * D * 2;
    __m512bh w[R];
    for (int r = 0; r < R; ++r) w[r] = as_bh(_mm512_set1_epi32(pair_at(p[r] + 2 * j)));
    for (int c = 0; c < C; ++c) {
      const __m512bh v = as_bh(_mm512_loadu_si512(vj + c * 32));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[r], v);
    }
  }
  // Lane l of chunk c holds dim 16 c + l: the pairs were summed inside the instruction.
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + c * 16, acc[r][c]);
}

template <int64_t D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
         const at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), Hkv = k.size(1), G = Hq / Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  constexpr int kGroup = D <= 64 ? 4 : 2;  // rows per value pass: 16 accumulators
  const int64_t blocks = (n + kKeys - 1) / kKeys, pairs = (n + 1) / 2;
  const int64_t key_head = blocks * kKeys * D, value_head = pairs * D * 2;
  std::vector<uint16_t> keys(Hkv * key_head), values(Hkv * value_head);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys(kp + h * ks1, ks0, n, D, keys.data() + h * key_head);
      pack_values(vp + h * vs1, vs0, n, D, values.data() + h * value_head);
    }
  });
  const int64_t qblocks = (n + kQueries - 1) / kQueries;
  const int64_t width = blocks * kKeys;  // a score row, padded to whole key blocks
  // Tasks head-major: with as many threads as KV heads divide into, each thread gets the
  // same mix of short (early) and long (late) query blocks.
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueries * G;
    std::vector<float> scores(max_rows * width), sums(max_rows);
    std::vector<uint16_t> probs(max_rows * (width + 2));
    std::vector<float> res(8 * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / qblocks, qb = task % qblocks;
      const int64_t t0 = qb * kQueries, t1 = std::min(n, t0 + kQueries);
      const int64_t rows = (t1 - t0) * G;  // row r: token t0 + r / G, query head h G + r % G
      const uint16_t* kh = keys.data() + h * key_head;
      const uint16_t* vh = values.data() + h * value_head;
      const int64_t last_block = (t1 - 1) / kKeys;  // the last key block any row sees
      std::vector<const uint16_t*> qrow(rows);
      for (int64_t r = 0; r < rows; ++r)
        qrow[r] = qp + (t0 + r / G) * qs0 + (h * G + r % G) * qs1;
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int rr = static_cast<int>(std::min<int64_t>(8, rows - r0));
        // Rows in this group see keys up to their own token; the group's last token bounds
        // the blocks to score.
        const int64_t group_last = (t0 + (r0 + rr - 1) / G) / kKeys;
        for (int64_t b = 0; b <= std::min(group_last, last_block); ++b)
          score_block<D>(qrow.data() + r0, rr, kh + b * kKeys * D, scale,
                         scores.data() + r0 * width + b * kKeys, width);
      }
      // Softmax of each row over keys 0..its token, in fp32; the probabilities rounded to
      // bf16 and zero-padded to the next key pair for the value pass.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t len = t0 + r / G + 1;
        float* s = scores.data() + r * width;
        float m = s[0];
        for (int64_t j = 1; j < len; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        sums[r] = sum;
        uint16_t* pr = probs.data() + r * (width + 2);
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) pr[j] = bf16_bits(s[j]);
        // The value pass runs a row to the longest row of its group (up to R - 1 tokens
        // later) rounded up to a key pair: zeros there.
        for (int64_t j = len; j < std::min<int64_t>(width + 2, len + 2 * kGroup + 2); ++j) pr[j] = 0;
      }
      // Rows of one group run over the group's longest row; a shorter row's pad is zero.
      constexpr int R = kGroup;
      const uint16_t* prow[R];
      for (int64_t r0 = 0; r0 < rows; r0 += R) {
        const int64_t rr = std::min<int64_t>(R, rows - r0);
        for (int r = 0; r < R; ++r) prow[r] = probs.data() + (r0 + std::min<int64_t>(r, rr - 1)) * (width + 2);
        const int64_t len = t0 + (r0 + rr - 1) / G + 1;
        auto* acc = reinterpret_cast<float (*)[D]>(res.data());
        weigh_values<D, R>(prow, vh, (len + 1) / 2, acc);
        for (int64_t r = 0; r < rr; ++r) {
          const float inv = 1.f / sums[r0 + r];
          const int64_t row = r0 + r;
          uint16_t* o = op + (t0 + row / G) * os0 + (h * G + row % G) * os1;
          for (int64_t d = 0; d < D; ++d) o[d] = bf16_bits(acc[r][d] * inv);
        }
      }
    }
  });
}

#endif  // SWITCHYARD_PREFILL

}  // namespace

// Whether this build has the kernel, and for which head dims.
bool supports(int64_t head_dim) {
#if defined(SWITCHYARD_PREFILL)
  return head_dim == 64 || head_dim == 128;
#else
  (void)head_dim;
  return false;
#endif
}

// Causal attention of q [n, heads, dim] over k/v [n, kv_heads, dim] (bf16, contiguous
// dims, any row strides; query i sees keys 0..i) into out [n, heads, dim].
void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, const at::Tensor& out) {
  for (const auto* t : {&q, &k, &v, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16,
                "prefill_attention: bf16 CPU tensors");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "prefill_attention: [n, heads, dim]");
    TORCH_CHECK(t->size(0) == q.size(0) && t->size(2) == q.size(2), "prefill_attention: shapes");
  }
  TORCH_CHECK(k.sizes() == v.sizes() && out.sizes() == q.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(supports(q.size(2)), "prefill_attention: head dim 64 or 128 with AVX512-BF16");
  TORCH_CHECK(q.size(0) > 0, "prefill_attention: no tokens");
#if defined(SWITCHYARD_PREFILL)
  const float sc = static_cast<float>(scale);
  if (q.size(2) == 64) {
    run<64>(q, k, v, sc, out);
  } else {
    run<128>(q, k, v, sc, out);
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether head dim is supported on this CPU");
  m.def("prefill_attention", &prefill_attention, "causal bf16 attention of a whole prompt");
}
