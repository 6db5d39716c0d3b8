// bf16w_linear: y[T, O] = x[T, I] @ W[O, I]^T (+ bias) (+ residual) with W kept in bf16, for CPUs
// without bf16 arithmetic (AVX2). A bf16 -> float32 widening is a 16-bit shift, exact, so the
// products equal a float32 model's while the weights cost half the bytes to stream per token.
// Sums are float32 and the result is rounded once to x's dtype (as oneDNN's bf16 kernel does).
//   Few rows (decode): skinny_linear's register tiles (cpu_gemm.cpp), the weights widened in
//     registers as they are loaded.
//   Many rows (prefill): each thread widens a block of weight rows into a float32 buffer and runs
//     the float32 GEMM against it, so prefill stays at float32 GEMM speed.
// The AVX2 tiles are compiled with a target attribute and picked at run time, so the same build
// runs on any x86 CPU; bf16w_set_isa forces the portable fallback for tests.
#include "cpu_common.h"

#include <atomic>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVFLOW_X86 1
#define KVFLOW_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace kvflow {
namespace {

enum Isa : int { kAuto = 0, kScalar = 1, kAvx2 = 2 };
std::atomic<int> g_isa{kAuto};

// From this many rows of x on, widening a block into a buffer and using the float32 GEMM beats
// the register tiles (they re-widen the weights for each tile of 4-6 tokens); measured on AVX2
// (Zen 3, 2 threads), the tiles won at 16 and 24 rows, the buffered GEMM at 32 and 48.
constexpr int64_t kWideMinRows = 32;

struct Bf16Gemm {
  const float* x;
  int64_t xs;                   // x's row stride
  const uint16_t* w;            // bf16 bits
  int64_t ws;                   // W's row stride
  const float* bias;            // nullable, [O], float32
  const void* res;              // nullable, [T, O] in the output dtype, row stride rs
  int64_t rs;
  void* y;                      // [T, O], contiguous, float32 or bf16
  bool bf16_out;                // y and res are bf16
  int64_t I, O;
};

inline float widen(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Adds bias and residual to one float32 sum and stores it, rounded once where y is bf16.
inline void finish(const Bf16Gemm& g, int64_t t, int64_t o, float s) {
  if (g.bias) s += g.bias[o];
  if (g.bf16_out) {
    if (g.res) s += widen(static_cast<const uint16_t*>(g.res)[t * g.rs + o]);
    static_cast<c10::BFloat16*>(g.y)[t * g.O + o] = c10::BFloat16(s);
  } else {
    if (g.res) s += static_cast<const float*>(g.res)[t * g.rs + o];
    static_cast<float*>(g.y)[t * g.O + o] = s;
  }
}

// ---- portable fallback: one weight row against every token, 8 partial sums (vectorisable) ----
void rows_scalar(const Bf16Gemm& g, int64_t o0, int64_t o1, int64_t T) {
  for (int64_t o = o0; o < o1; ++o) {
    const uint16_t* w = g.w + o * g.ws;
    for (int64_t t = 0; t < T; ++t) {
      const float* x = g.x + t * g.xs;
      float acc[8] = {};
      int64_t i = 0;
      for (; i + 8 <= g.I; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += widen(w[i + k]) * x[i + k];
      float s = 0.f;
      for (int k = 0; k < 8; ++k) s += acc[k];
      for (; i < g.I; ++i) s += widen(w[i]) * x[i];
      finish(g, t, o, s);
    }
  }
}

#ifdef KVFLOW_X86
// 8 bf16 -> 8 float32: zero-extend to 32 bits, shift into the high half.
KVFLOW_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KVFLOW_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Weight rows o .. o+R-1 times tokens t .. t+TT-1 (cpu_gemm.cpp's tile, weights widened here).
template <int R, int TT>
KVFLOW_AVX2 void tile_avx2(const Bf16Gemm& g, int64_t o, int64_t t) {
  const uint16_t* w = g.w + o * g.ws;
  const float* x = g.x + t * g.xs;
  const int64_t Iv = g.I - g.I % 8;
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < Iv; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * g.ws + i);
    for (int j = 0; j < TT; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * g.xs + i);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t i = Iv; i < g.I; ++i) s += widen(w[r * g.ws + i]) * x[j * g.xs + i];
      finish(g, t + j, o + r, s);
    }
}

template <int R>
KVFLOW_AVX2 void tile_tokens(const Bf16Gemm& g, int64_t o, int64_t t, int64_t n) {
  switch (n) {
    case 1: return tile_avx2<R, 1>(g, o, t);
    case 2: return tile_avx2<R, 2>(g, o, t);
    case 3: return tile_avx2<R, 3>(g, o, t);
    case 4: return tile_avx2<R, 4>(g, o, t);
    case 5: return tile_avx2<R, 5>(g, o, t);
    default: return tile_avx2<R, 6>(g, o, t);
  }
}

// All T tokens for weight rows o .. o+R-1, in near-equal token tiles (7 -> 4+3).
template <int R, int MT>
KVFLOW_AVX2 void row_block(const Bf16Gemm& g, int64_t o, int64_t T) {
  const int64_t tiles = (T + MT - 1) / MT;
  for (int64_t k = 0, t = 0; k < tiles; ++k) {
    const int64_t n = (T - t) / (tiles - k);
    tile_tokens<R>(g, o, t, n);
    t += n;
  }
}

// Rows o0 .. o1-1 (a multiple of R apart, except the last chunk's tail).
template <int R, int MT>
KVFLOW_AVX2 void rows_avx2(const Bf16Gemm& g, int64_t o0, int64_t o1, int64_t T) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) row_block<R, MT>(g, o, T);
  for (; o < o1; ++o) row_block<1, MT>(g, o, T);
}

// R x MT accumulators + R weight vectors + 1 x vector fit AVX2's 16 registers (as skinny_linear).
KVFLOW_AVX2 void rows_avx2_any(const Bf16Gemm& g, int64_t o0, int64_t o1, int64_t T) {
  if (T == 5 || T == 6)
    rows_avx2<2, 6>(g, o0, o1, T);
  else
    rows_avx2<3, 4>(g, o0, o1, T);
}

bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
bool cpu_has_avx2() { return false; }
#endif

int effective_isa() {
  const int isa = g_isa.load(std::memory_order_relaxed);
  if (isa != kAuto) return isa;
  return cpu_has_avx2() ? kAvx2 : kScalar;
}

// Few rows: weight rows split across threads; each chunk of rows streams from memory once.
void small_rows(const Bf16Gemm& g, int64_t T) {
  const bool avx2 = effective_isa() == kAvx2;
  // Chunks of 48 weight rows (a multiple of 2 and 3); a thread takes at least 4 MB of weights.
  // On the shared 2-core AVX2 VM (load ~5) waking a second thread cost ~1 ms, more than
  // streaming a small matrix alone: decode of the bench model ran 15 tok/s with 1 MB tasks, 22
  // with 4 MB, 27 never forking (old path 22). Matrices of real models (>= 4 MB) still split.
  constexpr int64_t kMinTaskBytes = 4 << 20;
  const int64_t chunk = 48, chunks = (g.O + chunk - 1) / chunk;
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / (chunk * g.I * 2));
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    const int64_t o0 = c0 * chunk, o1 = std::min(g.O, c1 * chunk);
#ifdef KVFLOW_X86
    if (avx2) return rows_avx2_any(g, o0, o1, T);
#endif
    rows_scalar(g, o0, o1, T);
  });
}

// Many rows: per block of weight rows, widen into a thread-local float32 buffer (the compiler
// vectorises the shift loop), one float32 GEMM, then bias/residual/rounding per output row.
void wide_rows(const Bf16Gemm& g, const at::Tensor& x32, int64_t T) {
  // ~1 MB of widened weights per block, 64-256 rows: with 32-row blocks (I = 2048) the GEMMs
  // were too narrow and ran 10-20% slower than float32; from 64 rows on, within ~5-10%.
  const int64_t nb_max = std::clamp<int64_t>((262144 / std::max<int64_t>(g.I, 1)) / 8 * 8, 64, 256);
  // A multiple of the thread count of equal blocks: 768 rows as 256 + 256 | 256 left one thread
  // idle a third of the time (25-30% slower than float32 at 2 threads).
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = threads * ((g.O + nb_max * threads - 1) / (nb_max * threads));
  const int64_t nb = ((g.O + blocks - 1) / blocks + 7) / 8 * 8;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> wbuf(nb * g.I), ybuf(T * nb);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * nb, n = std::min(nb, g.O - o0);
      if (n <= 0) break;        // rounding nb up to 8 rows can leave the last blocks empty
      for (int64_t r = 0; r < n; ++r) {
        const uint16_t* src = g.w + (o0 + r) * g.ws;
        uint32_t* dst = reinterpret_cast<uint32_t*>(wbuf.data() + r * g.I);
        for (int64_t i = 0; i < g.I; ++i) dst[i] = uint32_t(src[i]) << 16;
      }
      at::Tensor wt = at::from_blob(wbuf.data(), {n, g.I}, at::kFloat);
      at::Tensor yt = at::from_blob(ybuf.data(), {T, n}, at::kFloat);
      at::mm_out(yt, x32, wt.t());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < n; ++r) finish(g, t, o0 + r, ybuf[t * n + r]);
    }
  });
}

void check_args(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16w_linear: x must be [T, I] and weight [O, I]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "bf16w_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "bf16w_linear: weight must be bfloat16, got ",
              w.scalar_type());
  TORCH_CHECK(x.size(1) == w.size(1), "bf16w_linear: x has ", x.size(1),
              " features, weight expects ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1, "bf16w_linear: weight must have unit stride along I");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0),
                "bf16w_linear: bias must be [O]");
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 &&
                    residual->size(0) == x.size(0) && residual->size(1) == w.size(0) &&
                    residual->stride(1) == 1,
                "bf16w_linear: residual must be [T, O] in x's dtype with unit stride along O");
}

at::Tensor bf16w_linear(const at::Tensor& x_in, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  check_args(x_in, w, bias, residual);
  const int64_t T = x_in.size(0), O = w.size(0);
  // x is small next to W: one float32 copy of it (exact for bf16) lets every path read floats.
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  // Usually already float32 (layers.py widens bf16 biases at load); a bf16 one widens exactly.
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  auto y = at::empty({T, O}, x_in.options());
  Bf16Gemm g{x.data_ptr<float>(), x.stride(0),
             reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), w.stride(0),
             b.defined() ? b.data_ptr<float>() : nullptr,
             residual.has_value() ? residual->data_ptr() : nullptr,
             residual.has_value() ? residual->stride(0) : 0,
             y.data_ptr(), x_in.scalar_type() == at::kBFloat16, w.size(1), O};
  if (T == 0 || O == 0) return y;
  if (T >= kWideMinRows)
    wide_rows(g, x, T);
  else
    small_rows(g, T);
  return y;
}

std::string isa_name(int isa) { return isa == kAvx2 ? "avx2" : "scalar"; }

// "auto" | "scalar" | "avx2": which small-row kernel bf16w_linear uses; returns the one in effect.
std::string bf16w_set_isa(std::string isa) {
  if (isa == "auto") {
    g_isa = kAuto;
  } else if (isa == "scalar") {
    g_isa = kScalar;
  } else if (isa == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "bf16w_set_isa: this CPU lacks AVX2/FMA");
    g_isa = kAvx2;
  } else {
    TORCH_CHECK(false, "bf16w_set_isa: expected auto, scalar or avx2, got '", isa, "'");
  }
  return isa_name(effective_isa());
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("bf16w_linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  // No tensor argument to dispatch on: a catch-all kernel.
  m.def("bf16w_set_isa(str isa) -> str", &kvflow::bf16w_set_isa);
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("bf16w_linear", kvflow::bf16w_linear); }
