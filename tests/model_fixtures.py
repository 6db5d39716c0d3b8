"""Tiny on-the-fly HF checkpoints (llama / qwen2 / qwen3) and HF reference outputs for tests.

Nothing is downloaded: the tokenizer is trained here on a generated corpus, the models get random
(but deliberately peaky) weights. Imported by tests/conftest.py, which wraps the builders in
session-scoped fixtures.

Layout of a checkpoint dir built by `make_tiny_checkpoint`:
    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

config.json under transformers 5.x: transformers 5 keeps RoPE settings in one dict,
`"rope_parameters": {"rope_type": "default"|"llama3"|..., "rope_theta": ..., <scaling keys>}`, and
writes no top-level `rope_theta` / `rope_scaling`. So that a reader written for either layout can
parse it, `make_tiny_checkpoint` also adds the transformers 4.x keys; e.g. for llama3 scaling:
    "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 128, "rope_theta": 10000.0,
                        "rope_type": "llama3"},
    "rope_theta": 10000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 128, "rope_type": "llama3"}
and with no scaling: "rope_parameters": {"rope_theta": ..., "rope_type": "default"},
"rope_theta": ..., "rope_scaling": null. transformers 5 loads this file back unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
EOS_TOKEN_ID = IM_END_ID  # config.json / generation_config.json eos; bos is None
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Common config for every arch. head_dim is explicit: Qwen3's default (128) is not hidden/heads.
BASE_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=ENDOFTEXT_ID,
)
ARCH_CONFIG = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1e6, tie_word_embeddings=True),
}
# Weight init std. Default 0.02 gives near-uniform logits (greedy ties); 0.5 makes them peaky (top-2 gap median ~0.7).
INIT_STD = 0.5


# ----------------------------------------------------------------------------------- tokenizer
def _corpus() -> list[str]:
    """A few hundred deterministic English-ish sentences (plus digits and punctuation)."""
    subjects = ["The cat", "A dog", "My friend", "The old man", "Our teacher", "A small bird",
                "The engine", "Every student", "The model", "Her brother"]
    verbs = ["sees", "likes", "finds", "reads", "writes about", "walks to", "talks with", "builds"]
    objects = ["the red house", "a long book", "the river", "some green apples", "the city",
               "a quiet garden", "the blue sky", "an open window", "the next token"]
    tails = [".", " today.", " every morning!", " again?", ", and then sleeps.", " in 2024."]
    out = []
    for i, (s, v, o) in enumerate(itertools.product(subjects, verbs, objects)):
        out.append(f"{s} {v} {o}{tails[i % len(tails)]}")
    out += [f"Number {n} plus {n + 1} is {2 * n + 1}." for n in range(50)]
    out += ["Hello, world! How are you?", "I am fine, thank you.", "What is your name?"]
    return out  # 10*8*9 + 50 + 3 = 773 sentences


def train_tokenizer(path_dir) -> Tokenizer:
    """Train a byte-level BPE (vocab 512, specials at ids 0..2); write tokenizer(_config).json."""
    path_dir = Path(path_dir)
    path_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    tok.save(str(path_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 512,
    }
    (path_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok


# ---------------------------------------------------------------------------------- checkpoint
def _config_cls(arch: str):
    import transformers as tf
    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]


def _add_legacy_rope_keys(config_path: Path) -> None:
    """Add 4.x-style top-level rope_theta / rope_scaling next to 5.x's rope_parameters."""
    cfg = json.loads(config_path.read_text())
    rp = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" in rp:  # transformers 5 layout
        cfg["rope_theta"] = rp.pop("rope_theta")
        cfg["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    assert "rope_theta" in cfg, "config.json lacks rope_theta"
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _randomize_norms_and_biases(model, seed: int) -> None:
    """HF inits RMSNorm weights to 1 and biases to 0; make them random so that a loader which
    drops or swaps them (q/k biases, q_norm/k_norm, ...) produces visibly different logits."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # U(0.5, 1.5)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)


def make_tiny_checkpoint(arch: str, path_dir, *, seed: int = 0, dtype: str = "float32",
                         **overrides) -> str:
    """Build and save a tiny random llama/qwen2/qwen3 checkpoint (+ tokenizer) in path_dir.

    `overrides` go to the HF config, e.g. rope_scaling={"rope_type": "llama3", ...} (a 4.x-style
    dict; transformers 5 folds it and rope_theta into `rope_parameters`) or num_hidden_layers=3.
    """
    from transformers import GenerationConfig

    if arch not in ARCH_CONFIG:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCH_CONFIG)}")
    path_dir = Path(path_dir)
    tok = train_tokenizer(path_dir)
    config_cls, model_cls = _config_cls(arch)
    kw = {**BASE_CONFIG, **ARCH_CONFIG[arch], "vocab_size": tok.get_vocab_size(),
          "initializer_range": INIT_STD, **overrides}
    config = config_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize_norms_and_biases(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=ENDOFTEXT_ID)
    model.save_pretrained(path_dir, safe_serialization=True)
    _add_legacy_rope_keys(path_dir / "config.json")
    _load.cache_clear()  # path may have been rebuilt
    return str(path_dir)


# ----------------------------------------------------------------------------- HF references
@contextlib.contextmanager
def _one_thread():
    """The models are tiny: one intra-op thread is fastest and stays fast on a busy 2-CPU box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@functools.lru_cache(maxsize=8)
def _load(path_dir: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path_dir, dtype=torch.float32).eval()
    # Disable EOS here: `generate` fills None fields of a passed GenerationConfig from the model's
    # own, so eos_token_id=None there does not stick; and min_new_tokens would *suppress* EOS
    # (changing the argmax) rather than ignore it.
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def hf_greedy(path_dir, prompts: list[list[int]], max_new_tokens: int, *,
              stop_at_eos: bool = False) -> list[list[int]]:
    """Greedy continuations with HF `generate`, one prompt at a time (no padding), float32.

    EOS is ignored: exactly `max_new_tokens` new tokens come back, each the plain argmax even when
    it is <|im_end|> (compare with an engine run using ignore_eos / no stop tokens). With
    stop_at_eos=True each list is cut after its first EOS_TOKEN_ID (EOS included), which is what
    greedy decoding that stops on EOS returns.
    """
    from transformers import GenerationConfig

    model = _load(os.fspath(path_dir))
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                               bos_token_id=None, pad_token_id=ENDOFTEXT_ID)
    outs = []
    for prompt in prompts:
        with _one_thread():
            ids = torch.tensor([prompt], dtype=torch.long)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 generation_config=gen_cfg)
        new = out[0, len(prompt):].tolist()
        assert len(new) == max_new_tokens, (len(new), max_new_tokens)
        if stop_at_eos and EOS_TOKEN_ID in new:
            new = new[:new.index(EOS_TOKEN_ID) + 1]
        outs.append(new)
    return outs


@torch.inference_mode()
def hf_logits(path_dir, prompt: list[int]) -> torch.Tensor:
    """Full float32 logits [T, vocab] of one forward pass over `prompt` (last row = next token)."""
    model = _load(os.fspath(path_dir))
    with _one_thread():
        return model(input_ids=torch.tensor([prompt], dtype=torch.long)).logits[0].float()


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Per-row gap between the largest and second largest logit."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
