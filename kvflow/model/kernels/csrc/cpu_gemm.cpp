// skinny_linear: y[T, O] = x[T, I] @ W[O, I]^T (+ bias) (+ residual) in float32 for a few rows of
// x (speculative verification: 2-16 tokens). MKL's GEMM costs 2-3x its one-row time at these
// shapes; here W streams from memory once and each block of R weight rows, while in L1, is
// multiplied by every row of x in register tiles of R rows x up to MT tokens.
#include "cpu_common.h"

namespace kvflow {
namespace {

constexpr int64_t V = fVec::size();

struct Gemm {
  const float* x;
  int64_t xs;                   // x's row stride
  const float* w;
  int64_t ws;                   // W's row stride
  const float* bias;            // nullable, [O]
  const float* res;             // nullable, [T, O] with row stride rs
  int64_t rs;
  float* y;                     // [T, O], contiguous
  int64_t I, O;
};

// Weight rows o .. o+R-1 times tokens t .. t+TT-1, written (with bias and residual) to y.
template <int R, int TT>
void tile(const Gemm& g, int64_t o, int64_t t) {
  const float* w = g.w + o * g.ws;
  const float* x = g.x + t * g.xs;
  const int64_t Iv = g.I - g.I % V;
  fVec acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) acc[r][j] = fVec(0.f);
  for (int64_t i = 0; i < Iv; i += V) {
    fVec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = fVec::loadu(w + r * g.ws + i);
    for (int j = 0; j < TT; ++j) {
      const fVec xv = fVec::loadu(x + j * g.xs + i);
      for (int r = 0; r < R; ++r) acc[r][j] = at::vec::fmadd(wv[r], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < TT; ++j) {
      float s = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, acc[r][j]);
      for (int64_t i = Iv; i < g.I; ++i) s += w[r * g.ws + i] * x[j * g.xs + i];
      if (g.bias) s += g.bias[o + r];
      if (g.res) s += g.res[(t + j) * g.rs + o + r];
      g.y[(t + j) * g.O + o + r] = s;
    }
  }
}

template <int R>
void tile_tokens(const Gemm& g, int64_t o, int64_t t, int64_t n) {
  switch (n) {
    case 1: return tile<R, 1>(g, o, t);
    case 2: return tile<R, 2>(g, o, t);
    case 3: return tile<R, 3>(g, o, t);
    case 4: return tile<R, 4>(g, o, t);
    case 5: return tile<R, 5>(g, o, t);
    default: return tile<R, 6>(g, o, t);
  }
}

// All T tokens for weight rows o .. o+R-1, in near-equal token tiles (7 -> 4+3).
template <int R, int MT>
void row_block(const Gemm& g, int64_t o, int64_t T) {
  const int64_t tiles = (T + MT - 1) / MT;
  for (int64_t k = 0, t = 0; k < tiles; ++k) {
    const int64_t n = (T - t) / (tiles - k);
    tile_tokens<R>(g, o, t, n);
    t += n;
  }
}

template <int R, int MT>
void run(const Gemm& g, int64_t T) {
  const int64_t blocks = g.O / R;
  // Chunks of >= 32 weight rows keep the fork/join cost small next to the rows' load time.
  at::parallel_for(0, blocks, 32 / R + 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) row_block<R, MT>(g, b * R, T);
  });
  for (int64_t o = blocks * R; o < g.O; ++o) row_block<1, MT>(g, o, T);
}

// R x MT accumulators + R weight vectors + 1 x vector must fit AVX2's 16 registers. 5 or 6
// tokens run as one 2x6 tile rather than two passes of 3x3 (measured faster on AVX2).
void skinny_impl(const Gemm& g, int64_t T) {
  if (T == 5 || T == 6)
    run<2, 6>(g, T);
  else
    run<3, 4>(g, T);
}

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2, "skinny_linear: x must be [T, I] and weight [O, I]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "skinny_linear: x and weight must be float32, got ", x_in.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(x_in.size(1) == w.size(1), "skinny_linear: x has ", x_in.size(1),
              " features, weight expects ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1, "skinny_linear: weight must have unit stride along I");
  const int64_t T = x_in.size(0), O = w.size(0);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  Gemm g{x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0),
         nullptr, nullptr, 0, nullptr, w.size(1), O};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == O &&
                    bias->is_contiguous(), "skinny_linear: bias must be contiguous float32 [O]");
    g.bias = bias->data_ptr<float>();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 &&
                    residual->size(0) == T && residual->size(1) == O && residual->stride(1) == 1,
                "skinny_linear: residual must be float32 [T, O] with unit stride along O");
    g.res = residual->data_ptr<float>();
    g.rs = residual->stride(0);
  }
  auto y = at::empty({T, O}, x.options());
  g.y = y.data_ptr<float>();
  if (T > 0 && O > 0) skinny_impl(g, T);
  return y;
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("skinny_linear", kvflow::skinny_linear); }
