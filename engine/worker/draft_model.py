"""The draft model of speculative decoding's `draft_model` method.

A second, smaller checkpoint with the target's tokenizer proposes each drafting
request's next k tokens greedily; the target verifies them as it verifies n-gram drafts.
The scheduler does not know the drafts' values: `Speculator.propose` returns k
placeholders (engine.spec_decode.DRAFT_PLACEHOLDER), the scheduler allocates the 1 + k
slots, and the model runner asks `DraftModel.propose` for the tokens before it builds
the step's inputs.

KV layout: the draft's attention layers have their own cache tensors, indexed by the
target's block ids (the same block table and slot mapping, KV-cache group 0): a block
id is a block in every target layer and in every draft layer, and the KV cache's size
counts both (engine/worker/kv_cache_init.py). No second block manager: allocation,
prefix caching, preemption and rollbacks are the target's.

One step, for a request with k drafts whose last known token x sits at position p
(= its computed tokens):

  drafting  (`propose`, before the target's forward)
            iteration j = 0 .. k - 1 feeds x (j = 0) or draft j - 1 at position p + j,
            writes the draft's K/V at slot p + j, and takes the argmax as draft j
  target    computes positions p .. p + k (tokens x, d0 .. d(k-1)) and verifies
  shadow    (`shadow_forward`, after it) the draft model over every other token of the
            step: prefill chunks, plain decodes, and each drafting request's last row
            (position p + k, token d(k-1), whose K/V drafting did not write); skipped
            in a step where nobody drafts (below)

Invariant: after every step, for every request, the draft cache's slot of each position
q < num_computed_tokens holds the draft model's K/V of the request's token at q. The
step computes the target's positions and writes the draft's K/V of the same tokens at
the same positions (drafting: p .. p + k - 1, shadow: the rest), so what the target
keeps the draft keeps. A rollback keeps the accepted drafts, whose slots drafting wrote
with exactly those tokens; the rejected slots lie at or after num_computed_tokens and
are written again before any query reads them (a forward writes a position's K/V
before it attends over it). Prefix-cache hits and resumed requests read blocks some
earlier step computed, so their draft K/V is there too.

Lazily: a step without drafts (prefill chunks, requests paused by the back-off, batches
wider than `disable_by_batch_size`) runs no shadow pass, so a draft that is rarely used
costs little. `kv_len[req]` is how many leading positions hold the request's draft K/V
(read clamped to its computed tokens: slots past them hold rejected drafts); before a
request drafts, `propose` catches it up over positions kv_len .. p - 1 (one forward,
the request's known tokens, no logits). Once a shadow pass was skipped, a request seen
for the first time is taken to have none (its prefix-cache blocks may have been
computed in such a step): it catches up from position 0, writing into shared blocks the
K/V of the same tokens at the same positions.

Tensor parallelism: every rank holds the whole draft model (it is small) and its whole
KV (its block ids are the target's, so the same blocks), runs it as a group of one
(`whole_model_on_each_rank`: no shards, no collectives) and keeps rank 0's drafts
(broadcast, as the sampled tokens are), so every rank feeds the target the same tokens.

Worked example, block size 4, a request with 8 computed tokens and x at position 8,
k = 3:
  drafting  feeds x at 8 -> d0; d0 at 9 -> d1; d1 at 10 -> d2 (draft K/V of 8, 9, 10)
  target    positions 8..11, tokens [x d0 d1 d2]; shadow writes draft K/V of d2 at 11
  verify    d0 accepted, d1 rejected, t emitted: 10 computed (positions 0..9, x and d0
            at 8 and 9 as both caches hold them); the slots of 10 and 11 are stale
  next step x' = t at position 10: drafting writes 10 first, then 11, ...
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from engine.attention.backends.base import AttentionBackend
from engine.attention.forward_context import set_forward_context
from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import select_attention_backend
from engine.config import SpeculativeConfig
from engine.distributed.parallel_state import get_tp_group, whole_model_on_each_rank
from engine.kv_cache.manager import cdiv
from engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class DraftModel:
    """The draft model, its attention backend and its KV caches (one per layer).

    Contract with the model runner (one step):
      * `propose(batch, num_drafts)` before the target's inputs are built: the draft
        tokens of each drafting request (its K/V of positions p .. p + k - 1 written);
      * `shadow_forward(...)` after the target's forward: the step's other tokens.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, device: torch.device,
                 block_size: int, vocab_limit: int):
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.vocab_limit = vocab_limit  # drafts are token ids below it (both vocabularies)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        # Leading positions of each request whose draft K/V is written (module docstring).
        self.kv_len: dict[str, int] = {}
        self.skipped_a_shadow = False  # then a request seen first has no draft K/V
        # What tests count: drafting iterations, shadow passes and catch-ups run, shadow
        # passes skipped, positions caught up.
        self.num_forwards = 0
        self.num_skipped_shadows = 0
        self.num_caught_up_tokens = 0

    def forget(self, req_id: str) -> None:
        """A finished or preempted request (a resumed one may hold other blocks)."""
        self.kv_len.pop(req_id, None)

    def _valid_len(self, req_id: str, num_computed: int) -> int:
        known = self.kv_len.get(req_id)
        if known is None:
            known = 0 if self.skipped_a_shadow else num_computed
        return min(known, num_computed)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert len(kv_caches) == len(self.attention_layers)
        for layer, cache in zip(self.attention_layers, kv_caches, strict=True):
            layer.kv_cache = cache

    def propose(self, batch: InputBatch, num_drafts: dict[str, int]) -> dict[str, list[int]]:
        """Greedy drafts of `num_drafts[req_id]` tokens for each request in it, whose
        last known token sits at its computed count (a decode); its blocks cover the
        drafts' slots (the scheduler allocated the step's 1 + k).

        Worked example, block size 4: requests a (p 8, k 3) and b (p 5, k 1):
          iteration 0: tokens [x_a, x_b] at positions [8, 5], seq_lens [9, 6] -> [a0, b0]
          iteration 1: b is done; [a0] at 9, seq_lens [10] -> a1
          iteration 2: [a1] at 10 -> a2;  drafts {a: [a0 a1 a2], b: [b0]}
          slot of a's position 9 = block_table[row a, 9 // 4] * 4 + 9 % 4
        """
        req_ids = list(num_drafts)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        counts = np.fromiter(num_drafts.values(), np.int64, len(req_ids))
        start = batch.num_computed_tokens[rows]
        valid = np.fromiter((self._valid_len(r, int(p)) for r, p in zip(req_ids, start, strict=True)),
                            np.int64, len(req_ids))
        behind = np.flatnonzero(valid < start)
        if behind.size:
            self._catch_up(batch, rows[behind], valid[behind], start[behind])
        tokens = batch.token_ids[rows, start]  # each request's token of this iteration
        drafts = np.zeros((len(req_ids), int(counts.max())), dtype=np.int64)
        block_size = self.block_size
        for j in range(drafts.shape[1]):
            active = np.flatnonzero(counts > j)
            active_rows = rows[active]
            positions = start[active] + j
            slot_mapping = (batch.block_table[active_rows, positions // block_size]
                            .astype(np.int64) * block_size + positions % block_size)
            seq_lens = (positions + 1).astype(np.int32)
            max_blocks = cdiv(int(seq_lens.max()), block_size)
            metadata = AttentionMetadata.from_host(
                np.arange(len(active) + 1, dtype=np.int32), seq_lens,
                batch.block_table[active_rows, :max_blocks], slot_mapping, self.device)
            input_ids = torch.from_numpy(tokens[active]).to(self.device)
            with whole_model_on_each_rank(), set_forward_context(metadata, self.backend):
                hidden_states = self.model(input_ids, torch.from_numpy(positions).to(self.device))
                logits = self.model.compute_logits(hidden_states)[:, :self.vocab_limit]
            self.num_forwards += 1
            chosen = logits.argmax(dim=-1).cpu().numpy()
            drafts[active, j] = chosen
            tokens[active] = chosen
        for req_id, p, k in zip(req_ids, start.tolist(), counts.tolist(), strict=True):
            self.kv_len[req_id] = p + k  # drafting wrote p .. p + k - 1
        group = get_tp_group()
        if group.size > 1:  # the same bits on every rank are likely; rank 0's are certain
            drafts = group.broadcast_from_first(
                torch.from_numpy(drafts).to(self.device)).cpu().numpy()  # NCCL: on the GPU
        return {req_id: drafts[i, :counts[i]].tolist() for i, req_id in enumerate(req_ids)}

    def _catch_up(self, batch: InputBatch, rows: np.ndarray, lo: np.ndarray,
                  hi: np.ndarray) -> None:
        """Draft K/V of positions lo[i] .. hi[i] - 1 of the request in batch row rows[i]
        (its known tokens), in one forward.

        Worked example, block size 4: rows [2, 5], lo [0, 6], hi [3, 8]:
          positions [0 1 2 | 6 7], query_start_loc [0, 3, 5], seq_lens [3, 8]
          slot of row 5's position 6 = block_table[5, 1] * 4 + 2
        """
        lengths = hi - lo
        positions = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)])
        token_rows = np.repeat(rows, lengths)
        block_size = self.block_size
        slot_mapping = (batch.block_table[token_rows, positions // block_size].astype(np.int64)
                        * block_size + positions % block_size)
        metadata = AttentionMetadata.from_host(
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), hi.astype(np.int32),
            batch.block_table[rows, :cdiv(int(hi.max()), block_size)], slot_mapping,
            self.device)
        input_ids = torch.from_numpy(batch.token_ids[token_rows, positions]).to(self.device)
        self._forward(input_ids, torch.from_numpy(positions).to(self.device), metadata)
        self.num_caught_up_tokens += int(lengths.sum())

    def shadow_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata, req_ids: list[str],
                       num_drafted: np.ndarray) -> None:
        """After the target's step (`metadata`, in its token order, requests `req_ids`):
        the draft model over each request's tokens but the first `num_drafted[r]` (the
        positions drafting wrote); only the K/V it writes matters. Nothing when no request
        drafted; a request whose draft K/V is behind (kv_len below its computed tokens)
        is left out: it catches up when it next drafts.

        Worked example: query lengths [3, 1, 5, 2] (a prefill chunk, a plain decode, a
        request with 4 drafts: x d0 d1 d2 d3, a request that is behind), num_drafted
        [0, 0, 4, 0]:
          kept tokens     = [0 1 2 | 3 | 8]       (request 2 keeps only d3's row)
          query_start_loc = [0, 3, 4, 5]; seq_lens and block table rows of requests 0-2
        """
        if not num_drafted.any():
            self.skipped_a_shadow = True
            self.num_skipped_shadows += 1
            return
        qsl = metadata.query_start_loc_np
        query_lens = np.diff(qsl)
        computed = metadata.seq_lens_np - query_lens  # each request's tokens before the step
        current = np.fromiter(
            (self._valid_len(r, int(c)) == c for r, c in zip(req_ids, computed, strict=True)),
            bool, len(req_ids))
        for i in np.flatnonzero(current).tolist():
            self.kv_len[req_ids[i]] = int(metadata.seq_lens_np[i])
        skip = np.where(current, num_drafted, query_lens)
        kept_lens = query_lens - skip
        included = np.flatnonzero(kept_lens > 0)
        if not included.size:
            return
        req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        keep = np.flatnonzero(np.arange(int(qsl[-1])) - qsl[req_of_token] >= skip[req_of_token])
        query_start_loc = np.concatenate([[0], np.cumsum(kept_lens[included])]).astype(np.int32)
        keep_index = torch.from_numpy(keep).to(self.device)
        rows = torch.from_numpy(included).to(self.device)
        seq_lens_np = metadata.seq_lens_np[included]  # a new array: backends key plans by it
        shadow = AttentionMetadata(
            num_actual_tokens=len(keep),
            max_query_len=int(kept_lens.max()),
            max_seq_len=int(seq_lens_np.max()),
            query_start_loc=torch.from_numpy(query_start_loc).to(self.device),
            seq_lens=metadata.seq_lens[rows],
            block_table=metadata.block_table[rows],
            slot_mapping=metadata.slot_mapping[keep_index],
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens_np,
        )
        self._forward(input_ids[keep_index], positions[keep_index], shadow)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        with whole_model_on_each_rank(), set_forward_context(metadata, self.backend):
            self.model(input_ids, positions)
        self.num_forwards += 1


def load_draft_model(config: SpeculativeConfig, target_dir: str, target_vocab_size: int,
                     dtype: torch.dtype, device: torch.device, quantization: str,
                     block_size: int, attention_backend: str) -> DraftModel:
    """Load `config.model` like the target (same dtype, device, quantization) after
    checking that its tokenizer is the target's; ValueError with the reason otherwise."""
    from transformers import AutoConfig

    from engine.model_loader import load_model, resolve_model
    from engine.model_loader.source import ModelSourceError

    try:
        draft_dir = resolve_model(config.model).path
    except ModelSourceError as exc:
        reason = str(exc).removeprefix(f"--model {config.model}: ")  # the message names --model
        raise ValueError(f"speculative_config model {config.model}: {reason}") from None
    check_same_vocabulary(target_dir, draft_dir)
    draft_vocab_size = AutoConfig.from_pretrained(draft_dir).get_text_config().vocab_size
    with whole_model_on_each_rank():  # not sharded: each rank holds all of it
        model = load_model(draft_dir, dtype, device, quantization)
    backend = select_attention_backend(attention_backend, device, block_size)
    logger.info("draft model %s: %d attention layers", draft_dir,
                sum(isinstance(m, Attention) for m in model.modules()))
    return DraftModel(model, backend, device, block_size,
                      vocab_limit=min(target_vocab_size, draft_vocab_size))


def check_same_vocabulary(target_dir: str, draft_dir: str) -> None:
    """ValueError unless both tokenizers map the same strings to the same ids and agree
    on EOS (a draft token id must mean the same token to the target)."""
    from transformers import AutoTokenizer

    target = AutoTokenizer.from_pretrained(target_dir)
    draft = AutoTokenizer.from_pretrained(draft_dir)
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sum(draft_vocab.get(token) != index for token, index in target_vocab.items())
        raise ValueError(
            f"speculative_config model {draft_dir}: its tokenizer differs from the target's "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} of the target's "
            "with another id or missing); a draft model needs the target's tokenizer")
    if target.eos_token_id != draft.eos_token_id:
        raise ValueError(f"speculative_config model {draft_dir}: EOS token id "
                         f"{draft.eos_token_id} differs from the target's {target.eos_token_id}")
