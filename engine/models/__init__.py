"""Our own model implementations, built on the project's attention layer.

Every model class implements:

    __init__(config: transformers.PretrainedConfig)
    forward(input_ids [T] long, positions [T] long) -> hidden_states [T, hidden_size]
    compute_logits(hidden_states [N, hidden_size]) -> logits [N, vocab_size] float32
    load_weights(weights: Iterable[(hf_name, tensor)]) -> None

`forward` must run under `engine.attention.set_forward_context(...)`.
"""

from engine.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
