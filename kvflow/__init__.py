"""kvflow: a readable LLM inference engine built around a vLLM V1-style scheduler."""
from kvflow.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
