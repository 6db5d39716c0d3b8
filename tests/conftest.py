"""Session-scoped tiny HF checkpoints built on the fly (see model_fixtures.py)."""
from __future__ import annotations

import pytest

from model_fixtures import make_tiny_checkpoint, train_tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    train_tokenizer(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory) -> str:
    """Llama with llama3 RoPE scaling (original_max_position_embeddings=128 < 512)."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama3_rope"),
                                rope_scaling=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_qwen3"))
