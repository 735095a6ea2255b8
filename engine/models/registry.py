"""`config.architectures` -> the model class that implements it."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.bert import BertForSequenceClassification, BertModel
from engine.models.gemma3 import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from engine.models.idefics3 import (
    Idefics3ForConditionalGeneration,
    SmolVLMForConditionalGeneration,
)
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.sequence_classification import (
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from engine.models.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

_MODELS: dict[str, type[nn.Module]] = {
    "BertForSequenceClassification": BertForSequenceClassification,
    "BertModel": BertModel,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolVLMForConditionalGeneration": SmolVLMForConditionalGeneration,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: Any) -> type[nn.Module]:
    """The first of `config.architectures` we implement; ValueError naming ours if none."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none in config.json)'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
