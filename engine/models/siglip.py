"""The SigLIP vision tower, in plain torch modules (never quantized, replicated on every
tensor-parallel rank), op for op as transformers' `modeling_siglip.py`:

    images [N, 3, H, W] -> patch conv (stride p) -> + learned position embeddings
                        -> bidirectional pre-norm encoder layers -> post_layernorm
                        -> [N, (H / p) * (W / p), hidden]

`SiglipVisionTransformer` is SigLIP's fixed-resolution tower (Gemma 3): every image is
image_size x image_size and patch i takes position embedding i. Idefics3 / SmolVLM
(engine.models.idefics3) reuse the encoder with their own embeddings, which bucket the
positions of tiles whose valid region is smaller and mask their padding patches.

Parameter names are transformers' under the tower (`embeddings.patch_embedding.*`,
`embeddings.position_embedding.weight`, `encoder.layers.{i}.self_attn.{q,k,v,out}_proj.*`,
`encoder.layers.{i}.layer_norm{1,2}.*`, `encoder.layers.{i}.mlp.fc{1,2}.*`,
`post_layernorm.*`). SigLIP's attention-pooling head (`head.*`, `vision_use_head`) is not
built: the vision-language models read the last hidden state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VISION_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def as_int(value: Any) -> int:
    """A config size that may be written as [n, n] (image_size, patch_size)."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


class SiglipVisionEmbeddings(nn.Module):
    """Patch embedding (a stride-p conv) plus learned position embeddings of a
    `num_patches_per_side`^2 grid: patch i (row-major) takes position i."""

    def __init__(self, config: Any):
        super().__init__()
        self.patch_size = as_int(config.patch_size)
        self.num_patches_per_side = as_int(config.image_size) // self.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         kernel_size=self.patch_size, stride=self.patch_size,
                                         padding="valid")
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, config.hidden_size)

    def patch_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, (H / p) * (W / p), hidden], patches row by row."""
        return self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, image_size, image_size] -> [N, num_patches, hidden]."""
        embeddings = self.patch_embeddings(pixel_values)
        if embeddings.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels give "
                             f"{embeddings.shape[1]} patches; the tower takes "
                             f"{self.position_embedding.num_embeddings} (image_size "
                             f"{self.num_patches_per_side * self.patch_size})")
        return embeddings + self.position_embedding.weight


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention over an image's patches; with a key mask,
    masked patches are not attended to (their own rows are computed and later ignored)."""

    def __init__(self, config: Any):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        if self.head_dim * self.num_heads != config.hidden_size:
            raise ValueError(f"vision hidden_size {config.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_heads}")
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[N, S, hidden], key_mask [N, S] bool (True: attend) or None (all) -> [N, S, hidden]."""
        batch_size, seq_len, _ = hidden_states.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(batch_size, seq_len, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        if config.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {config.hidden_act!r} "
                             f"(supported: {', '.join(VISION_ACTIVATIONS)})")
        self.act = VISION_ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: Any):
        super().__init__()
        self.self_attn = SiglipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), key_mask)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states, key_mask)
        return hidden_states


class SiglipVisionTransformer(nn.Module):
    """transformers' SiglipVisionModel without its pooling head: images
    [N, 3, image_size, image_size] -> last hidden state [N, num_patches, hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_layernorm.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(pixel_values.to(self.dtype))
        return self.post_layernorm(self.encoder(hidden_states))
