"""XLM-RoBERTa encoders (multilingual-e5, bge-m3 dense) and cross-encoders (bge-reranker).

The BERT encoder of engine/models/bert.py with three differences:

    positions     RoBERTa counts them from padding_idx + 1 (pad_token_id 1 -> 2, 3, 4, ...),
                  so a model of max_position_embeddings 514 holds 512 tokens
    token types   one (type_vocab_size 1): its row is added to every token
    checkpoint    "roberta." prefix; no BERT pooler in a cross-encoder

A cross-encoder (XLMRobertaForSequenceClassification) scores its <s> token through
RobertaClassificationHead:

    hidden[<s>] -> dense (H -> H) -> tanh -> out_proj (H -> num_labels) -> logits

and reads a (query, document) pair as its tokenizer's pair template gives it,
`<s> q </s></s> d </s>`, with no token types (the server tokenizes the pair).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.models.bert import BertEmbeddings, BertModel


class XLMRobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings read at positions offset by padding_idx + 1.

    Worked example: pad_token_id 1, a 3-token request, positions [0, 1, 2] -> position
    embedding rows [2, 3, 4] (transformers' create_position_ids_from_input_ids on an
    unpadded sequence)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.position_offset = config.pad_token_id + 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids, positions + self.position_offset, token_type_ids)


class XLMRobertaModel(BertModel):
    """An XLM-RoBERTa encoder: hidden states [T, H], pooled by the runner as the
    checkpoint says (modules.json: multilingual-e5 mean, bge-m3 CLS)."""

    embeddings_class = XLMRobertaEmbeddings
    checkpoint_prefix = "roberta."

    def __init__(self, config: Any):
        if config.pad_token_id is None:
            raise ValueError("XLM-RoBERTa needs config.pad_token_id (its positions start "
                             "after it)")
        super().__init__(config)
        # The most tokens a request may hold: the position table less the rows below
        # padding_idx + 1 (514 -> 512). The worker caps the context there.
        self.max_positions = config.max_position_embeddings - config.pad_token_id - 1


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder reranker (bge-reranker-base / -large / -v2-m3): the encoder, then
    RobertaClassificationHead on the <s> token (see the module doc); `classify` gives the
    logits of given <s> rows."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.classifier = nn.Module()  # checkpoint names: classifier.dense, classifier.out_proj
        self.classifier.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] hidden states of <s> tokens -> [N, num_labels] float32 logits."""
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_hidden))).float()
