"""Decoder rerankers: a Llama / Qwen2 / Qwen3 decoder whose last token's hidden state goes
through a score head instead of the lm_head.

Two kinds of checkpoint load into the same model:

    *ForSequenceClassification      model.* + score.weight [num_labels, H] (no bias), as
      (transformers' class)         transformers saves it; one label -> sigmoid(logit),
                                    as sentence-transformers' CrossEncoder scores
    Qwen3-Reranker (a causal LM,    model.* + lm_head.weight (or the tied embedding): the
      --hf-overrides: see           rows of the tokens "no" and "yes" become one label,
      engine/model_loader/hf_config.py)  score.weight = lm_head[yes] - lm_head[no]

The second is vLLM's "from_2_way_softmax": the reranker's own score is P(yes) =
softmax([h . w_no, h . w_yes])[1] = sigmoid(h . (w_yes - w_no)), the sigmoid the server
applies to a one-label head (server/apis/embeddings/routes.py), so one [1, H] row
replaces the [vocab, H] lm_head.

A pooling request on it is a prefill that writes its KV like any other (the decoder's
layers are unchanged); the runner pools with `classify`, on the request's last row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.distributed.sharding import RowRange
from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.weight_utils import load_named_weights


def two_way_token_ids(config: Any) -> tuple[int, int] | None:
    """(id of "no", id of "yes") for a causal-LM checkpoint scored from two tokens' logits
    (config.classifier_from_token_ids, resolved from the tokenizer at load:
    engine.model_loader.hf_config), or None for a checkpoint with its own score head."""
    ids = getattr(config, "classifier_from_token_ids", None)
    if ids is None:
        return None
    if len(ids) != 2:
        raise ValueError(f"classifier_from_token: two tokens (no, yes), got {len(ids)}")
    return int(ids[0]), int(ids[1])


class DecoderForSequenceClassification:
    """Mixed in before a decoder class (Qwen3ForCausalLM, ...): the same layers, a score
    head [num_labels, H] instead of the lm_head, and the pooling model's contract
    (forward -> hidden states; `classify` on the last token; no compute_logits)."""

    is_pooling_model = True
    classifies_last_token = True  # the pooler feeds `classify` each request's last row

    def make_head(self, config: Any) -> None:
        self.two_way_token_ids = two_way_token_ids(config)
        num_labels = 1 if self.two_way_token_ids else config.num_labels
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} scores pairs; it has no lm_head")

    def classify(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] hidden states of each request's last token -> [N, num_labels]
        float32 logits."""
        return self.score(last_hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """The decoder's tensors as DecoderForCausalLM loads them, plus score.weight: the
        checkpoint's own, or (a causal-LM reranker) lm_head[yes] - lm_head[no], read from
        the tied embedding where the checkpoint ties them. ValueError as load_named_weights
        raises it (a tensor with no place, a parameter left unfilled)."""
        if self.two_way_token_ids is not None:
            weights = self._score_from_lm_head(weights)
        # A causal LM's lm_head (whole, or a tied copy) has no place here.
        load_named_weights(self, weights, skip_lm_head=True)

    def _score_from_lm_head(self, weights: Iterable[tuple[str, CheckpointTensor]]
                            ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors, with score.weight put in where the lm_head (or, tied,
        the embedding) passes: only its two rows are read from disk."""
        source = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        no_id, yes_id = self.two_way_token_ids
        for name, tensor in weights:
            if name == source:
                rows = [read_rows(tensor, 0, RowRange(i, 1)).float() for i in (no_id, yes_id)]
                yield "score.weight", rows[1] - rows[0]
            if name != "lm_head.weight":
                yield name, tensor


class LlamaForSequenceClassification(DecoderForSequenceClassification, LlamaForCausalLM):
    """A Llama-architecture reranker (transformers' LlamaForSequenceClassification)."""


class Qwen2ForSequenceClassification(DecoderForSequenceClassification, Qwen2ForCausalLM):
    """A Qwen2 reranker (mxbai-rerank-v2 converted to a score head, gte-Qwen2 classifiers)."""


class Qwen3ForSequenceClassification(DecoderForSequenceClassification, Qwen3ForCausalLM):
    """Qwen3-Reranker: converted (tomaarsen/Qwen3-Reranker-*-seq-cls) or, with
    --hf-overrides, the original causal LM scored from its "no" / "yes" logits."""
