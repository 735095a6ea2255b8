"""BERT encoders (sentence-transformers' all-MiniLM, bge, e5, gte): embeddings only.

Layout, per token (T tokens of several requests packed back to back):

    word + position + token_type(0) embeddings -> LayerNorm
      -> [ qkv -> attention within the token's own request (bidirectional)
           -> dense -> +residual -> LayerNorm
           -> intermediate (GELU) -> output -> +residual -> LayerNorm ] x L
      -> last hidden states [T, hidden]          (the runner pools them)

There is no KV cache and no lm_head: a request's whole prompt is computed in one step
(engine.pooling_params), and each request attends only to its own tokens, read from the
step's `query_start_loc`:

    query_start_loc [0, 3, 5]:  tokens 0..2 attend to 0..2, tokens 3..4 to 3..4

Each request's attention runs on its own slice, so its vector does not depend on what
it is batched with (the linears see the packed rows; their sums may round differently
from one batch size to another, as any matmul's may).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.forward_context import get_forward_context
from engine.models.checkpoint_tensor import CheckpointTensor, read_rows

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:  # one segment: every token is type 0
            return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])
        return self.LayerNorm(hidden + self.token_type_embeddings(token_type_ids))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T) v for one request, q already scaled: [heads, L, head_size] each.

    Two batched matmuls and a float32 softmax: for BERT's short sequences (L <= 512,
    head size 32-64) about twice as fast on the CPU as scaled_dot_product_attention,
    whose flash kernel pays its tiling for rows it cannot fill."""
    weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1, dtype=torch.float32)
    return torch.bmm(weights.to(v.dtype), v)


class BertLayer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key, value filled at load
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv(hidden).view(num_tokens, 3, self.num_heads, self.head_size)
        q, k, v = qkv.permute(1, 2, 0, 3)  # each [heads, T, head_size]
        attended = torch.empty(self.num_heads, num_tokens, self.head_size, dtype=hidden.dtype,
                               device=hidden.device)
        q = q * self.head_size ** -0.5
        for start, end in bounds:  # one request at a time: it sees only its own tokens
            attended[:, start:end] = _attend(q[:, start:end], k[:, start:end],
                                             v[:, start:end])
        attended = attended.transpose(0, 1).reshape(num_tokens, -1)
        hidden = self.attention_norm(self.attention_output(attended) + hidden)
        return self.output_norm(self.output(self.act(self.intermediate(hidden))) + hidden)


# Checkpoint names -> ours, within a layer ("encoder.layer.{i}." prefix), q/k/v aside.
_LAYER_NAMES = {
    "attention.output.dense": "attention_output",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_QKV = ("query", "key", "value")


class BertModel(nn.Module):
    """The contract of a pooling model: forward(input_ids, positions) -> hidden [T, H],
    no lm_head; `is_pooling_model` tells the runner to pool, never sample."""

    is_pooling_model = True
    embeddings_class: type[nn.Module] = BertEmbeddings  # XLM-RoBERTa: positions offset
    checkpoint_prefix = "bert."  # the base model's prefix in a task model's checkpoint

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BERT with position_embedding_type "
                             f"{config.position_embedding_type!r} is not supported")
        self.embeddings = self.embeddings_class(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (and a pair's token_type_ids): [T] long -> [T, hidden]."""
        starts = get_forward_context().attn_metadata.query_start_loc_np.tolist()
        bounds = list(zip(starts[:-1], starts[1:], strict=True))
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden, bounds)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter from HF checkpoint names (`checkpoint_prefix` or not); the
        pooler (unused by sentence-transformers) and buffers are skipped. ValueError for a
        tensor with no place, a shape mismatch, or a parameter left unfilled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        hidden = self.config.hidden_size
        for name, tensor in weights:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.endswith(("position_ids", "token_type_ids")) or (
                    name.startswith("pooler.") and "pooler.dense.weight" not in params):
                continue
            target, rows = self._our_name(name, hidden)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[target]
            tensor = read_rows(tensor)  # a lazily read safetensors slice, or a tensor
            dest = param.data if rows is None else param.data[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"{tuple(dest.shape)}")
            dest.copy_(tensor)
            filled.add(target if rows is None else f"{target}[{rows.start}]")
        expected = {n for n in params if ".qkv." not in n}
        expected |= {f"{n}[{i * hidden}]" for n in params if ".qkv." in n for i in range(3)}
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"parameters the checkpoint left unfilled: {missing[:5]}")

    @staticmethod
    def _our_name(name: str, hidden: int) -> tuple[str, slice | None]:
        """Checkpoint name -> (our parameter, rows of it or None).

        Example: "encoder.layer.2.attention.self.key.bias" -> ("layers.2.qkv.bias",
        rows hidden..2*hidden); "encoder.layer.2.output.LayerNorm.weight" ->
        ("layers.2.output_norm.weight", None)."""
        if not name.startswith("encoder.layer."):
            return name, None
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if module.removeprefix("attention.self.") in _QKV:
            which = _QKV.index(module.removeprefix("attention.self."))
            return f"layers.{index}.qkv.{kind}", slice(which * hidden, (which + 1) * hidden)
        return f"layers.{index}.{_LAYER_NAMES.get(module, module)}.{kind}", None


class BertForSequenceClassification(BertModel):
    """A cross-encoder reranker: the encoder, then BERT's pooler (dense + tanh on the
    [CLS] token) and a classifier; `classify` gives the logits of given [CLS] rows."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] hidden states of [CLS] tokens -> [N, num_labels] float32 logits."""
        return self.classifier(torch.tanh(self.pooler.dense(cls_hidden))).float()
