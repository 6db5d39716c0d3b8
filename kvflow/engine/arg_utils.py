"""EngineArgs: every engine setting declared once, with its CLI flag, default and help.

`kvflow generate/chat/serve` build their engine flags from these fields (EngineArgs.add_cli_args)
and read them back (EngineArgs.from_cli_args), as vLLM's EngineArgs does. Torch-free, so that
building the command line loads no torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field

from kvflow.core.config import ASYNC_SPEC_ERROR, SpeculativeConfig
from kvflow.model.attention.selector import check_attention_backend, check_device
from kvflow.sampling_params import short_repr


QUANTIZATIONS = ("int8", "q4")


def _arg(default, help: str = "", choices: tuple | None = None, cli: bool = True):
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(slots=True)
class EngineArgs:
    """The SchedulerConfig fields plus what the model runner needs. None means 'derive it'."""
    model: str | None = _arg(
        None, "HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = _arg("auto", "auto: the checkpoint's dtype where the CPU runs it fast",
                      ("auto", "float32", "bfloat16"))
    quantization: str | None = _arg(
        None, "HF checkpoints: quantize the weights at load (int8: per output channel; q4: "
              "4-bit groups of 32). A GGUF always runs its own blocks", QUANTIZATIONS)
    seed: int = _arg(0, "seed of the sampler for requests without their own")
    num_threads: int | None = _arg(None, "torch intra-op threads (default: torch's)")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV cache (ignored with --num-blocks)")
    num_blocks: int | None = _arg(None, "KV-cache blocks (default: from the memory)")
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_num_batched_tokens: int | None = _arg(
        None, "the token budget of one step (default: 2048 on CPU, 8192 on CUDA)")
    max_num_seqs: int = _arg(256, "most requests running at once")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of shared prompt prefixes")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    long_prefill_token_threshold: int = _arg(
        0, "most tokens of one prompt per step while other requests exist (0: no cap)")
    policy: str = _arg("fcfs", "admission order", ("fcfs", "priority"))
    watermark: float = _arg(0.0, "share of KV blocks kept free when admitting requests")
    device: str = _arg("cpu", "auto: cuda when torch sees a GPU", ("cpu", "cuda", "auto"))
    attention_backend: str = _arg("auto", "auto: triton on cuda, torch on cpu",
                                  ("auto", "torch", "triton"))
    gpu_memory_utilization: float = _arg(
        0.9, "cuda: share of GPU memory for weights, activations and the KV cache")
    enforce_eager: bool = _arg(False, "cuda: run decode steps eagerly (no CUDA graphs)")
    tensor_parallel_size: int = _arg(
        1, "processes (ranks) the model is split across, Megatron-style: gloo on CPU, NCCL on "
           "CUDA. Under torchrun, the ranks torchrun started (docs/tensor_parallel.md)")
    async_scheduling: bool | None = _arg(
        None, "schedule step N+1 while step N runs (default: on with CUDA, off on CPU, where it "
              "measured no faster: BENCHMARKS.md); not with --speculative-config")
    speculative_config: dict | None = _arg(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')

    def __post_init__(self) -> None:
        # Checked here, before any work, so each error names the argument the user gave.
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            _check_int(name, getattr(self, name), 1)
        for name in ("num_threads", "kv_cache_memory", "num_blocks", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_int("seed", self.seed, 0)
        if self.seed >= 1 << 64:        # torch.Generator.manual_seed's limit
            raise ValueError(f"seed must be < 2**64, got {short_repr(self.seed)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got "
                             f"{short_repr(self.quantization)}")
        check_device(self.device)
        check_attention_backend(self.attention_backend)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        self.speculative_config_obj()      # its errors name the key at fault
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be a bool or None, got "
                             f"{short_repr(self.async_scheduling)}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(ASYNC_SPEC_ERROR)
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path, got {type(self.model).__name__}")

    def speculative_config_obj(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    def resolved_async_scheduling(self, device: str) -> bool:
        """None: on where it measured faster (CUDA, as in vLLM), off on CPU; never with
        speculative decoding (refused when asked for explicitly)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device == "cuda" and self.speculative_config is None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field: --max-num-seqs N, --enable-prefix-caching / --no-...."""
        g = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kw = dict(default=f.default, help=f.metadata["help"] or None)
            kind = hints[f.name]
            if kind is bool or kind == bool | None:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            if base is dict:
                base = _json_dict
            g.add_argument(flag, type=base, choices=f.metadata["choices"], **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineArgs":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        return cls(**{**kw, **overrides})


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags of a parsed command line, less the model (given as LLM's first argument)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name != "model"}


def _json_dict(text: str) -> dict:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return d


def _check_int(name: str, v, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
