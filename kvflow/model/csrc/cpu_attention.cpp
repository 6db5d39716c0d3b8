// Paged decode attention for CPU: one query token per request, read straight from the paged KV
// cache through the block table (no gathered copy of the context), GQA, bf16 or float32.
// Built and loaded by kvflow/model/cpu_ops.py; the torch backend is the reference and fallback.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

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

// Softmax numerators in place; returns 1 / sum.
inline float softmax_(float* s, int64_t n) {
  float mx = s[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return 1.f / sum;
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
    std::vector<float> qf(H * D), acc(H * D), s;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t L = lens[b];
      const int64_t* table = bt + b * bt_stride;
      s.resize(H * L);
      for (int64_t i = 0; i < H * D; ++i) {
        const int64_t h = i / D, d = i % D;
        qf[i] = to_float(qp[b * qs0 + h * qs1 + d]) * scale;
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

}  // namespace

TORCH_LIBRARY(kvflow, m) {
  m.def("paged_decode(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, float scale)"
        " -> Tensor");
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("paged_decode", paged_decode); }
