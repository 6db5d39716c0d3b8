// Per-token layer ops for CPU, bf16 or float32, each one pass over memory where torch takes
// several ops (each a full pass and an OpenMP fork/join; bf16 ones also convert to float32 and
// back):
//   rms_norm:     HF's RMSNorm of each row;
//   silu_and_mul: SwiGLU's silu(gate) * up over the fused gate_up output [rows, 2F] -> [rows, F];
//   rotary_:      neox RoPE in place on q and k heads side by side, from the cos/sin tables.
// Rounded where HF's bf16 code rounds: x * rsqrt(mean(x^2) + eps) is rounded to the model dtype
// before the weight multiply; silu(gate) is rounded before the multiply by up.
#include "cpu_common.h"

#include <tuple>

namespace kvflow {
namespace {

using bVec = at::vec::Vectorized<c10::BFloat16>;
constexpr int64_t kPair = 2 * fVec::size();     // elements moved per load2/store2

inline std::tuple<fVec, fVec> load2(const float* p) {
  return {fVec::loadu(p), fVec::loadu(p + fVec::size())};
}
inline std::tuple<fVec, fVec> load2(const c10::BFloat16* p) {
  return at::vec::convert_to_float<c10::BFloat16>(bVec::loadu(p));
}
inline void store2(float* p, fVec a, fVec b) {
  a.store(p);
  b.store(p + fVec::size());
}
inline void store2(c10::BFloat16* p, fVec a, fVec b) {
  at::vec::convert_from_float<c10::BFloat16>(a, b).store(p);
}
// Round to T's precision and back (a no-op for float).
inline void round2(const float*, fVec&, fVec&) {}
inline void round2(const c10::BFloat16*, fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_to_float<c10::BFloat16>(
      at::vec::convert_from_float<c10::BFloat16>(a, b));
}
template <typename T>
inline float round_to(float x) { return to_float(T(x)); }

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), D = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t Dv = D - D % kPair;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * xs;
      T* o = op + r * D;
      fVec acc(0.f);
      for (int64_t d = 0; d < Dv; d += kPair) {
        auto [a, b] = load2(row + d);
        acc = at::vec::fmadd(a, a, at::vec::fmadd(b, b, acc));
      }
      float ss = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc);
      for (int64_t d = Dv; d < D; ++d) ss += to_float(row[d]) * to_float(row[d]);
      const float inv = 1.f / std::sqrt(ss / float(D) + eps);
      const fVec vinv(inv);
      for (int64_t d = 0; d < Dv; d += kPair) {
        auto [a, b] = load2(row + d);
        auto [wa, wb] = load2(wp + d);
        a = a * vinv;
        b = b * vinv;
        round2(row, a, b);
        store2(o + d, wa * a, wb * b);
      }
      for (int64_t d = Dv; d < D; ++d)
        o[d] = T(to_float(wp[d]) * round_to<T>(to_float(row[d]) * inv));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), F = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t Fv = F - F % kPair;
  const fVec one(1.f);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + F;
      T* o = op + r * F;
      for (int64_t i = 0; i < Fv; i += kPair) {
        auto [g0, g1] = load2(gate + i);
        auto [u0, u1] = load2(up + i);
        // exp overflow for very negative gates gives g / inf = -0, as torch's silu does.
        fVec s0 = g0 / (one + g0.neg().exp_u20()), s1 = g1 / (one + g1.neg().exp_u20());
        round2(gate, s0, s1);
        store2(o + i, s0 * u0, s1 * u1);
      }
      for (int64_t i = Fv; i < F; ++i) {
        const float g = to_float(gate[i]);
        o[i] = T(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[i]));
      }
    }
  });
}

// x: [T, heads, D] (any strides but the last); tables: [max_len, D], sin with the sign of
// rotate_half folded in (layers.py). out = x * cos + roll(x, D/2) * sin, rounded once.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_t,
                 const at::Tensor& sin_t) {
  const int64_t n = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cp = cos_t.data_ptr<T>();
  const T* sp = sin_t.data_ptr<T>();
  const bool vec = half % kPair == 0;
  at::parallel_for(0, n, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cp + pos[t] * D;
      const T* s = sp + pos[t] * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * s0 + h * s1;
        if (vec) {
          for (int64_t i = 0; i < half; i += kPair) {
            auto [x1a, x1b] = load2(v + i);
            auto [x2a, x2b] = load2(v + half + i);
            auto [c1a, c1b] = load2(c + i);
            auto [c2a, c2b] = load2(c + half + i);
            auto [s1a, s1b] = load2(s + i);
            auto [s2a, s2b] = load2(s + half + i);
            store2(v + i, at::vec::fmadd(x1a, c1a, x2a * s1a), at::vec::fmadd(x1b, c1b, x2b * s1b));
            store2(v + half + i, at::vec::fmadd(x2a, c2a, x1a * s2a),
                   at::vec::fmadd(x2b, c2b, x1b * s2b));
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float(v[i]), x2 = to_float(v[half + i]);
            v[i] = T(x1 * to_float(c[i]) + x2 * to_float(s[i]));
            v[half + i] = T(x2 * to_float(c[half + i]) + x1 * to_float(s[half + i]));
          }
        }
      }
    }
  });
}

// Greedy sampling: the first index of each row's maximum, as torch.max(dim=-1).indices (a NaN
// wins: the first NaN), in one pass: per-lane maxima and their indices, then across the lanes.
template <typename T>
void argmax_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t N = x.size(0), V = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xp + r * xs;
      float best = -INFINITY;
      int64_t bi = 0, v = 0;
#if defined(__AVX512F__)
      __m512 bv = _mm512_set1_ps(-INFINITY);
      __m512i bidx = _mm512_setzero_si512();
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __mmask16 nans = 0;
      for (; v + 16 <= V; v += 16) {
        const __m512 a = load16(row + v);
        const __mmask16 gt = _mm512_cmp_ps_mask(a, bv, _CMP_GT_OQ);
        nans |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        bv = _mm512_mask_mov_ps(bv, gt, a);
        bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
      }
      alignas(64) float vals[16];
      alignas(64) int32_t ids[16];
      _mm512_store_ps(vals, bv);
      _mm512_store_si512(ids, bidx);
      for (int l = 0; l < 16; ++l)
        if (vals[l] > best || (vals[l] == best && ids[l] < bi)) best = vals[l], bi = ids[l];
      if (nans) v = 0, best = INFINITY;   // a NaN came first: rescan, only NaN can win now
#endif
      for (; v < V; ++v) {
        const float f = to_float(row[v]);
        if (f != f) {
          bi = v;
          break;
        }
        if (f > best) best = f, bi = v;
      }
      op[r] = bi;
    }
  });
}

#define KVFLOW_DISPATCH(dtype, name, ...)                                              \
  if ((dtype) == at::kBFloat16) {                                                      \
    using scalar_t = c10::BFloat16;                                                    \
    __VA_ARGS__;                                                                       \
  } else if ((dtype) == at::kFloat) {                                                  \
    using scalar_t = float;                                                            \
    __VA_ARGS__;                                                                       \
  } else {                                                                             \
    TORCH_CHECK(false, name " supports bfloat16 and float32, got ", dtype);           \
  }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, dim], unit stride");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: bad weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  auto out = at::empty(x.sizes(), x.options());
  KVFLOW_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(x, weight, out, float(eps)));
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2 * F], unit stride");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  KVFLOW_DISPATCH(x.scalar_type(), "silu_and_mul", silu_and_mul_impl<scalar_t>(x, out));
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be a non-empty [rows, V] tensor with unit stride in V");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  KVFLOW_DISPATCH(x.scalar_type(), "argmax_rows", argmax_impl<scalar_t>(x, out));
  return out;
}

void rotary_(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos_t,
             const at::Tensor& sin_t) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be [tokens, heads, head_dim], unit stride, even head_dim");
  TORCH_CHECK(cos_t.is_contiguous() && sin_t.is_contiguous() && cos_t.dim() == 2 &&
                  cos_t.size(1) == x.size(2) && sin_t.sizes() == cos_t.sizes(),
              "rotary_: cos/sin tables must be contiguous [max_len, head_dim]");
  TORCH_CHECK(cos_t.scalar_type() == x.scalar_type() && sin_t.scalar_type() == x.scalar_type(),
              "rotary_: tables and x dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "rotary_: positions must be int64, one per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)     // a plain loop: no tensor ops per layer
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_t.size(0), "rotary_: position ", pos[i],
                " is outside the table of ", cos_t.size(0));
  KVFLOW_DISPATCH(x.scalar_type(), "rotary_", rotary_impl<scalar_t>(x, positions, cos_t, sin_t));
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("rms_norm", kvflow::rms_norm);
  m.impl("silu_and_mul", kvflow::silu_and_mul);
  m.impl("argmax_rows", kvflow::argmax_rows);
  m.impl("rotary_", kvflow::rotary_);
}
