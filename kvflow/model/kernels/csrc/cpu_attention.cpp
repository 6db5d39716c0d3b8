// Paged decode attention for CPU: one query token per request, read straight from the paged KV
// cache through the block table (no gathered copy of the context), GQA, bf16 or float32.
// Built and loaded by kvflow/model/kernels/cpu_ops.py; TorchAttentionBackend's gather + SDPA is the
// reference and the fallback.
#include "cpu_common.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <type_traits>

namespace kvflow {
namespace {

// q . k over D with k in the cache's dtype. The scalar loop keeps 16 independent partial sums so
// that it vectorises without -ffast-math (which would reorder the softmax arithmetic too).
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), s);
    return _mm512_reduce_add_ps(s);
  }
#endif
  float lanes[16] = {0};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += q[d + j] * to_float(k[d + j]);
  float s = 0;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc += p * v over D.
template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_float(v[d]);
}

// Softmax numerators in place (vectorised exp: scalar std::exp was most of a decode's compute);
// returns 1 / sum.
inline float softmax_(float* s, int64_t n) {
  const float mx = at::vec::reduce_all<float>(
      [](fVec a, fVec b) { return at::vec::maximum(a, b); }, s, n);
  at::vec::map([mx](fVec v) { return (v - fVec(mx)).exp(); }, s, s, n);
  return 1.f / at::vec::reduce_all<float>([](fVec a, fVec b) { return a + b; }, s, n);
}


#if defined(__AVX512F__)
// Sums of 16 vectors, lane j of the result = sum of r[j]'s lanes: a transpose-and-add tree
// (45 shuffles/adds for 16 sums, against ~8 per sum for one reduce at a time).
__attribute__((always_inline)) inline __m512 reduce16(const __m512* r) {
  __m512 s2[8], s4[4];
  for (int i = 0; i < 8; ++i)
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                          _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(s4[0], s4[1], _MM_SHUFFLE(3, 1, 3, 1)));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(s4[2], s4[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t, u, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t, u, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One request, all heads; C = head_dim / 16. K and V are read 16 tokens at a time, each token's
// row of all KV heads (contiguous in the cache) converted once into a float tile that the G query
// heads of each KV head reuse. s: [H][L] scores; q: [H][D] scaled queries; acc: [H][D].
template <typename T, int C>
void decode_request(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t L,
                    int64_t bs, int64_t KVH, int64_t G, float* s, float* tile, float* acc,
                    const c10::BFloat16* qb, float scale) {
  constexpr int64_t D = C * 16;
  const int64_t W = KVH * D;      // one token's row of all KV heads
  auto row_of = [&](const T* base, int64_t t) { return base + (table[t / bs] * bs + t % bs) * W; };
  auto load_tile = [&](const T* base, int64_t t0, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const T* row = row_of(base, t0 + j);
      for (int64_t c = 0; c < W; c += 16) _mm512_storeu_ps(tile + j * W + c, load16(row + c));
    }
    for (int64_t j = n; j < 16; ++j)
      for (int64_t c = 0; c < W; c += 16) _mm512_storeu_ps(tile + j * W + c, _mm512_setzero_ps());
  };
#if defined(__AVX512BF16__)
  // bf16 cache and CPU support: q . k straight from the cache with VDPBF16PS (products of two
  // bf16 are exact in float32, sums in float32), no float tile for K. qb: the unscaled bf16 q.
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - t0);
      const T* rows[16];
      for (int64_t j = 0; j < n; ++j) rows[j] = row_of(kc, t0 + j);
      for (int64_t i = 0; i < KVH * G; ++i) {
        const int64_t off = (i / G) * D;
        __m512bh qv[C / 2];
        for (int c = 0; c < C / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qb + i * D + c * 32);
        __m512 r[16];
        for (int j = 0; j < 16; ++j) {
          __m512 a = _mm512_setzero_ps();
          if (j < n)
            for (int c = 0; c < C / 2; ++c)
              a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + off + c * 32));
          r[j] = a;
        }
        _mm512_mask_storeu_ps(s + i * L + t0, __mmask16((1u << n) - 1),
                              _mm512_mul_ps(reduce16(r), _mm512_set1_ps(scale)));
      }
    }
  } else
#endif
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    load_tile(kc, t0, n);
    for (int64_t i = 0; i < KVH * G; ++i) {
      const float* tk = tile + (i / G) * D;
      __m512 qv[C], r[16];
      for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + i * D + c * 16);
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(tk + j * W));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(tk + j * W + c * 16), a);
        r[j] = a;
      }
      _mm512_mask_storeu_ps(s + i * L + t0, __mmask16((1u << n) - 1), reduce16(r));
    }
  }
  for (int64_t i = 0; i < KVH * G; ++i) {
    const float inv = softmax_(s + i * L, L);
    for (int64_t t = 0; t < L; ++t) s[i * L + t] *= inv;
  }
  // p . v: each V vector is loaded (and converted) once per chunk of up to 16 / C query heads,
  // whose accumulators stay in registers over a 16-token tile.
  constexpr int64_t GC = 16 / C;
  for (int64_t i = 0; i < KVH * G * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    const T* rows[16];
    for (int64_t j = 0; j < n; ++j) rows[j] = row_of(vc, t0 + j);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        const int64_t nh = std::min<int64_t>(GC, G - g0);
        const int64_t h0 = kh * G + g0;
        __m512 a[GC][C];
        for (int64_t h = 0; h < nh; ++h)
          for (int c = 0; c < C; ++c) a[h][c] = _mm512_loadu_ps(acc + (h0 + h) * D + c * 16);
        for (int64_t j = 0; j < n; ++j) {
          __m512 v[C];
          for (int c = 0; c < C; ++c) v[c] = load16(rows[j] + kh * D + c * 16);
          for (int64_t h = 0; h < nh; ++h) {
            const __m512 p = _mm512_set1_ps(s[(h0 + h) * L + t0 + j]);
            for (int c = 0; c < C; ++c) a[h][c] = _mm512_fmadd_ps(p, v[c], a[h][c]);
          }
        }
        for (int64_t h = 0; h < nh; ++h)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (h0 + h) * D + c * 16, a[h][c]);
      }
    }
  }
}
#endif

// One request, float32 cache, any CPU with at::vec's vectors (8 floats on AVX2): the path for
// CPUs without AVX-512. Each K row is loaded once for the G query heads that share it, each V
// row once per head with the head's accumulators in registers, and the rows' offsets come from
// the block table once per request: ~2x the per-token dot/axpy loop below (BENCHMARKS.md).
// q: [H][D] scaled; s: [H][L]; off: [L]; acc: [H][D].
constexpr int64_t kMaxG = 8;

// Scores of the G query heads that share KV head kh, G a constant so the sums stay in registers.
template <int G>
void scores_vec(const float* qh, const float* kc, const int64_t* off, int64_t L, int64_t kh,
                int64_t D, float* s) {
  constexpr int64_t S = fVec::size();
  auto sum = [](fVec& a, fVec& b) { return a + b; };
  for (int64_t t = 0; t < L; ++t) {
    const float* k = kc + off[t] + kh * D;
    fVec a[G];
    for (int g = 0; g < G; ++g) a[g] = fVec(0.f);
    for (int64_t d = 0; d < D; d += S) {
      const fVec kv = fVec::loadu(k + d);
      for (int g = 0; g < G; ++g) a[g] = at::vec::fmadd(fVec::loadu(qh + g * D + d), kv, a[g]);
    }
    for (int g = 0; g < G; ++g) s[(kh * G + g) * L + t] = at::vec::vec_reduce_all<float>(sum, a[g]);
  }
}

void decode_request_vec(const float* q, const float* kc, const float* vc, const int64_t* off,
                        int64_t L, int64_t KVH, int64_t G, int64_t D, float* s, float* acc) {
  constexpr int64_t S = fVec::size();
  using Fn = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t, int64_t, float*);
  static constexpr Fn by_g[kMaxG] = {scores_vec<1>, scores_vec<2>, scores_vec<3>, scores_vec<4>,
                                     scores_vec<5>, scores_vec<6>, scores_vec<7>, scores_vec<8>};
  for (int64_t kh = 0; kh < KVH; ++kh) by_g[G - 1](q + kh * G * D, kc, off, L, kh, D, s);
  constexpr int64_t NV = 8;       // vectors of one head's output kept in registers
  for (int64_t i = 0; i < KVH * G; ++i) {
    const float inv = softmax_(s + i * L, L);
    const float* p = s + i * L;
    const int64_t kh = i / G;
    for (int64_t d0 = 0; d0 < D; d0 += NV * S) {
      const int64_t nv = std::min<int64_t>(NV, (D - d0) / S);
      fVec r[NV];
      for (int64_t c = 0; c < nv; ++c) r[c] = fVec(0.f);
      for (int64_t t = 0; t < L; ++t) {
        const fVec pv(p[t]);
        const float* v = vc + off[t] + kh * D + d0;
        for (int64_t c = 0; c < nv; ++c) r[c] = at::vec::fmadd(pv, fVec::loadu(v + c * S), r[c]);
      }
      for (int64_t c = 0; c < nv; ++c) (r[c] * fVec(inv)).store(acc + i * D + d0 + c * S);
    }
  }
}

// out[i] = T(acc[i]), 32 at a time (rounding every output element to bf16 one by one was a
// visible share of a short request's time).
template <typename T>
inline void store_rounded(T* out, const float* acc, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    constexpr int64_t P = 2 * fVec::size();
    for (; i + P <= n; i += P)
      at::vec::convert_from_float<c10::BFloat16>(fVec::loadu(acc + i), fVec::loadu(acc + i + P / 2))
          .store(out + i);
  }
  for (; i < n; ++i) out[i] = T(acc[i]);
}

// The K and V rows of a request's first (up to) 256 tokens towards L2, issued one request
// ahead. Read cold, a request's scattered 8 KiB blocks cost each thread ~200 ns a token against
// ~80 ns from cache, and prefetching one 16-token tile ahead into L1 (what this replaced) did not
// hide it: 64 x 210 tokens, 2 threads, 1.38-1.49 -> 1.14-1.26 ms a layer; 256 x 70, 2.04-2.29
// -> 1.68-1.72 ms. The cap keeps a long next context from evicting the current one from L2;
// 16 x 1024 tokens is unchanged (1.63-1.73 ms).
template <typename T>
inline void prefetch_request(const T* kc, const T* vc, const int64_t* table, int64_t L,
                             int64_t bs, int64_t W) {
#if defined(__SSE__)
  for (int64_t t = 0; t < L; ++t) {
    const int64_t off = (table[t / bs] * bs + t % bs) * W;
    const char* k = reinterpret_cast<const char*>(kc + off);
    const char* v = reinterpret_cast<const char*>(vc + off);
    for (int64_t b = 0; b < W * int64_t(sizeof(T)); b += 64) {
      _mm_prefetch(k + b, _MM_HINT_T1);
      _mm_prefetch(v + b, _MM_HINT_T1);
    }
  }
#endif
}

// cache: [2, num_blocks, block_size, num_kv_heads, D] (K then V); q, out: [B, H, D].
template <typename T>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
            const at::Tensor& seq_lens, at::Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = cache.size(1), bs = cache.size(2), KVH = cache.size(3);
  const int64_t G = H / KVH, bt_stride = block_table.stride(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kc = cache.data_ptr<T>();
  const T* vc = kc + NB * bs * KVH * D;
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> qf(H * D), acc(H * D), s, tile(16 * KVH * D);
    std::vector<int64_t> off;
    std::vector<c10::BFloat16> qb(H * D);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = bt + b * bt_stride;
      if (b + 1 < b1)
        prefetch_request(kc, vc, table + bt_stride, std::min<int64_t>(lens[b + 1], 256), bs, KVH * D);
      s.resize(H * L);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_float(qp[b * qs0 + h * qs1 + d]) * scale;
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) qb[h * D + d] = qp[b * qs0 + h * qs1 + d];
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        // Probabilities are normalised inside decode_request, so the final scale is 1.
        if (D == 64)
          decode_request<T, 4>(qf.data(), kc, vc, table, L, bs, KVH, G, s.data(), tile.data(),
                               acc.data(), qb.data(), scale);
        else
          decode_request<T, 8>(qf.data(), kc, vc, table, L, bs, KVH, G, s.data(), tile.data(),
                               acc.data(), qb.data(), scale);
        store_rounded(op + b * H * D, acc.data(), H * D);
        continue;
      }
#endif
      if constexpr (std::is_same_v<T, float>) {
        if (D % fVec::size() == 0 && G <= kMaxG) {
          off.resize(L);
          for (int64_t t = 0; t < L; ++t) off[t] = (table[t / bs] * bs + t % bs) * KVH * D;
          decode_request_vec(qf.data(), kc, vc, off.data(), L, KVH, G, D, s.data(), acc.data());
          std::copy(acc.begin(), acc.end(), op + b * H * D);
          continue;
        }
      }
      for (int64_t t = 0; t < L; ++t) {
        const T* k = kc + (table[t / bs] * bs + t % bs) * KVH * D;
        for (int64_t h = 0; h < H; ++h) s[h * L + t] = dot(&qf[h * D], k + (h / G) * D, D);
      }
      std::vector<float> inv(H);
      for (int64_t h = 0; h < H; ++h) inv[h] = softmax_(&s[h * L], L);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* v = vc + (table[t / bs] * bs + t % bs) * KVH * D;
        for (int64_t h = 0; h < H; ++h) axpy(&acc[h * D], s[h * L + t], v + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) op[(b * H + h) * D + d] = T(acc[h * D + d] * inv[h]);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be a [B, H, D] tensor with unit stride in D");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "cache must be a contiguous [2, num_blocks, block_size, kv_heads, D] tensor");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode supports bfloat16 and float32");
  TORCH_CHECK(q.size(2) == cache.size(4) && q.size(1) % cache.size(3) == 0,
              "q heads/head_dim do not match the cache");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.size(0) >= q.size(0) && seq_lens.size(0) >= q.size(0),
              "block_table/seq_lens have fewer rows than q");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous(), "index tensors not contiguous");
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kBFloat16)
    decode<c10::BFloat16>(q, cache, block_table, seq_lens, out, float(scale));
  else
    decode<float>(q, cache, block_table, seq_lens, out, float(scale));
  return out;
}


// The step's new keys and values into the paged cache by slot: one row copy per token for K
// and one for V (a 2048-token prefill layer: ~0.7 ms, against ~1.0 ms for the two index_copy_
// calls it replaces). Slot -1 (a padded row) is skipped. kv: [T, 2, KVH, D], each [KVH, D]
// contiguous (a view of qkv).
void store_kv_(at::Tensor cache, const at::Tensor& kv, const at::Tensor& slots) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(),
              "store_kv_: cache must be a contiguous [2, num_blocks, block_size, kv_heads, D] tensor");
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2 && kv.size(2) == cache.size(3) &&
                  kv.size(3) == cache.size(4) && kv.stride(3) == 1 && kv.stride(2) == kv.size(3),
              "store_kv_: kv must be [tokens, 2, kv_heads, D] matching the cache, each [kv_heads, D] "
              "contiguous");
  TORCH_CHECK(kv.scalar_type() == cache.scalar_type(), "store_kv_: kv and cache dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.numel() <= kv.size(0),
              "store_kv_: slots must be int64, at most one per token");
  const int64_t n = slots.numel(), capacity = cache.size(1) * cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < capacity, "store_kv_: slot ", sp[i], " outside the cache of ",
                capacity, " slots");
  const int64_t row = kv.size(2) * kv.size(3), bytes = row * kv.element_size();
  char* kc = static_cast<char*>(cache.data_ptr());
  char* vc = kc + capacity * bytes;
  const char* src = static_cast<const char*>(kv.data_ptr());
  const int64_t s0 = kv.stride(0) * kv.element_size(), s1 = kv.stride(1) * kv.element_size();
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (sp[i] < 0) continue;
      std::memcpy(kc + sp[i] * bytes, src + i * s0, bytes);
      std::memcpy(vc + sp[i] * bytes, src + i * s0 + s1, bytes);
    }
  });
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, float scale)"
        " -> Tensor");
  m.def("store_kv_(Tensor(a!) cache, Tensor kv, Tensor slots) -> ()");
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("paged_decode", kvflow::paged_decode);
  m.impl("store_kv_", kvflow::store_kv_);
}
