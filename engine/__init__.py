"""pagedserve's engine: scheduler, paged KV cache, model runner and the offline API."""

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The offline API pulls in torch and transformers: import it only when asked for.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from engine.frontend import llm

        return getattr(llm, name)
    raise AttributeError(name)
