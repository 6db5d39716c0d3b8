// quant_linear: y[T, O] = x[T, I] @ W[O, I]^T (+ bias) (+ residual) straight from GGUF-quantized
// weight blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) or kvflow's int8 per-row weights (KVFLOW_I8_PC),
// without a float32 copy of W: a decode step reads the blocks (~4.5-8.5 bits a weight) instead
// of 32-bit floats, which is what bounds a CPU decode step.
//
// Few tokens (decode, T <= kSmallT): the activations are quantized once per call to 16-bit blocks
// of 32 and every 32-element sub-block of a weight row is an integer dot product (llama.cpp's
// scheme, with 16-bit activations where it uses 8): sum_i w_i x_i = dw * dx * sum(qw * qx) +
// mw * dx * sum(qx). Weight rows are register
// tiled R rows x TT tokens so a block is unpacked once for all the tokens of the tile.
// 13..24 tokens (AVX2, the 32-block formats): the same integer dots with 8 tokens in the vector
// lanes (run_lanes), so each block scale is applied to 8 tokens in one multiply.
// Many tokens (prefill): tiles of weight rows are dequantized into a cache-sized float32 buffer
// and multiplied with BLAS, so batches run at float-GEMM speed with no full float32 W. Its
// activations are rounded as the few-token path's are (round_like_small_t).
//
// ISAs, picked at run time (quant_set_isa / KVFLOW_CPU_QUANT_ISA): "avx2" (AVX2 + FMA + F16C,
// compiled with target attributes so the .so stays correct on any x86-64 whatever -march says)
// and "scalar" (portable C++). There is deliberately no AVX-512/VNNI path: it could not be
// tested on the machines this was written on, and the AVX2 path runs on AVX-512 CPUs too.
#include "cpu_common.h"

#include <immintrin.h>

#include <atomic>
#include <string>

#define KVF_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvflow {
namespace {

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kI8PC = 1000 };

// Up to this many tokens the integer-dot path wins; above, dequantized tiles + BLAS do (one
// thread, AVX2 EPYC, the default model's shapes: even at T=12, tiles ahead from T=16 on).
constexpr int64_t kSmallT = 12;
// Measured again with the 3-instruction int16 weight loads (2 threads, T = 8..24, whole model):
// the integer path wins up to ~12, ties at 16, and the tiles win from 24 on.

// The few-token path prefetches this many bytes ahead of the block it reads in each weight row
// (a thread's rows are contiguous, so this runs ahead in its stream): the LM head (30 MB, from
// DRAM) went from ~3.0 to ~1.6 ms at T=1 on 2 threads (768 bytes: ~2.1, 4096: ~1.9-2.4 ms).
constexpr int64_t kPrefetchBytes = 1536;
// kSmallT < T <= kLanesMaxT, AVX2, 32-block formats: the token-lanes integer path (run_lanes).
// One thread, the whole model over distinct layers (benchmarks/quant_gemv.py --walk): T=16
// ~4.2 ms/token vs the tiles' ~5.7, T=32 even (~4.5), and its cost per token stays flat while
// the tiles' falls with T, so the tiles take over above 24.
constexpr int64_t kLanesMaxT = 24;

// ---- ISA selection ---------------------------------------------------------------------------
enum Isa : int { kScalar = 0, kAvx2 = 1 };

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<int>& isa_state() {
  static std::atomic<int> isa{cpu_has_avx2() ? kAvx2 : kScalar};
  return isa;
}

void quant_set_isa(std::string isa) {
  if (isa == "auto") {
    isa_state() = cpu_has_avx2() ? kAvx2 : kScalar;
  } else if (isa == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "quant_set_isa: this CPU lacks AVX2/FMA/F16C");
    isa_state() = kAvx2;
  } else if (isa == "scalar") {
    isa_state() = kScalar;
  } else {
    TORCH_CHECK(false, "quant_set_isa: unknown ISA '", isa, "' (auto, avx2 or scalar)");
  }
}

std::string quant_isa() { return isa_state() == kAvx2 ? "avx2" : "scalar"; }

// ---- activations: 16-bit blocks of 32 --------------------------------------------------------
// 16 bits, not llama.cpp's 8: the products stay integer (madd_epi16) at ~1.3x the instructions of
// 8-bit maddubs, and the activations' rounding error drops from ~0.4% to ~2e-5 of a block's
// largest value, so the model is the float32-dequantized one for all practical purposes (8-bit
// activations changed the default model's greedy answers).
constexpr float kQMax = 32767.f;
struct QX {
  float d;          // scale: x ~= d * q
  float s;          // d * sum(q), for the weight formats with an additive term
  int16_t q[32];
};

// One row of x (I % 32 == 0) into I / 32 blocks. Portable code: it is O(T * I), next to the
// O(T * I * O) products, so no hand-written SIMD (the compiler vectorises it anyway).
void quantize_row(const float* x, int64_t I, QX* out) {
  for (int64_t b = 0; b < I / 32; ++b) {
    const float* v = x + b * 32;
    float amax = 0.f;
    for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(v[l]));
    const float d = amax / kQMax;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(std::nearbyint(v[l] * id));
      out[b].q[l] = static_cast<int16_t>(q);
      sum += q;
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
  }
}

// x with every 32-block rounded to the 16-bit values the few-token path multiplies (d * q), so
// both paths compute one function of x, up to float summation order: a token's output does not
// depend on how many tokens share its step (batch or alone, prefill chunk or decode).
at::Tensor round_like_small_t(const at::Tensor& x) {
  const int64_t T = x.size(0), I = x.size(1), nb = I / 32;
  at::Tensor out = at::empty({T, I}, x.options());
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    std::vector<QX> q(nb);
    for (int64_t t = a; t < b; ++t) {
      quantize_row(x.data_ptr<float>() + t * x.stride(0), I, q.data());
      float* o = out.data_ptr<float>() + t * I;
      for (int64_t k = 0; k < nb; ++k)
        for (int l = 0; l < 32; ++l) o[k * 32 + l] = q[k].d * static_cast<float>(q[k].q[l]);
    }
  });
  return out;
}

// ---- fp16 scales -----------------------------------------------------------------------------
inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
struct CvtScalar {
  static float f(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
};
struct CvtF16C {
  KVF_AVX2 static float f(uint16_t h) { return _cvtsh_ss(h); }
};

// A sub-block's 32 small integer weights widened to int16 (elements 0..15, 16..31), times the
// Q6_K per-16 scales (|q * s| <= 4096 fits int16).
struct W16 { __m256i lo, hi; };
// Straight from the bytes, for the 32-blocks: 16 nibble bytes (low nibbles elements 0..15,
// high 16..31) zero-extended to int16 once, then masked and shifted (3 instructions, not 7);
// 32 int8 as two sign-extending loads.
KVF_AVX2 inline W16 w16_nibbles(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_and_si256(v, _mm256_set1_epi16(15)), _mm256_srli_epi16(v, 4)};
}
KVF_AVX2 inline W16 w16_int8(const uint8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}

// ---- weight formats --------------------------------------------------------------------------
// Each format describes its row as blocks of QK elements (BYTES bytes), each NSUB sub-blocks of
// 32 elements; sub-block k's weights are w = dw * s16 * q + mw with q the 32 small integers
// (int8: unsigned nibbles or signed values, per SIGNED) and s16 an integer scale per 16 elements
// (Q6_K only, SC16). head() decodes a block's header once for all of its sub-blocks; the AVX2
// path takes [dw, mw, 0, 0] from dm_avx(), which for the 32-blocks reads the fp16s directly.
// Q4_0's mw = -8 * dw folds its zero point into the dot; dequantize() subtracts ZERO from q
// instead (d * (q - 8), as gguf does, down to the sign of a zero).
// dequantize() computes exactly gguf's float32 values from the same pieces: the products dw*s16
// and dw*q are exact in float32 for the 4-bit formats, so one rounding happens where gguf's does.

struct FQ4_0 {
  static constexpr int QK = 32, BYTES = 18, NSUB = 1;
  static constexpr bool SIGNED = false, MIN = true, SC16 = false;
  static constexpr int ZERO = 8;
  struct H { const uint8_t* p; float d; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    const uint8_t* p = row + b * BYTES;
    return {p, C::f(rd16(p))};
  }
  static void scales(const H& h, int, float& dw, float& mw) { dw = h.d; mw = -8.f * h.d; }
  static void sc16(const H&, int, int& s0, int& s1) { s0 = s1 = 1; }
  // Low nibbles are elements 0..15, high nibbles 16..31.
  static void ints(const H& h, int, int8_t* q) {
    for (int l = 0; l < 16; ++l) {
      q[l] = h.p[2 + l] & 15;
      q[l + 16] = h.p[2 + l] >> 4;
    }
  }
  KVF_AVX2 static __m256i ints_avx(const H& h, int) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.p + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
  }
  KVF_AVX2 static W16 w16_avx(const H& h, int) { return w16_nibbles(h.p + 2); }
  KVF_AVX2 static __m128 dm_avx(const H& h, int) {
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(rd16(h.p)));
    return _mm_mul_ps(_mm_permute_ps(d, 0), _mm_setr_ps(1.f, -8.f, 0.f, 0.f));
  }
};

struct FQ4_1 {
  static constexpr int QK = 32, BYTES = 20, NSUB = 1;
  static constexpr bool SIGNED = false, MIN = true, SC16 = false;
  static constexpr int ZERO = 0;
  struct H { const uint8_t* p; float d, m; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    const uint8_t* p = row + b * BYTES;
    return {p, C::f(rd16(p)), C::f(rd16(p + 2))};
  }
  static void scales(const H& h, int, float& dw, float& mw) { dw = h.d; mw = h.m; }
  static void sc16(const H&, int, int& s0, int& s1) { s0 = s1 = 1; }
  static void ints(const H& h, int, int8_t* q) {
    for (int l = 0; l < 16; ++l) {
      q[l] = h.p[4 + l] & 15;
      q[l + 16] = h.p[4 + l] >> 4;
    }
  }
  KVF_AVX2 static __m256i ints_avx(const H& h, int) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.p + 4));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
  }
  KVF_AVX2 static W16 w16_avx(const H& h, int) { return w16_nibbles(h.p + 4); }
  // d and m are adjacent fp16s: one conversion gives [d, m, 0, 0].
  KVF_AVX2 static __m128 dm_avx(const H& h, int) {
    int32_t dm;
    std::memcpy(&dm, h.p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
  }
};

struct FQ8_0 {
  static constexpr int QK = 32, BYTES = 34, NSUB = 1;
  static constexpr bool SIGNED = true, MIN = false, SC16 = false;
  static constexpr int ZERO = 0;
  struct H { const uint8_t* p; float d; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    const uint8_t* p = row + b * BYTES;
    return {p, C::f(rd16(p))};
  }
  static void scales(const H& h, int, float& dw, float& mw) { dw = h.d; mw = 0.f; }
  static void sc16(const H&, int, int& s0, int& s1) { s0 = s1 = 1; }
  static void ints(const H& h, int, int8_t* q) { std::memcpy(q, h.p + 2, 32); }
  KVF_AVX2 static __m256i ints_avx(const H& h, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.p + 2));
  }
  KVF_AVX2 static W16 w16_avx(const H& h, int) { return w16_int8(h.p + 2); }
  KVF_AVX2 static __m128 dm_avx(const H& h, int) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128(rd16(h.p)));
  }
};

// kvflow's own int8 weight-only format: a row is its float32 scale then I int8 values; seen as
// "blocks" of 32 that share the row's scale.
struct FI8PC {
  static constexpr int QK = 32, BYTES = 32, NSUB = 1;
  static constexpr bool SIGNED = true, MIN = false, SC16 = false;
  static constexpr int ZERO = 0;
  struct H { const uint8_t* p; float d; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    float d;
    std::memcpy(&d, row, 4);
    return {row + 4 + b * BYTES, d};
  }
  static void scales(const H& h, int, float& dw, float& mw) { dw = h.d; mw = 0.f; }
  static void sc16(const H&, int, int& s0, int& s1) { s0 = s1 = 1; }
  static void ints(const H& h, int, int8_t* q) { std::memcpy(q, h.p, 32); }
  KVF_AVX2 static __m256i ints_avx(const H& h, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.p));
  }
  KVF_AVX2 static W16 w16_avx(const H& h, int) { return w16_int8(h.p); }
  KVF_AVX2 static __m128 dm_avx(const H& h, int k) {
    float dw, mw;
    scales(h, k, dw, mw);
    return _mm_setr_ps(dw, mw, 0.f, 0.f);
  }
};

// Q4_K: 256-element super-blocks: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8
// sub-blocks of 32, then 128 bytes of nibbles (sub-block 2j: low nibbles of bytes 32j..32j+31,
// 2j+1: their high nibbles). w = d*sc*q - dmin*m.
struct FQ4_K {
  static constexpr int QK = 256, BYTES = 144, NSUB = 8;
  static constexpr bool SIGNED = false, MIN = true, SC16 = false;
  static constexpr int ZERO = 0;
  struct H { const uint8_t* p; float d, dmin; uint8_t sc[8], mn[8]; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    H h;
    h.p = row + b * BYTES;
    h.d = C::f(rd16(h.p));
    h.dmin = C::f(rd16(h.p + 2));
    const uint8_t* s = h.p + 4;
    for (int j = 0; j < 4; ++j) {
      h.sc[j] = s[j] & 63;
      h.mn[j] = s[j + 4] & 63;
      h.sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
      h.mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    return h;
  }
  static void scales(const H& h, int k, float& dw, float& mw) {
    dw = h.d * static_cast<float>(h.sc[k]);
    mw = -(h.dmin * static_cast<float>(h.mn[k]));
  }
  static void sc16(const H&, int, int& s0, int& s1) { s0 = s1 = 1; }
  static void ints(const H& h, int k, int8_t* q) {
    const uint8_t* b = h.p + 16 + 32 * (k / 2);
    const int sh = 4 * (k & 1);
    for (int l = 0; l < 32; ++l) q[l] = (b[l] >> sh) & 15;
  }
  KVF_AVX2 static __m256i ints_avx(const H& h, int k) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.p + 16 + 32 * (k / 2)));
    const __m256i v = (k & 1) ? _mm256_srli_epi16(b, 4) : b;
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
  }
  KVF_AVX2 static __m128 dm_avx(const H& h, int k) {
    float dw, mw;
    scales(h, k, dw, mw);
    return _mm_setr_ps(dw, mw, 0.f, 0.f);
  }
};

// Q6_K: 256-element super-blocks: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
// scales (one per 16 elements), fp16 d. Element e of half h = e / 128, r = e % 128: low bits
// from ql[64h + r % 64] >> 4 * (r / 64), high bits from qh[32h + r % 32] >> 2 * (r / 32);
// w = d * scale[e / 16] * (q - 32).
struct FQ6_K {
  static constexpr int QK = 256, BYTES = 210, NSUB = 8;
  static constexpr bool SIGNED = true, MIN = false, SC16 = true;
  static constexpr int ZERO = 0;
  struct H { const uint8_t* p; float d; };
  template <class C> static H head(const uint8_t* row, int64_t b) {
    const uint8_t* p = row + b * BYTES;
    return {p, C::f(rd16(p + 208))};
  }
  static void scales(const H& h, int, float& dw, float& mw) { dw = h.d; mw = 0.f; }
  static void sc16(const H& h, int k, int& s0, int& s1) {
    s0 = static_cast<int8_t>(h.p[192 + 2 * k]);
    s1 = static_cast<int8_t>(h.p[193 + 2 * k]);
  }
  static void ints(const H& h, int k, int8_t* q) {
    const int half = k / 4, s = k % 4;
    const uint8_t* ql = h.p + 64 * half + 32 * (s & 1);
    const uint8_t* qh = h.p + 128 + 32 * half;
    for (int l = 0; l < 32; ++l)
      q[l] = static_cast<int8_t>((((ql[l] >> (4 * (s >> 1))) & 15) | (((qh[l] >> (2 * s)) & 3) << 4)) - 32);
  }
  KVF_AVX2 static __m256i ints_avx(const H& h, int k) {
    const int half = k / 4, s = k % 4;
    __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.p + 64 * half + 32 * (s & 1)));
    __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.p + 128 + 32 * half));
    lo = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (s >> 1))), _mm256_set1_epi8(15));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * s)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
  KVF_AVX2 static __m128 dm_avx(const H& h, int k) {
    float dw, mw;
    scales(h, k, dw, mw);
    return _mm_setr_ps(dw, mw, 0.f, 0.f);
  }
};

// ---- the job ---------------------------------------------------------------------------------
struct Job {
  const uint8_t* w;             // [O, ws] blocks
  int64_t ws;                   // bytes between weight rows
  const QX* xq;                 // [T, nbx] quantized activations
  int64_t nbx;                  // I / 32
  const float* bias;            // nullable, [O]
  const float* res;             // nullable, [T, O] with row stride rs
  int64_t rs;
  float* y;                     // [T, O], contiguous
  int64_t I, O;
  int64_t nt = 0;               // T (the lanes path)
};

inline void store(const Job& g, int64_t o, int64_t t, float s) {
  if (g.bias) s += g.bias[o];
  if (g.res) s += g.res[t * g.rs + o];
  g.y[t * g.O + o] = s;
}

// ---- scalar path -----------------------------------------------------------------------------
template <class F, int R, int TT>
void tile_scalar(const Job& g, int64_t o, int64_t t) {
  float acc[R][TT] = {}, macc[R][TT] = {};
  const int64_t nb = g.I / F::QK;
  for (int64_t b = 0; b < nb; ++b) {
    typename F::H h[R];
    for (int r = 0; r < R; ++r) h[r] = F::template head<CvtScalar>(g.w + (o + r) * g.ws, b);
    for (int k = 0; k < F::NSUB; ++k) {
      int8_t q[R][32];
      float dw[R], mw[R];
      int s0[R], s1[R];
      for (int r = 0; r < R; ++r) {
        F::ints(h[r], k, q[r]);
        F::scales(h[r], k, dw[r], mw[r]);
        F::sc16(h[r], k, s0[r], s1[r]);
      }
      for (int j = 0; j < TT; ++j) {
        const QX& a = g.xq[(t + j) * g.nbx + b * F::NSUB + k];
        for (int r = 0; r < R; ++r) {
          int64_t i = 0;    // |w * s16| <= 4096 and |x| <= 32767: 32 products overflow int32
          for (int l = 0; l < 16; ++l) i += q[r][l] * s0[r] * a.q[l];
          for (int l = 16; l < 32; ++l) i += q[r][l] * s1[r] * a.q[l];
          // Explicit fmas: GCC contracts a * b + c at will (-ffp-contract=fast), and differently
          // for each tile shape, which made a token's result depend on its batch.
          acc[r][j] = std::fma(dw[r] * a.d, static_cast<float>(i), acc[r][j]);
          if (F::MIN) macc[r][j] = std::fma(mw[r], a.s, macc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) store(g, o + r, t + j, acc[r][j] + macc[r][j]);
}

// ---- AVX2 path -------------------------------------------------------------------------------
KVF_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <class F>
KVF_AVX2 inline W16 widen(__m256i q, int s0, int s1) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  W16 w = F::SIGNED ? W16{_mm256_cvtepi8_epi16(a), _mm256_cvtepi8_epi16(b)}
                    : W16{_mm256_cvtepu8_epi16(a), _mm256_cvtepu8_epi16(b)};
  if (F::SC16) {
    w.lo = _mm256_mullo_epi16(w.lo, _mm256_set1_epi16(static_cast<int16_t>(s0)));
    w.hi = _mm256_mullo_epi16(w.hi, _mm256_set1_epi16(static_cast<int16_t>(s1)));
  }
  return w;
}

// Eight int32 partial sums of w * x over a 32-element sub-block: each lane adds 4 products of
// at most 4096 * 32767, well inside int32.
KVF_AVX2 inline __m256i dot32(const W16& w, const int16_t* x) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
}

template <class F, int R, int TT>
KVF_AVX2 void tile_avx2(const Job& g, int64_t o, int64_t t) {
  __m256 acc[R][TT];
  // Lane 1 accumulates mw * sx (lane 0 collects dw * dx, unused): the scales of a block are one
  // [dw, mw] x [dx, sx] multiply, no scalar fp16 conversions or scalar accumulator chains.
  __m128 macc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) acc[r][j] = _mm256_setzero_ps(), macc[r][j] = _mm_setzero_ps();
  const int64_t nb = g.I / F::QK;
  for (int64_t b = 0; b < nb; ++b) {
    typename F::H h[R];
    for (int r = 0; r < R; ++r) h[r] = F::template head<CvtF16C>(g.w + (o + r) * g.ws, b);
    // A hint only: an address past the weights' end does not fault.
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(g.w + (o + r) * g.ws + b * F::BYTES + kPrefetchBytes),
                   _MM_HINT_T0);
    for (int k = 0; k < F::NSUB; ++k) {
      W16 w[R];
      __m128 dm[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (requires { F::w16_avx(h[r], k); }) {
          w[r] = F::w16_avx(h[r], k);
        } else {
          int s0 = 1, s1 = 1;
          if (F::SC16) F::sc16(h[r], k, s0, s1);
          w[r] = widen<F>(F::ints_avx(h[r], k), s0, s1);
        }
        dm[r] = F::dm_avx(h[r], k);
      }
      for (int j = 0; j < TT; ++j) {
        const QX& a = g.xq[(t + j) * g.nbx + b * F::NSUB + k];
        const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(&a.d)));
        for (int r = 0; r < R; ++r) {
          const __m256 p = _mm256_cvtepi32_ps(dot32(w[r], a.q));
          const __m128 v = _mm_mul_ps(dm[r], ds);
          acc[r][j] = _mm256_fmadd_ps(p, _mm256_broadcastss_ps(v), acc[r][j]);
          if (F::MIN) macc[r][j] = _mm_add_ps(macc[r][j], v);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < TT; ++j) {
      const float m = F::MIN ? _mm_cvtss_f32(_mm_movehdup_ps(macc[r][j])) : 0.f;
      store(g, o + r, t + j, hsum(acc[r][j]) + m);
    }
}

// ---- tiling and threads (both ISAs) ----------------------------------------------------------
template <class F, int ISA, int R, int TT>
void tile(const Job& g, int64_t o, int64_t t) {
  if (ISA == kAvx2)
    tile_avx2<F, R, TT>(g, o, t);
  else
    tile_scalar<F, R, TT>(g, o, t);
}

template <class F, int ISA, int R>
void tile_tokens(const Job& g, int64_t o, int64_t t, int64_t n) {
  switch (n) {
    case 1: return tile<F, ISA, R, 1>(g, o, t);
    case 2: return tile<F, ISA, R, 2>(g, o, t);
    case 3: return tile<F, ISA, R, 3>(g, o, t);
    default: return tile<F, ISA, R, 4>(g, o, t);
  }
}

// All T tokens for weight rows o .. o+R-1 in near-equal token tiles of at most 4 (7 -> 4+3).
template <class F, int ISA, int R>
void row_block(const Job& g, int64_t o, int64_t T) {
  constexpr int64_t MT = 4;
  const int64_t tiles = (T + MT - 1) / MT;
  for (int64_t k = 0, t = 0; k < tiles; ++k) {
    const int64_t n = (T - t) / (tiles - k);
    tile_tokens<F, ISA, R>(g, o, t, n);
    t += n;
  }
}

template <class F, int ISA>
void run_small(const Job& g, int64_t T) {
  // 2 rows: 4 rows measured ~30% slower at T=1 (AVX2's 16 registers spill the accumulators),
  // and still no faster with the cheaper int16 weight loads (the LM head ~1.7x slower);
  // a 32-block of x is reused from L1 anyway, so more rows would buy little.
  constexpr int R = 2;
  const int64_t blocks = g.O / R;
  // Chunks of >= 16 rows keep the fork/join cost small next to the rows' work.
  at::parallel_for(0, blocks, 16 / R, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) row_block<F, ISA, R>(g, b * R, T);
  });
  for (int64_t o = blocks * R; o < g.O; ++o) row_block<F, ISA, 1>(g, o, T);
}

// ---- many tokens, AVX2, the 32-block formats: tokens in the vector lanes --------------------
// For T > kSmallT the few-token tile above spends ~9 instructions per (row, token, block) on 32
// products, 5 of them on scales. Here the int32 partials of 8 tokens are reduced together
// (4 + 2 hadds, 2 permutes, 1 add) into one vector with a token per lane, so a row's block scale
// is applied to 8 tokens at once: cvt, mul (dw times the 8 tokens' dx), fma; the min term is one
// more fma with the 8 tokens' sx. The integer sums are exact, so a token's result is the same
// sequence of float operations whatever T and its lane: independent of its batch.
struct Lanes {
  const float* dx;   // [nbx, Tp]: the tokens' block scales, transposed
  const float* sx;   // [nbx, Tp]: d * sum(q)
  int64_t Tp;        // T rounded up to 8 (the padding tokens are zeros)
};

KVF_AVX2 inline __m256i reduce8(const __m256i* p) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                          _mm256_permute2x128_si256(q0, q1, 0x31));
}

// Rows o .. o+R-1 for the 8 tokens t0 .. t0+7 (xq padded to Tp tokens).
template <class F, int R>
KVF_AVX2 void lanes_tile(const Job& g, const Lanes& L, int64_t o, int64_t t0) {
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
  const int64_t nb = g.I / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 dx = _mm256_loadu_ps(L.dx + b * L.Tp + t0);
    const __m256 sx = _mm256_loadu_ps(L.sx + b * L.Tp + t0);
    const QX* xb = g.xq + t0 * g.nbx + b;
    for (int r = 0; r < R; ++r) {
      const typename F::H h = F::template head<CvtF16C>(g.w + (o + r) * g.ws, b);
      _mm_prefetch(reinterpret_cast<const char*>(g.w + (o + r) * g.ws + b * F::BYTES + kPrefetchBytes),
                   _MM_HINT_T0);
      const W16 w = F::w16_avx(h, 0);
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = dot32(w, xb[j * g.nbx].q);
      float dw, mw;
      F::scales(h, 0, dw, mw);
      const __m256 s = _mm256_mul_ps(_mm256_set1_ps(dw), dx);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)), s, acc[r]);
      if (F::MIN) macc[r] = _mm256_fmadd_ps(_mm256_set1_ps(mw), sx, macc[r]);
    }
  }
  const int64_t T = g.nt;
  for (int r = 0; r < R; ++r) {
    alignas(32) float a[8];
    _mm256_store_ps(a, _mm256_add_ps(acc[r], macc[r]));
    for (int j = 0; j < 8 && t0 + j < T; ++j) store(g, o + r, t0 + j, a[j]);
  }
}

template <class F>
void run_lanes(const Job& g, int64_t T, const Lanes& L) {
  constexpr int R = 2;
  const int64_t blocks = g.O / R;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t = 0; t < T; t += 8) lanes_tile<F, R>(g, L, b * R, t);
  });
  for (int64_t o = blocks * R; o < g.O; ++o)
    for (int64_t t = 0; t < T; t += 8) lanes_tile<F, 1>(g, L, o, t);
}

// ---- dequantization --------------------------------------------------------------------------
template <class F, class C>
void dequant_row_scalar(const uint8_t* row, int64_t I, float* out) {
  for (int64_t b = 0; b < I / F::QK; ++b) {
    const typename F::H h = F::template head<C>(row, b);
    for (int k = 0; k < F::NSUB; ++k) {
      int8_t q[32];
      float dw, mw;
      int s0, s1;
      F::ints(h, k, q);
      F::scales(h, k, dw, mw);
      F::sc16(h, k, s0, s1);
      float* o = out + b * F::QK + k * 32;
      const float d0 = F::SC16 ? dw * static_cast<float>(s0) : dw;
      const float d1 = F::SC16 ? dw * static_cast<float>(s1) : dw;
      // Unfused (and no + 0 that would turn gguf's -0.0 into +0.0), to round where gguf does.
      for (int l = 0; l < 32; ++l) {
        const float p = (l < 16 ? d0 : d1) * static_cast<float>(q[l] - F::ZERO);
        o[l] = F::MIN && !F::ZERO ? p + mw : p;
      }
    }
  }
}

template <class F>
KVF_AVX2 void dequant_row_avx2(const uint8_t* row, int64_t I, float* out) {
  for (int64_t b = 0; b < I / F::QK; ++b) {
    const typename F::H h = F::template head<CvtF16C>(row, b);
    for (int k = 0; k < F::NSUB; ++k) {
      float dw, mw;
      int s0 = 1, s1 = 1;
      F::scales(h, k, dw, mw);
      F::sc16(h, k, s0, s1);
      const __m256i q = F::ints_avx(h, k);
      const __m128i qq[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      const __m256 m = _mm256_set1_ps(mw);
      float* o = out + b * F::QK + k * 32;
      for (int hh = 0; hh < 2; ++hh) {
        const __m256 d = _mm256_set1_ps(F::SC16 ? dw * static_cast<float>(hh ? s1 : s0) : dw);
        for (int e = 0; e < 2; ++e) {
          const __m128i v = e ? _mm_srli_si128(qq[hh], 8) : qq[hh];
          __m256i i32 = F::SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
          if (F::ZERO) i32 = _mm256_sub_epi32(i32, _mm256_set1_epi32(F::ZERO));
          // Multiply then add, unfused: gguf rounds the product (Q6_K) before adding.
          const __m256 p = _mm256_mul_ps(d, _mm256_cvtepi32_ps(i32));
          _mm256_storeu_ps(o + 16 * hh + 8 * e, F::MIN && !F::ZERO ? _mm256_add_ps(p, m) : p);
        }
      }
    }
  }
}

// KVFLOW_I8_PC rows may have any I (no 32-blocks needed for the scale * q values).
void dequant_row_i8pc(const uint8_t* row, int64_t I, float* out) {
  float d;
  std::memcpy(&d, row, 4);
  const int8_t* q = reinterpret_cast<const int8_t*>(row + 4);
  for (int64_t i = 0; i < I; ++i) out[i] = d * static_cast<float>(q[i]);
}

template <class F>
void dequant_row(const uint8_t* row, int64_t I, float* out, int isa) {
  if constexpr (std::is_same_v<F, FI8PC>)
    dequant_row_i8pc(row, I, out);
  else if (isa == kAvx2)
    dequant_row_avx2<F>(row, I, out);
  else
    dequant_row_scalar<F, CvtScalar>(row, I, out);
}

// Rows r0 .. r1-1 of w into out ([r1 - r0, I], contiguous), over the threads.
template <class F>
void dequant_rows(const uint8_t* w, int64_t ws, int64_t r0, int64_t r1, int64_t I, float* out,
                  int isa) {
  at::parallel_for(r0, r1, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)),
                   [&](int64_t a, int64_t b) {
                     for (int64_t r = a; r < b; ++r) dequant_row<F>(w + r * ws, I, out + (r - r0) * I, isa);
                   });
}

// ---- large T: dequantized tiles + BLAS -------------------------------------------------------
// One parallel region: each thread dequantizes its tiles of weight rows into its own float32
// buffer and multiplies them right away (BLAS runs single-threaded inside the region). One
// fork/join per call, not two per tile: on a loaded machine every join can wait a time slice.
template <class F>
void run_tiles(const at::Tensor& x, const uint8_t* w, int64_t ws, int64_t I, at::Tensor& y,
               int isa) {
  const int64_t O = y.size(1);
  const int64_t nthreads = at::get_num_threads();
  // ~256 KB of float32 rows: the tile stays in L2 between its dequantization and the GEMM; and
  // at least one tile per thread.
  int64_t nt = std::clamp<int64_t>((65536 / I) / 16 * 16, 16, 512);
  nt = std::max<int64_t>(16, std::min(nt, (O + nthreads - 1) / nthreads));
  const int64_t tiles = (O + nt - 1) / nt;
  at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t b) {
    // The pool's threads do not inherit the caller's inference mode, and y may be an
    // inference tensor (the engine runs under torch.inference_mode): in-place needs the guard.
    c10::InferenceMode guard;
    at::Tensor buf = at::empty({nt, I}, x.options());
    float* bp = buf.data_ptr<float>();
    for (int64_t k = a; k < b; ++k) {
      const int64_t o0 = k * nt, n = std::min(nt, O - o0);
      for (int64_t r = 0; r < n; ++r) dequant_row<F>(w + (o0 + r) * ws, I, bp + r * I, isa);
      at::Tensor yv = y.narrow(1, o0, n);
      yv.addmm_(x, buf.narrow(0, 0, n).t());
    }
  });
}

// ---- entry points ----------------------------------------------------------------------------
template <class Fn>
void with_format(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: return fn(FQ4_0{});
    case kQ4_1: return fn(FQ4_1{});
    case kQ8_0: return fn(FQ8_0{});
    case kQ4_K: return fn(FQ4_K{});
    case kQ6_K: return fn(FQ6_K{});
    case kI8PC: return fn(FI8PC{});
    default:
      TORCH_CHECK(false, "kvflow quant: unsupported qtype ", qtype,
                  " (Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14, KVFLOW_I8_PC=1000)");
  }
}

int64_t row_bytes(int64_t qtype, int64_t I) {
  int64_t out = 0;
  with_format(qtype, [&](auto f) {
    using F = decltype(f);
    if constexpr (std::is_same_v<F, FI8PC>) {
      out = 4 + I;
    } else {
      TORCH_CHECK(I % F::QK == 0, "kvflow quant: in_features ", I, " is not a multiple of qtype ",
                  qtype, "'s block size ", F::QK);
      out = I / F::QK * F::BYTES;
    }
  });
  return out;
}

void check_qweight(const at::Tensor& qw, int64_t qtype, int64_t I, const char* op) {
  TORCH_CHECK(I > 0, op, ": in_features must be positive, got ", I);
  TORCH_CHECK(qw.device().is_cpu() && qw.scalar_type() == at::kByte && qw.dim() == 2, op,
              ": qweight must be a CPU uint8 tensor [O, row_bytes], got ", qw.scalar_type(), " ",
              qw.sizes());
  const int64_t rb = row_bytes(qtype, I);
  TORCH_CHECK(qw.size(1) == rb, op, ": qweight rows have ", qw.size(1), " bytes; qtype ", qtype,
              " with in_features ", I, " needs ", rb);
  TORCH_CHECK(qw.stride(1) == 1, op, ": qweight must have unit stride along its bytes");
}

at::Tensor quant_dequantize(const at::Tensor& qw, int64_t qtype, int64_t I) {
  check_qweight(qw, qtype, I, "quant_dequantize");
  const int64_t R = qw.size(0);
  at::Tensor out = at::empty({R, I}, qw.options().dtype(at::kFloat));
  const int isa = isa_state();
  with_format(qtype, [&](auto f) {
    using F = decltype(f);
    dequant_rows<F>(qw.data_ptr<uint8_t>(), qw.stride(0), 0, R, I, out.data_ptr<float>(), isa);
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& qw, int64_t qtype, int64_t I,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  check_qweight(qw, qtype, I, "quant_linear");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2,
              "quant_linear: x must be a CPU float32 [T, I] tensor, got ", x_in.scalar_type(), " ",
              x_in.sizes());
  TORCH_CHECK(x_in.size(1) == I, "quant_linear: x has ", x_in.size(1), " features, in_features is ",
              I);
  const int64_t T = x_in.size(0), O = qw.size(0);
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  Job g{qw.data_ptr<uint8_t>(), qw.stride(0), nullptr, I / 32, nullptr, nullptr, 0, nullptr, I, O};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == O &&
                    bias->is_contiguous(), "quant_linear: bias must be contiguous float32 [O]");
    g.bias = bias->data_ptr<float>();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 &&
                    residual->size(0) == T && residual->size(1) == O && residual->stride(1) == 1,
                "quant_linear: residual must be float32 [T, O] with unit stride along O");
    g.res = residual->data_ptr<float>();
    g.rs = residual->stride(0);
  }
  at::Tensor y = at::empty({T, O}, x.options());
  if (T == 0 || O == 0) return y;
  const int isa = isa_state();
  if (T <= kSmallT && I % 32 == 0) {
    std::vector<QX> xq(T * g.nbx);
    for (int64_t t = 0; t < T; ++t) quantize_row(x.data_ptr<float>() + t * x.stride(0), I, &xq[t * g.nbx]);
    g.xq = xq.data();
    g.y = y.data_ptr<float>();
    with_format(qtype, [&](auto f) {
      using F = decltype(f);
      if (isa == kAvx2)
        run_small<F, kAvx2>(g, T);
      else
        run_small<F, kScalar>(g, T);
    });
    return y;
  }
  if (isa == kAvx2 && I % 32 == 0 && T <= kLanesMaxT &&
      (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kI8PC)) {
    const int64_t Tp = (T + 7) / 8 * 8, nbx = g.nbx;
    std::vector<QX> xq(Tp * nbx);
    std::memset(static_cast<void*>(xq.data() + T * nbx), 0, (Tp - T) * nbx * sizeof(QX));
    std::vector<float> dx(nbx * Tp, 0.f), sx(nbx * Tp, 0.f);
    at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) {
        quantize_row(x.data_ptr<float>() + t * x.stride(0), I, &xq[t * nbx]);
        for (int64_t k = 0; k < nbx; ++k) dx[k * Tp + t] = xq[t * nbx + k].d, sx[k * Tp + t] = xq[t * nbx + k].s;
      }
    });
    g.xq = xq.data();
    g.y = y.data_ptr<float>();
    g.nt = T;
    const Lanes L{dx.data(), sx.data(), Tp};
    with_format(qtype, [&](auto f) {
      using F = decltype(f);
      if constexpr (requires { F::w16_avx(typename F::H{}, 0); }) run_lanes<F>(g, T, L);
    });
    return y;
  }
  // y starts as residual + bias; the tiles accumulate into it.
  if (residual.has_value()) y.copy_(*residual); else y.zero_();
  if (bias.has_value()) y.add_(*bias);
  const at::Tensor xr = I % 32 == 0 ? round_like_small_t(x) : x;
  with_format(qtype, [&](auto f) {
    using F = decltype(f);
    run_tiles<F>(xr, g.w, g.ws, I, y, isa);
  });
  return y;
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, int qtype, int in_features, Tensor? bias=None, "
        "Tensor? residual=None) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, int qtype, int in_features) -> Tensor");
  m.def("quant_set_isa(str isa) -> ()", &kvflow::quant_set_isa);
  m.def("quant_isa() -> str", &kvflow::quant_isa);
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("quant_linear", kvflow::quant_linear);
  m.impl("quant_dequantize", kvflow::quant_dequantize);
}
