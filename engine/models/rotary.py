"""Rotary position embedding (RoPE), neox style, with the usual scaling schemes.

Positions are arbitrary per token: a batch holds requests at different offsets,
so cos/sin are computed from the `positions` tensor of each forward pass (once
per pass, shared by all layers) rather than from a running sequence length.

Supported `rope_type`s: default, linear, dynamic, llama3, yarn, longrope. The
settings come from `config.rope_parameters` (transformers v5) or `rope_theta` +
`rope_scaling` (older configs); models with per-layer-type settings (Gemma 3's
local and global layers) name the layer type.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve_kernels.cpu_kernels import fused_ops_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The config's RoPE settings as one flat dict with `rope_type` and `rope_theta` set
    (those of `layer_type` where the config has per-layer-type settings)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params.get(layer_type) or params["full_attention"])  # per layer type
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if params.get("original_max_position_embeddings") is None:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
    return params


def compute_inv_freq(
    params: dict[str, Any], rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_factor applied to cos and sin)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "dynamic":
        # Dynamic NTK rescales the base only once a sequence outgrows
        # max_position_embeddings; the engine caps max_model_len there, so within
        # what it serves the frequencies are the unscaled ones (as in HF). A
        # base that grew with the sequence would also invalidate cached keys.
        return inv_freq, 1.0
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, original_max), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, base, rotary_dim, original_max, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(params, base, rotary_dim, original_max, max_position_embeddings)
    raise ValueError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, original_max: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max / low_freq_factor  # longer than this: fully scaled
    high_freq_wavelen = original_max / high_freq_factor  # shorter than this: untouched
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: dict, base: float, dim: int, original_max: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp in between."""
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength makes `num_rotations` turns over original_max
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_weight)
        + inv_freq_extrapolation * extrapolation_weight
    )
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(
    params: dict, base: float, dim: int, original_max: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3/3.5, Phi-4-mini): each frequency divided by its own factor, from
    `long_factor` or `short_factor`, and cos/sin scaled by sqrt(1 + ln(s) / ln(original))
    with s = factor (default max_position_embeddings / original_max).

    transformers switches from the short to the long factors per forward pass, once the
    sequence outgrows original_max; keys already cached keep the old rotation. A paged
    cache shared by many requests needs one rotation per position, so the choice here is
    made once per model: the long factors when the model serves contexts beyond
    original_max (max_position_embeddings > original_max), else the short ones. Either
    way it equals transformers on every sequence of the kind the choice is for.
    """
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original_max)))
    use_long = max_position_embeddings > original_max
    ext_factors = torch.tensor(params["long_factor" if use_long else "short_factor"],
                               dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**exponents), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# RotaryEmbedding's CPU tables cover positions below this; later ones are computed.
TABLE_ROWS_MAX = 1 << 14


def _largest(positions: torch.Tensor) -> int:
    return int(positions.numpy().max()) if positions.numel() else 0


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions; `apply_rotary` rotates q or k with them.

    forward(positions [T]) -> (cos, sin), each [T, rotary_dim] float32, already
    multiplied by the scheme's attention factor (YaRN; 1 otherwise).
    """

    def __init__(self, head_size: int, max_position_embeddings: int, params: dict[str, Any]):
        super().__init__()
        self.rotary_dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        inv_freq, self.attention_factor = compute_inv_freq(
            params, self.rotary_dim, max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self._table_rows = 0  # _rows_of_tables: no table yet
        self._cos_table = self._sin_table = torch.empty(0)

    @classmethod
    def from_config(cls, config: Any, head_size: int,
                    layer_type: str = "full_attention") -> RotaryEmbedding:
        return cls(head_size, config.max_position_embeddings, rope_parameters(config, layer_type))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.is_cpu and (largest := _largest(positions)) < TABLE_ROWS_MAX:
            return self._rows_of_tables(positions, largest)
        return self._compute(positions)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def _rows_of_tables(self, positions: torch.Tensor, largest: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU: the rows of cos/sin tables of positions 0..n-1, computed by `_compute`
        (elementwise ops: the same values to the bit). A CPU step's small torch ops run
        with caches just emptied by the weights streamed through them, ~20 us each: two
        lookups cost less than the seven ops of `_compute`. The tables grow to the next
        power of two past the largest position asked for. Example: positions [0..149]
        of a prompt -> 256 rows; a decode at position 300 later -> 512 rows (at most
        TABLE_ROWS_MAX: 16 MB for head size 128)."""
        if largest >= self._table_rows:
            self._table_rows = 1 << largest.bit_length()
            self._cos_table, self._sin_table = self._compute(torch.arange(self._table_rows))
        if positions.numel() == 1:  # one decode: a view of the row, no gather
            return (self._cos_table.narrow(0, largest, 1),
                    self._sin_table.narrow(0, largest, 1))
        return self._cos_table[positions], self._sin_table[positions]


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] rotated by `apply_rotary`; on the CPU both in place,
    in one C++ call (q and k may be views into the fused qkv output)."""
    ops = fused_ops_for(q)
    if ops is None:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ops.rotary_neox_(q, k, cos, sin)
    return q, k


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_size] neox style (halves, not interleaved pairs).

    With r = rotary_dim and x = [x1 | x2 | rest] (x1, x2 of r/2 dims each):
        out = [x1 | x2] * cos + [-x2 | x1] * sin,  followed by `rest` unchanged.
    """
    rotary_dim = cos.shape[-1]
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
