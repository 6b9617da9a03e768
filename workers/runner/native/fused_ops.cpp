// The decode step's small per-layer ops, fused: each is one pass over its rows where
// torch runs several ops (and, in bf16, a conversion round trip between each).
//
// Every rounding to the storage dtype that torch makes is made here too, in the same
// order. Built with -ffast-math so the loops vectorise: results may differ from torch's in
// the last bit of a sum (RMSNorm's sum of squares), of exp (SiLU: vec_math.h's, shared
// with linear.cpp's fused MLP up) or of a fused multiply-add (rotary), never more.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

inline float load(const float* p) { return *p; }

inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> bfloat16 bits, round to nearest even (as c10::BFloat16 does for finite
// values), without c10's NaN branch so that the loops vectorise.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Round to T and back: what storing a float result in a T tensor does.
inline float round_to(float x, const float*) { return x; }

inline float round_to(float x, const at::BFloat16*) {
  uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, float x) { *p = x; }

inline void store(at::BFloat16* p, float x) { *reinterpret_cast<uint16_t*>(p) = bf16_bits(x); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, dim] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, ": float32 or bfloat16");
}

// Calls f(T{}) with T the C++ type of `t` (checked to be float32 or bfloat16).
template <typename F>
void dispatch(at::ScalarType t, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Whether x is a NaN, from its bits: -ffast-math lets the compiler assume that no float
// is, so `x != x` cannot be trusted here.
inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// Index of the largest of r[0..V): the first of equal ones, or the first NaN if there is
// one, as torch.argmax answers. Two passes: the maximum (and whether a NaN is there),
// then the first index that holds it; the row is in cache for the second.
int64_t argmax_row(const float* r, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  __mmask16 vnan = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
  for (; j + 16 <= V; j += 16) {
    const __m512 x = _mm512_loadu_ps(r + j);
    vm = _mm512_max_ps(vm, x);
    const __m512i bits = _mm512_and_si512(_mm512_castps_si512(x), abs_mask);
    vnan |= _mm512_cmpgt_epi32_mask(bits, inf_bits);
  }
  m = _mm512_reduce_max_ps(vm);
  nan = vnan != 0;
#elif defined(__AVX2__)
  // 8 lanes (Zen 3, 64 x 8,192 logits on two cores: scalar 420 us, this 46 us).
  __m256 vm = _mm256_set1_ps(m);
  __m256i vnan = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf_bits = _mm256_set1_epi32(0x7F800000);
  for (; j + 8 <= V; j += 8) {
    const __m256 x = _mm256_loadu_ps(r + j);
    vm = _mm256_max_ps(vm, x);
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(x), abs_mask);
    vnan = _mm256_or_si256(vnan, _mm256_cmpgt_epi32(bits, inf_bits));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  nan = !_mm256_testz_si256(vnan, vnan);
#endif
  for (int64_t t = j; t < V; ++t) {
    nan = nan || is_nan(r[t]);
    if (r[t] > m) m = r[t];
  }
  if (nan) {
    for (int64_t t = 0; t < V; ++t)
      if (is_nan(r[t])) return t;
  }
  j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; j + 16 <= V; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + j), target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(m);
  for (; j + 8 <= V; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
#endif
  for (; j < V; ++j)
    if (r[j] == m) return j;
  return 0;  // every value is -inf: torch answers the first
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T), as workers.runner.ops.rms_norm; with
// `residual`, first h += residual in place (h is x).
template <typename T>
void rms_norm_rows(const at::Tensor& h, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, const at::Tensor& out) {
  const int64_t n = h.size(0), d = h.size(1);
  T* hp = h.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hs = h.stride(0), rs = residual ? residual->stride(0) : 0, os = out.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = hp + i * hs;
      if (rp) {
        const T* add = rp + i * rs;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) store(row + j, load(row + j) + load(add + j));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) {
        const float x = load(row + j);
        ss += x * x;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + e);
      T* o = op + i * os;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) {
        const float y = round_to(load(row + j) * r, wp);
        store(o + j, load(wp + j) * y);
      }
    }
  });
}

// x * cos + rotate_half(x) * sin per head, rounding after each op as torch does.
template <typename T>
void rope_heads(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& out) {
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, n, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cp + i * cs;
      const T* s = sp + i * ss;
      for (int64_t h = 0; h < heads; ++h) {
        const T* v = xp + i * xs0 + h * xs1;
        T* o = op + (i * heads + h) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {  // rotate_half: -x[half:] here
          const float a = round_to(load(v + j) * load(c + j), v);
          const float b = round_to(-load(v + j + half) * load(s + j), v);
          store(o + j, a + b);
        }
#pragma omp simd
        for (int64_t j = half; j < dim; ++j) {  // and x[:half] here
          const float a = round_to(load(v + j) * load(c + j), v);
          const float b = round_to(load(v + j - half) * load(s + j), v);
          store(o + j, a + b);
        }
      }
    }
  });
}

// silu(gate) * up in vectors of the SiLU in vec_math.h, which linear.cpp's `linear_silu`
// runs too, so that it and this (after the linear) give the same bits: GCC's own
// vectorisation of `x / (1 + exp(-x))` (libmvec's exp, a reciprocal estimate for the
// division, at the vector width the CPU's tuning prefers) rounded a SiLU an ulp away from
// the fused kernel's on Sapphire Rapids. A row's last width % lanes values go through a
// zero-padded vector, so that every value gets the same arithmetic.
#if defined(__AVX512F__)
struct SiluLanes {
  static constexpr int64_t n = 16;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const at::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  template <typename T>
  static __m512 silu_mul(__m512 g, __m512 u) {
    return switchyard::silu_mul16<std::is_same_v<T, at::BFloat16>>(g, u);
  }
  static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
  static void store(at::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(switchyard::bf16_round16(v)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct SiluLanes {
  static constexpr int64_t n = 8;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load(const at::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  template <typename T>
  static __m256 silu_mul(__m256 g, __m256 u) {
    return switchyard::silu_mul8<std::is_same_v<T, at::BFloat16>>(g, u);
  }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static void store(at::BFloat16* p, __m256 v) {
    const __m256i bits = switchyard::bf16_round8(v);  // each in a 32-bit lane's low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1)));
  }
};
#endif

// silu(gate) * up, with gate and up the two halves of each row of `gate_up`.
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, n, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = gp + i * gs;
      const T* u = g + width;
      T* o = op + i * width;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      using V = SiluLanes;
      int64_t j = 0;
      for (; j + V::n <= width; j += V::n)
        V::store(o + j, V::silu_mul<T>(V::load(g + j), V::load(u + j)));
      if (j < width) {
        T gt[V::n] = {}, ut[V::n] = {}, ot[V::n];
        std::memcpy(gt, g + j, (width - j) * sizeof(T));
        std::memcpy(ut, u + j, (width - j) * sizeof(T));
        V::store(ot, V::silu_mul<T>(V::load(gt), V::load(ut)));
        std::memcpy(o + j, ot, (width - j) * sizeof(T));
      }
#else
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float x = load(g + j);
        const float act = round_to(x / (1.f + std::exp(-x)), g);
        store(o + j, act * load(u + j));
      }
#endif
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "rms_norm: weight of [dim] in x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    rms_norm_rows<decltype(tag)>(x, nullptr, weight, eps, out);
  });
  return out;
}

// h += residual (in place), then returns rms_norm(h).
at::Tensor add_rms_norm_(const at::Tensor& h, const at::Tensor& residual,
                         const at::Tensor& weight, double eps) {
  check_rows(h, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == h.sizes() && residual.scalar_type() == h.scalar_type(),
              "add_rms_norm_: residual of h's shape and dtype");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == h.size(1), "add_rms_norm_: weight of [dim] in h's dtype");
  auto out = at::empty({h.size(0), h.size(1)}, h.options());
  dispatch(h.scalar_type(), [&](auto tag) {
    rms_norm_rows<decltype(tag)>(h, &residual, weight, eps, out);
  });
  return out;
}

// Rotary embedding of q [tokens, heads, dim] and k [tokens, kv_heads, dim] (any row
// strides, contiguous heads) with cos/sin [tokens, dim]: new contiguous q and k.
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1,
                "rope: CPU [tokens, heads, dim] with contiguous heads");
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->size(0) == q.size(0) &&
                    t->size(2) == q.size(2), "rope: q and k of one dtype, tokens and dim");
  }
  for (const auto* t : {&cos, &sin}) {
    check_rows(*t, "rope");
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->size(0) == q.size(0) &&
                    t->size(1) == q.size(2), "rope: cos/sin of [tokens, dim]");
  }
  TORCH_CHECK(q.size(2) % 2 == 0, "rope: even head dim");
  auto q_out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto k_out = at::empty({k.size(0), k.size(1), k.size(2)}, k.options());
  dispatch(q.scalar_type(), [&](auto tag) {
    rope_heads<decltype(tag)>(q, cos, sin, q_out);
    rope_heads<decltype(tag)>(k, cos, sin, k_out);
  });
  return {q_out, k_out};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate and up halves");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) { silu_mul_rows<decltype(tag)>(gate_up, out); });
  return out;
}

// Stores k and v ([tokens, kv_heads, dim], contiguous heads, any token stride) into
// slots[i] of every head of k_cache and v_cache ([kv_heads, slots, dim], contiguous):
// the paged cache's write, one copy of each head's row (torch's index_put costs ~35 us a
// call at decode sizes, 16 calls a step).
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slots) {
  for (const auto* t : {&k_cache, &v_cache, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1,
                "write_kv: CPU tensors of 3 dims with contiguous rows");
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), "write_kv: one dtype");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "write_kv: caches of one contiguous shape");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(0) &&
                  k.size(2) == k_cache.size(2), "write_kv: k/v of [tokens, kv_heads, dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0), "write_kv: one int64 slot per token");
  const int64_t n = k.size(0), heads = k.size(1), dim = k.size(2), num_slots = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " out of range");
  const int64_t bytes = dim * static_cast<int64_t>(k.element_size());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size();
  const int64_t ks0 = k.stride(0) * es, ks1 = k.stride(1) * es;
  const int64_t vs0 = v.stride(0) * es, vs1 = v.stride(1) * es;
  at::parallel_for(0, n, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = (h * num_slots + sp[i]) * bytes;
        std::memcpy(kc + at, kp + i * ks0 + h * ks1, bytes);
        std::memcpy(vc + at, vp + i * vs0 + h * vs1, bytes);
      }
    }
  });
}

// Each row's argmax ([rows] int64) of fp32 logits [rows, vocab], as torch.argmax(dim=-1):
// torch's CPU reduction took 450 us for 64 x 8,192 logits (2 MiB: under 5 GB/s).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: fp32 [rows, vocab]");
  const int64_t n = x.size(0), V = x.size(1), stride = x.stride(0);
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) op[i] = argmax_row(xp + i * stride, V);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of rows");
  m.def("add_rms_norm_", &add_rms_norm_, "h += residual, then RMSNorm of h's rows");
  m.def("rope", &rope, "rotate-half rotary embedding of q and k");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("write_kv", &write_kv, "store new keys and values into their paged-cache slots");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(dim=-1)");
}
