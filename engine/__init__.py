"""pagedserve's engine: scheduler, paged KV cache, model runner and the offline API."""

from engine import openmp

openmp.set_process_default()  # before anything loads torch (engine/openmp.py)

from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The offline API pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import request_output

        return getattr(request_output, name)
    raise AttributeError(name)
