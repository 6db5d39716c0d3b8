"""EngineArgs' device and attention-backend arguments: validated before any work, each error
naming the argument; the CLI passes them through. No GPU or triton needed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvflow.cli import build_parser, engine_kwargs
from kvflow.engine.llm_engine import EngineArgs
from kvflow.model.attention import selector
from kvflow.model.loader.model_loader import resolve_dtype


@pytest.mark.parametrize("kw,name", [
    (dict(device="gpu"), "device"), (dict(device=None), "device"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=-0.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
    (dict(enforce_eager="no"), "enforce_eager"),
])
def test_bad_values_raise_naming_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineArgs(**kw)


def test_good_values_pass():
    EngineArgs(device="auto", attention_backend="torch", gpu_memory_utilization=1,
               enforce_eager=True)
    EngineArgs(gpu_memory_utilization=0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="device='cuda'.*is_available"):
        EngineArgs(device="cuda")
    assert selector.resolve_device("auto") == "cpu"


def test_triton_not_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(selector, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match="attention_backend='triton'.*not installed"):
        EngineArgs(attention_backend="triton")
    EngineArgs(attention_backend="auto")        # auto never needs triton on cpu


def test_backend_resolution():
    assert selector.resolve_attention_backend("auto", "cpu") == "torch"
    assert selector.resolve_attention_backend("auto", "cuda") == "triton"
    with pytest.raises(ValueError, match="attention_backend='torch' runs on CPU only"):
        selector.resolve_attention_backend("torch", "cuda")


def test_auto_dtype_is_bf16_on_gpu_unless_the_checkpoint_is_fp16():
    assert resolve_dtype("auto", "float32", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "float16", "cuda") == torch.float16
    assert resolve_dtype("auto", "float32", "cpu") == torch.float32
    assert resolve_dtype("float32", "bfloat16", "cuda") == torch.float32


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from kvflow.model.attention.selector import make_backend\n"
            "try:\n    make_backend('triton', 'cpu')\n"
            "except ValueError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert "TRITON_INTERPRET=1" in res.stdout, res.stderr[-2000:]


def test_cli_flags_reach_engine_args():
    args = build_parser().parse_args(["generate", "x", "--device", "auto", "--attention-backend",
                                      "torch", "--gpu-memory-utilization", "0.5",
                                      "--enforce-eager"])
    kw = engine_kwargs(args)
    assert (kw["device"], kw["attention_backend"]) == ("auto", "torch")
    assert kw["gpu_memory_utilization"] == 0.5 and kw["enforce_eager"] is True
    EngineArgs(**kw)
    serve = engine_kwargs(build_parser().parse_args(["serve", "--device", "cpu"]))
    assert serve["device"] == "cpu" and serve["enforce_eager"] is False


def test_the_cpu_path_never_imports_triton():
    code = ("import sys\n"
            "from kvflow import LLM, EngineArgs\n"
            "import kvflow.engine.llm_engine, kvflow.model.runner.model_runner, kvflow.cli\n"
            "from kvflow.model.attention.selector import make_backend, resolve_attention_backend\n"
            "EngineArgs(device='auto')\n"
            "make_backend(resolve_attention_backend('auto', 'cpu'), 'cpu')\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def gpu_style_sampler(seed):
    """The sampler as a CUDA runner makes it (batch_noise: the GPU's way of drawing the noise),
    on CPU tensors."""
    from kvflow.model.sample.sampler import Sampler
    return Sampler(seed, "cpu", batch_noise=True)


def test_gpu_style_sampling_draws_what_the_cpu_draws_for_seeded_and_greedy_rows():
    """Run on CPU tensors: seeded rows use the request's own CPU generator on both paths, so the
    tokens are identical; greedy rows are the argmax."""
    from kvflow import SamplingParams
    from kvflow.model.sample.sampler import Sampler
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.0, top_k=5, seed=2),
              SamplingParams(temperature=0.9, top_p=0.5, seed=3)]

    def gens():
        return [None] + [torch.Generator().manual_seed(s) for s in (1, 2, 3)]

    want = Sampler(0)(logits, params, gens())
    got = gpu_style_sampler(0)(logits, params, gens())
    assert got == want and got[0] == int(logits[0].argmax())
    assert gpu_style_sampler(0)(logits, [SamplingParams(temperature=0)] * 4,
                                [None] * 4) == logits.argmax(-1).tolist()
    assert Sampler(0).batch_noise is False      # on CPU each row is drawn in place


def test_a_tensor_on_cuda_is_on_cuda0_when_device_0_is_current(monkeypatch):
    """upload() must not re-pin a tensor already on the GPU because "cuda" != "cuda:0"."""
    from kvflow.model.runner.h2d import same_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert same_device(cuda0, cuda) and same_device(cuda, cuda0) and same_device(cuda, cuda)
    assert not same_device(cuda1, cuda) and not same_device(torch.device("cpu"), cuda)
    assert same_device(torch.device("cpu"), torch.device("cpu"))


def test_gpu_style_sampling_never_draws_a_token_banned_below_min_tokens():
    """On CPU tensors: GPU-style sampling masks banned tokens like the CPU's, on the all-greedy
    argmax path and the sampling path, and draws the same tokens."""
    from kvflow import SamplingParams
    from kvflow.model.sample.sampler import Sampler
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    logits[:, 7] += 100                           # token 7 wins every row unless banned
    banned = [[7, 9], None, [7], [7], None, [7, 250]]
    greedy = [SamplingParams(temperature=0)] * 6
    got = gpu_style_sampler(0)(logits, greedy, [None] * 6, banned)
    assert [t == 7 for t in got] == [b is None for b in banned]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=2.0, seed=3,
                                                                      top_k=4),
              SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=1.0, seed=5)]

    def gens():
        return [None] + [torch.Generator().manual_seed(s) for s in range(1, 6)]
    got = gpu_style_sampler(0)(logits, params, gens(), banned)
    assert got == Sampler(0)(logits, params, gens(), banned)
    assert [t == 7 for t in got] == [b is None for b in banned]


def test_one_step_for_both_devices():
    """The CUDA runner overrides device hooks only: the step and its sampling are ModelRunner's."""
    from kvflow.model.runner.cuda_model_runner import CudaModelRunner
    from kvflow.model.runner.model_runner import ModelRunner
    for name in ("execute_model", "sample", "gather_inputs", "update_states", "release",
                 "fail", "check_sampling_params"):
        assert getattr(CudaModelRunner, name) is getattr(ModelRunner, name), name
