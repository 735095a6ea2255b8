"""Sampling: persistent per-row state, per-step metadata, the sampler, logprobs."""

from engine.sample.logprobs import LogprobsTensors, compute_prompt_logprobs, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler, SamplerOutput
from engine.sample.state import SamplingState

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "compute_prompt_logprobs",
    "gather_logprobs",
]
