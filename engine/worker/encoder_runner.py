"""The runner's side of images: the vision encoder's outputs, kept by image, and the
rows of a step's input embeddings they replace.

    SchedulerOutput.scheduled_encoder_inputs ──run_encoders──▶ cache[identifier] = [rows, hidden]
    each request's tokens of the step that fall on image positions ──gather──▶
        (token indices in the step, the encoder rows that go there)

The scheduler's EncoderCacheManager (engine/sched/encoder_cache.py) decides what is held;
this side only follows it (`free`), so a chunk of a prompt that starts in the middle of an
image finds the image's rows here, encoded in an earlier step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.multimodal.inputs import ImageFeature


@dataclass
class StepImageEmbeds:
    """Which rows of a step's input embeddings are image rows, and their values."""

    token_indices: torch.Tensor  # [M] long: rows of the step's flattened tokens
    embeds: torch.Tensor  # [M, hidden]


class EncoderRunner:
    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}  # identifier -> [num_embeds, hidden]
        self._features: dict[str, list[ImageFeature]] = {}  # req_id -> its images
        self.num_encoded = 0  # images run through the encoder (for tests and stats)

    def add_request(self, req_id: str, features: list[ImageFeature] | None) -> None:
        if features:
            self._features[req_id] = sorted(features, key=lambda f: f.offset)

    def remove_request(self, req_id: str) -> None:
        self._features.pop(req_id, None)

    def free(self, identifiers: list[str]) -> None:
        for identifier in identifiers:
            self.cache.pop(identifier, None)

    @property
    def has_requests(self) -> bool:
        return bool(self._features)

    def run_encoders(self, features: list[ImageFeature]) -> None:
        """Encode each image (its processor tensors -> the model's embedding rows)."""
        for feature in features:
            if feature.identifier in self.cache:
                continue  # the same image twice in one step
            tensors = {name: torch.from_numpy(data.to_array().copy()).to(self.device)
                       for name, data in feature.tensors.items()}
            rows = self.model.encode_images(**tensors)
            if rows.shape[0] != feature.num_embeds:
                raise ValueError(
                    f"image {feature.identifier[:12]}: the encoder gave {rows.shape[0]} rows "
                    f"for {feature.num_embeds} placeholder tokens")
            self.cache[feature.identifier] = rows
            self.num_encoded += 1

    def bidirectional_spans(self, req_ids: list[str], num_computed: np.ndarray,
                            num_scheduled: np.ndarray) -> dict[int, list[tuple[int, int]]] | None:
        """Request index -> the runs of bidirectional image tokens among its positions of
        the step (AttentionMetadata.bidirectional_spans); None when there are none.

        Example: request 1 computes positions 10..39, its image's soft tokens are 14..29
        -> {1: [(14, 30)]}.
        """
        spans: dict[int, list[tuple[int, int]]] = {}
        for index, (req_id, computed, count) in enumerate(zip(
                req_ids, num_computed.tolist(), num_scheduled.tolist(), strict=True)):
            for feature in self._features.get(req_id, ()):
                if not feature.bidirectional:
                    continue
                first, end = feature.embed_span()
                if first < computed + count and end > computed:
                    spans.setdefault(index, []).append((first, end))
        return spans or None

    def gather(self, req_ids: list[str], num_computed: np.ndarray,
               num_scheduled: np.ndarray) -> StepImageEmbeds | None:
        """The image rows of a step's tokens; None when no token is an image position.

        Request i computes positions [num_computed[i], num_computed[i] + num_scheduled[i])
        as the step's tokens starting at sum(num_scheduled[:i]).

        Worked example: request a (computed 3, 6 tokens: positions 3..8, step tokens
        0..5), image x at offset 5, length 4, is_embed [0, 1, 1, 0] (positions 6, 7):
          overlap        = positions 5..8           -> run indices 0..3
          embed run idx  = [1, 2]                   -> positions [6, 7]
          token_indices  = 0 + ([6, 7] - 3) = [3, 4]
          rows           = cache[x][0:2]            (embeds before run index 1: 0)
        """
        if not self._features:
            return None
        indices: list[np.ndarray] = []
        rows: list[torch.Tensor] = []
        token_start = 0
        for req_id, computed, count in zip(req_ids, num_computed.tolist(),
                                           num_scheduled.tolist(), strict=True):
            end = computed + count
            for feature in self._features.get(req_id, ()):
                if feature.offset >= end:
                    break
                low, high = max(computed, feature.offset), min(end, feature.end)
                if low >= high:
                    continue
                mask = feature.embed_mask()
                run = np.flatnonzero(mask[low - feature.offset:high - feature.offset])
                if not len(run):
                    continue
                first_row = int(mask[:low - feature.offset].sum())
                indices.append(token_start + (low - computed) + run)
                rows.append(self.cache[feature.identifier][first_row:first_row + len(run)])
            token_start += count
        if not indices:
            return None
        return StepImageEmbeds(torch.from_numpy(np.concatenate(indices)).to(self.device),
                               torch.cat(rows))
