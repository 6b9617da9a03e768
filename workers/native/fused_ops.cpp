// The decode step's small per-layer ops, fused: each is one pass over its rows where
// torch runs several ops (and, in bf16, a conversion round trip between each).
//
// Every rounding to the storage dtype that torch makes is made here too, in the same
// order. Built with -ffast-math so the loops vectorise (exp included, through libmvec):
// results may differ from torch's in the last bit of a sum (RMSNorm's sum of squares),
// of exp (SiLU) or of a fused multiply-add (rotary), never more.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

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

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T), as workers.model.rms_norm; with
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
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float x = load(g + j);
        const float act = round_to(x / (1.f + std::exp(-x)), g);
        store(o + j, act * load(u + j));
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of rows");
  m.def("add_rms_norm_", &add_rms_norm_, "h += residual, then RMSNorm of h's rows");
  m.def("rope", &rope, "rotate-half rotary embedding of q and k");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
