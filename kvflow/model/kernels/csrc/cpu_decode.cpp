// decode_layers: a Llama/Qwen2/Qwen3 decoder stack over one step of decodes, in one call from
// Python. It runs the ops the Python layers run (rms_norm, quant_linear, rotary_, store_kv_,
// paged_decode, silu_and_mul; at::rms_norm for Qwen3's per-head q/k norms, as F.rms_norm there),
// in the same order on the same tensors, so its output is bit for bit the Python path's; what it
// saves is the interpreter between them, ~12 op calls and ~40 Python lines a layer (figures:
// BENCHMARKS.md, issue 16). Only for quantized float32 models (every linear one quant_linear);
// llama.fused_decode_args checks the rest.
#include "cpu_common.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace kvflow {
namespace {

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptT = std::optional<at::Tensor>;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("kvflow::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      const OptT&, const OptT&)>
      linear = op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptT&,
                             const OptT&)>("kvflow::quant_linear");
  // The in-place ops take their tensor by value: the signature their kernels registered.
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      rotary = op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvflow::rotary_");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&)> store_kv =
      op<void(at::Tensor, const at::Tensor&, const at::Tensor&)>("kvflow::store_kv_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double)>
      attend = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, double)>("kvflow::paged_decode");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul =
      op<at::Tensor(const at::Tensor&)>("kvflow::silu_and_mul");
};

const Ops& ops() {
  static const Ops o;
  return o;
}

// Per layer l: norms[2l], norms[2l+1] (input, post-attention); linears 4l .. 4l+3 (qkv, o,
// gate_up, down) as qweights/qtypes/in_features/biases, quant_linear's arguments; qk_norms[2l],
// qk_norms[2l+1] (q, k per head) or none.
at::Tensor decode_layers(at::Tensor h, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         at::TensorList kv_caches, at::TensorList norms, at::TensorList qweights,
                         at::IntArrayRef qtypes, at::IntArrayRef in_features,
                         const c10::List<OptT>& biases, at::TensorList qk_norms,
                         int64_t num_heads, int64_t num_kv_heads, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(norms.size() == size_t(2 * L) && qweights.size() == size_t(4 * L) &&
                  qtypes.size() == size_t(4 * L) && in_features.size() == size_t(4 * L) &&
                  biases.size() == size_t(4 * L),
              "decode_layers: per layer, 2 norms and 4 linears");
  TORCH_CHECK(qk_norms.empty() || qk_norms.size() == size_t(2 * L),
              "decode_layers: qk_norms are 2 per layer or none");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "decode_layers: h must be float32 [T, hidden]");
  const int64_t T = h.size(0), H = num_heads, KVH = num_kv_heads;
  const Ops& o = ops();
  auto lin = [&](const at::Tensor& x, int64_t k, const OptT& res) {
    return o.linear.call(x, qweights[k], qtypes[k], in_features[k], biases.get(k), res);
  };
  for (int64_t l = 0; l < L; ++l) {
    at::Tensor cache = kv_caches[l];
    const int64_t D = cache.size(4);
    at::Tensor qkv = lin(o.rms_norm.call(h, norms[2 * l], eps), 4 * l, std::nullopt)
                         .view({T, H + 2 * KVH, D});
    if (!qk_norms.empty()) {
      at::Tensor q = qkv.narrow(1, 0, H), k = qkv.narrow(1, H, KVH);
      q.copy_(at::rms_norm(q, {D}, qk_norms[2 * l], eps));
      k.copy_(at::rms_norm(k, {D}, qk_norms[2 * l + 1], eps));
    }
    at::Tensor qk = qkv.narrow(1, 0, H + KVH);
    o.rotary.call(qk, positions, cos, sin);
    o.store_kv.call(cache, qkv.narrow(1, H, 2 * KVH).view({T, 2, KVH, D}), slots);
    at::Tensor att = o.attend.call(qkv.narrow(1, 0, H), cache, block_table, seq_lens, scale);
    h = lin(att.view({T, H * D}), 4 * l + 1, h);
    at::Tensor act = o.silu_and_mul.call(lin(o.rms_norm.call(h, norms[2 * l + 1], eps), 4 * l + 2,
                                             std::nullopt));
    h = lin(act, 4 * l + 3, h);
  }
  return h;
}

}  // namespace
}  // namespace kvflow

TORCH_LIBRARY_FRAGMENT(kvflow, m) {
  m.def("decode_layers(Tensor h, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor block_table, Tensor seq_lens, Tensor(a!)[] kv_caches, Tensor[] norms, "
        "Tensor[] qweights, int[] qtypes, int[] in_features, Tensor?[] biases, Tensor[] qk_norms, "
        "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(kvflow, CPU, m) { m.impl("decode_layers", kvflow::decode_layers); }
