"""The cost model against the roofline written out by hand, and the hardware tables."""
import json

import pytest

from kvflow.sim import CostConstants, CostModel, get_gpu, get_model
from kvflow.sim.hardware import ModelShape, num_gpu_blocks

# Meta-Llama-3-8B's config.json, the numbers a reader can check.
H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256
H100_FLOPS, H100_BW = 989.4e12, 3.35e12


def test_llama3_8b_shape_has_8_billion_parameters_and_128_kib_of_kv_per_token():
    m = get_model("meta-llama/Meta-Llama-3-8B")
    assert m.num_params == 8_030_261_248 - 266_240    # HF's count minus the RMSNorm weights
    assert m.kv_bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 == 128 * 1024


def test_decode_step_time_matches_the_roofline_formula():
    c = CostConstants(mfu=0.6, mbu=0.8, step_overhead_s=1e-3, host_s_per_request=1.4e-6)
    cm = CostModel(get_model("Llama-3-8B"), get_gpu("h100"), c)
    batch, ctx = 64, 1024
    flops, bw = H100_FLOPS * 0.6, H100_BW * 0.8
    layer_params = LAYERS * (H * H + 2 * H * KV_HEADS * HEAD_DIM + H * H + 3 * H * FFN)
    weights = (layer_params + VOCAB * H) * 2                     # layers + LM head, bf16
    linear_flops = batch * 2 * layer_params + batch * 2 * VOCAB * H
    kv_bytes = batch * (ctx + 1) * 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    attn_flops = batch * ctx * 4 * LAYERS * HEADS * HEAD_DIM
    expected = (1e-3 + batch * 1.4e-6 + max(linear_flops / flops, weights / bw)
                + max(attn_flops / flops, kv_bytes / bw))
    assert cm.decode_step_time(batch, ctx) == pytest.approx(expected, rel=1e-12)
    # Decode at batch 64 is bandwidth-bound: weights then KV, each streamed once.
    assert expected == pytest.approx(1e-3 + batch * 1.4e-6 + (weights + kv_bytes) / bw)
    assert 8e-3 < expected < 12e-3


def test_a_large_prefill_is_compute_bound_and_grows_quadratically_with_attention():
    cm = CostModel(get_model("Llama-3-8B"), get_gpu("h100"))
    t1, t2 = cm.prefill_step_time(4096), cm.prefill_step_time(8192)
    assert 2.0 < t2 / t1 < 2.5          # linear part doubles; causal attention quadruples
    # A cached prefix is not recomputed, but its keys are still attended to.
    assert cm.prefill_step_time(8192, cached=4096) < t2
    assert cm.prefill_step_time(8192, cached=4096) > t1


def test_step_time_reads_the_scheduler_output_the_way_schedule_leaves_it():
    cm = CostModel(get_model("Qwen3-0.6B"), get_gpu("a100"))

    class R:                             # schedule() has advanced num_computed_tokens already
        def __init__(self, c):
            self.num_computed_tokens = c

    reqs = {"d": R(700), "p": R(300)}
    t = cm.step_time({"d": 1, "p": 200}, reqs)
    expected = cm.time_from_totals(2, 201, 1, 700, 200 * 100 + 200 * 201 // 2, 300 + 200)
    assert t == expected


def test_faster_hbm_makes_decode_faster_but_not_a_compute_bound_prefill():
    shape = get_model("Llama-3-8B")
    h100, h200 = CostModel(shape, get_gpu("h100")), CostModel(shape, get_gpu("h200"))
    assert h200.decode_step_time(32, 2048) < 0.8 * h100.decode_step_time(32, 2048)
    assert h200.prefill_step_time(8000) == pytest.approx(h100.prefill_step_time(8000), rel=0.02)


def test_hf_config_json_gives_the_same_shape_as_the_built_in(tmp_path):
    cfg = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
           "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_file = get_model(str(tmp_path))
    builtin = get_model("Qwen/Qwen3-0.6B")
    assert from_file.num_params == builtin.num_params
    assert from_file.kv_bytes_per_token == builtin.kv_bytes_per_token
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_hf_config(cfg | {"num_experts": 8})


def test_kv_blocks_fill_what_the_weights_leave_of_the_gpu():
    shape = get_model("Llama-3-8B")
    h100 = num_gpu_blocks(shape, get_gpu("h100"), 16, 0.9, 8192, 256)
    h200 = num_gpu_blocks(shape, get_gpu("h200"), 16, 0.9, 8192, 256)
    # ~60 GB of an H100 is left for KV at 128 KiB per token: ~440k tokens.
    assert 400_000 < h100 * 16 < 480_000
    assert h200 > 1.8 * h100            # 141 GB vs 80 GB, the same 16 GB of weights
    with pytest.raises(ValueError, match="does not fit"):
        num_gpu_blocks(get_model("Llama-3-8B"), get_gpu("a100-40gb"), 16, 0.3, 8192, 256)


def test_unknown_names_say_what_is_known():
    with pytest.raises(ValueError, match="Llama-3-8B"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="h100"):
        get_gpu("tpu")
