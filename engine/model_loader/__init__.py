"""From `--model X` to a loaded model.

    resolved = resolve_model(model_arg)                      # -> ResolvedModel(path, served_model_name, source)
    config = transformers.AutoConfig.from_pretrained(resolved.path)
    dtype = resolve_dtype(config, "auto", device)
    model = load_model(resolved.path, dtype, device)         # our nn.Module, eval, no grad
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.path)
"""

from engine.model_loader.gguf import default_cache_dir, ensure_converted
from engine.model_loader.source import ModelSourceError, ResolvedModel, resolve_model

# The weight loading names import torch: loaded on first use, so that the HTTP frontend,
# which only resolves models, starts without torch.
_WEIGHTS = ("iter_safetensors", "load_model", "resolve_dtype")


def __getattr__(name: str):
    if name in _WEIGHTS:
        from engine.model_loader import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ModelSourceError",
    "ResolvedModel",
    "default_cache_dir",
    "ensure_converted",
    "iter_safetensors",
    "load_model",
    "resolve_dtype",
    "resolve_model",
]
