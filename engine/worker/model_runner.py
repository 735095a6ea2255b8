"""The model runner: SchedulerOutput in, sampled tokens out.

    execute_model(scheduler_output)
      _update_states   apply the scheduler's diff to the persistent batch
      _prepare_inputs  build input_ids / positions / attention metadata (numpy), and
                       gather the sampling metadata (before the forward: what runs
                       after the lm_head runs in cold caches, so it does little)
      forward          model(input_ids, positions) under the forward context; a pure
                       decode step replays a CUDA graph instead (worker/cuda_graphs.py)
                       (speculative draft_model: the draft model proposes the step's
                       drafts in _prepare_inputs and sees its other tokens after the
                       forward: worker/draft_model.py)
                       (images: the step's new images are encoded first, and their
                       rows replace the token embeddings at their placeholder positions:
                       worker/encoder_runner.py)
      sample           logits of each request's last token -> sampler
      pool             a pooling request (embeddings) pools its prompt's hidden states
                       instead (worker/pooler.py); a pooling model (BERT) only pools
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.attention.backends.base import AttentionBackend
from engine.attention.forward_context import LoRAMapping, set_forward_context
from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.distributed.parallel_state import get_tp_group, whole_model_on_each_rank
from engine.kv_cache.groups import KVCacheGroupSpec
from engine.kv_cache.manager import cdiv
from engine.lora.manager import LoRAModelManager
from engine.openmp import small_ops_on_this_thread
from engine.outputs import Logprobs, ModelRunnerOutput
from engine.pooling_params import PoolingParams
from engine.sample import Sampler, SamplingMetadata, SamplingState, compute_prompt_logprobs
from engine.sample.rejection import DraftVerifier
from engine.sched.output import GrammarBitmask, SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphConfig, DecodeGraphRunner
from engine.worker.draft_model import DraftModel
from engine.worker.encoder_runner import EncoderRunner, StepImageEmbeds
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.pooler import pool_rows


@dataclass
class DraftRows:
    """The logits rows of a step with drafts: each sampling request's last 1 + k tokens
    (worked example in `ModelRunner._draft_rows`). B sampling requests, R logits rows."""

    num_rows: np.ndarray  # [B] 1 + k of each sampling request
    starts: np.ndarray  # [B] its first logits row
    offsets: np.ndarray  # [R] each logits row's index in its request, 0..k
    batch_rows: np.ndarray  # [R] each logits row's row of the persistent batch
    draft_token_ids: np.ndarray  # [R] the draft each row verifies; -1 on a request's last


@dataclass
class ModelInputs:
    """One step's tensors, in the scheduler's batch order."""

    req_ids: list[str]
    row_indices: np.ndarray  # [num_reqs] rows of the persistent batch
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    # KV-cache groups 1..'s metadata (their block tables and slots); empty for one group.
    extra_group_metadata: list[AttentionMetadata]
    # Requests that sample this step (their whole known sequence is now computed).
    sample_req_indices: np.ndarray  # indices into req_ids
    sample_rows: np.ndarray  # their rows of the persistent batch
    # Their sampling inputs, one row per logits row; None when no request samples.
    # Gathered before the forward (which changes nothing they are made of), so the
    # step's sampling after the lm_head does less.
    sampling_metadata: SamplingMetadata | None
    # Token index of each sampling request's last token; None when every token of the
    # step is one (a decode step): the logits rows are the hidden states' rows.
    logits_indices: torch.Tensor | None
    # Speculative decoding (None in a step without drafts): logits_indices then holds
    # each sampling request's last 1 + k tokens.
    drafts: DraftRows | None = None
    # Pooling requests whose whole prompt is this step's (indices into req_ids): they
    # pool their tokens' hidden states and are not among the sampling ones.
    pool_req_indices: list[int] | None = None
    # A cross-encoder's pairs (PoolingParams.token_type_start): each token's type, 0 or 1;
    # None when no request of the step has a second segment.
    token_type_ids: torch.Tensor | None = None
    # Which tokens run under which LoRA adapter; None when all run the base.
    lora: LoRAMapping | None = None
    # The step's tokens at image positions and their encoder rows; None: text only.
    image_embeds: StepImageEmbeds | None = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        decode_graphs: DecodeGraphConfig | None = None,  # None: every step eager
        draft_model: DraftModel | None = None,  # speculative method draft_model
        lora_manager: LoRAModelManager | None = None,  # --enable-lora
    ):
        self.model = model
        self.draft_model = draft_model
        self.lora_manager = lora_manager
        self._lora_ids: dict[str, int] = {}  # requests under an adapter -> its lora_id
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.requests: dict[str, CachedRequestState] = {}
        self.eos_token_ids: dict[str, int | None] = {}
        self._prompt_logprobs_req_ids: set[str] = set()  # requests that want them
        self._pooling_params: dict[str, PoolingParams] = {}  # pooling requests
        # A pooling model (an encoder such as BERT) has no lm_head: it only pools.
        self.is_pooling_model = bool(getattr(model, "is_pooling_model", False))
        # A vision-language model encodes images and keeps their rows (by identifier).
        self.encoder_runner = (EncoderRunner(model, device)
                               if getattr(model, "supports_images", False) else None)
        # Seeded generators of preempted requests, for their resumption: a request that
        # verified drafts drew more than one row of uniforms per token.
        self._preempted_generators: dict[str, torch.Generator] = {}
        self.input_batch = InputBatch(max_num_reqs, max_model_len, self.max_num_blocks_per_req)
        self.sampling_state = SamplingState(max_num_reqs, vocab_size, device)
        self.sampler = Sampler()
        self.draft_verifier = DraftVerifier()
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs = (
            DecodeGraphRunner(decode_graphs, model, backend, device, max_model_len, block_size,
                              self.max_num_blocks_per_req)
            if decode_graphs is not None and decode_graphs.enabled else None
        )

    # ---------------------------------------------------------------- KV cache
    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec] | None) -> None:
        """Tell each attention layer its KV-cache group (engine.kv_cache.groups) and
        keep a block table per group. Several groups run every step eagerly: the decode
        CUDA graphs replay one block table."""
        groups = groups or []
        for group_id, group in enumerate(groups):
            for layer_index in group.layer_indices:
                self.attention_layers[layer_index].kv_group = group_id
        self.input_batch.set_num_extra_groups(max(0, len(groups) - 1))
        if len(groups) > 1:
            self.decode_graphs = None

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give each attention layer its cache tensor, once, in model order; then capture
        the decode CUDA graphs, which read the caches by address.

        The caches come from `kv_cache_init.allocate_kv_caches`: their last block is the
        padding block, which padded decode rows write to.
        """
        assert len(kv_caches) == len(self.attention_layers)
        self.kv_caches = kv_caches  # layers of different KV groups may share one tensor
        for layer, cache in zip(self.attention_layers, kv_caches, strict=True):
            layer.kv_cache = cache
        if self.decode_graphs is not None and kv_caches:
            layer = self.attention_layers[0]
            block_numel = 2 * self.block_size * layer.num_kv_heads * layer.head_size
            self.decode_graphs.set_padding_block(kv_caches[0].numel() // block_numel - 1)
            if self.decode_graphs.config.capture:
                self.decode_graphs.capture()

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward pass of `num_tokens` dummy prompt tokens, before any KV exists."""
        lengths = [self.max_model_len - 1] * (num_tokens // (self.max_model_len - 1))
        if num_tokens % (self.max_model_len - 1):
            lengths.append(num_tokens % (self.max_model_len - 1))
        query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        seq_lens = np.asarray(lengths, dtype=np.int32)
        positions = np.concatenate([np.arange(n) for n in lengths])
        metadata = self._make_metadata(
            query_start_loc, seq_lens, np.zeros((len(lengths), 1), np.int32),
            np.full(num_tokens, -1, np.int64),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.from_numpy(positions).to(self.device)
        with set_forward_context(metadata, self.backend):
            hidden = self.model(input_ids, positions)
        if not self.is_pooling_model:
            self.model.compute_logits(hidden[-len(lengths):])
        if self.draft_model is not None:
            draft = self.draft_model
            with whole_model_on_each_rank(), set_forward_context(metadata, draft.backend):
                hidden = draft.model(input_ids, positions)
                draft.model.compute_logits(hidden[-len(lengths):])

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        encoder_seconds = 0.0
        if scheduler_output.scheduled_encoder_inputs:
            if self.encoder_runner is None:
                raise ValueError("this model takes no images")
            started = time.perf_counter()
            self.encoder_runner.run_encoders(scheduler_output.scheduled_encoder_inputs)
            encoder_seconds = time.perf_counter() - started
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [], encoder_seconds=encoder_seconds)
        inputs = self._prepare_inputs(scheduler_output)
        hidden_states = self._forward(inputs)
        if self.draft_model is not None:
            self._shadow_forward(inputs, scheduler_output.scheduled_spec_decode_tokens)
        prompt_logprobs = self._compute_prompt_logprobs(scheduler_output, inputs, hidden_states)
        if inputs.drafts is not None:
            sampled = self._sample_with_drafts(inputs, hidden_states, scheduler_output.grammar)
        else:
            sampled = self._sample(inputs, hidden_states, scheduler_output.grammar)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(inputs.req_ids)},
            sampled_token_ids=sampled[0],
            logprobs=sampled[1],
            prompt_logprobs=prompt_logprobs,
            pooled=self._pool(inputs, hidden_states),
            encoder_seconds=encoder_seconds,
        )

    def _pool(self, inputs: ModelInputs, hidden_states: torch.Tensor) -> dict[str, list[float]]:
        """req_id -> vector of each pooling request whose prompt this step computed (in
        one step: rows query_start_loc[i] .. query_start_loc[i + 1])."""
        if not inputs.pool_req_indices:
            return {}
        starts = inputs.attn_metadata.query_start_loc_np
        return {
            inputs.req_ids[i]: pool_rows(self.model, hidden_states, int(starts[i]),
                                         int(starts[i + 1]), self._pooling_params[inputs.req_ids[i]])
            for i in inputs.pool_req_indices
        }

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]: a decode graph's replay where one fits."""
        graphs = self.decode_graphs
        if (graphs is not None and inputs.lora is None and inputs.image_embeds is None
                and graphs.fits(inputs.attn_metadata)):
            return graphs.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        group_metadata = ([inputs.attn_metadata, *inputs.extra_group_metadata]
                          if inputs.extra_group_metadata else None)
        with set_forward_context(inputs.attn_metadata, self.backend, group_metadata,
                                 inputs.lora):
            if inputs.image_embeds is not None:
                image = inputs.image_embeds
                embeds = self.model.embed_input_ids(inputs.input_ids)
                embeds.index_copy_(0, image.token_indices, image.embeds.to(embeds.dtype))
                return self.model(inputs.input_ids, inputs.positions, inputs_embeds=embeds)
            if inputs.token_type_ids is not None:
                return self.model(inputs.input_ids, inputs.positions,
                                  token_type_ids=inputs.token_type_ids)
            return self.model(inputs.input_ids, inputs.positions)

    def _shadow_forward(self, inputs: ModelInputs, spec_tokens: dict[str, list[int]]) -> None:
        """The draft model sees the step's tokens but those drafting wrote (their count:
        each drafting request's k), so its K/V covers what the target computed."""
        num_drafted = np.zeros(len(inputs.req_ids), dtype=np.int64)
        if spec_tokens:
            for index, req_id in enumerate(inputs.req_ids):
                drafts = spec_tokens.get(req_id)
                if drafts:
                    num_drafted[index] = len(drafts)
        self.draft_model.shadow_forward(inputs.input_ids, inputs.positions,
                                        inputs.attn_metadata, inputs.req_ids, num_drafted)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff: finished, preempted, new, resumed, new blocks."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.eos_token_ids.pop(req_id, None)
            self._prompt_logprobs_req_ids.discard(req_id)
            self._pooling_params.pop(req_id, None)
            self._lora_ids.pop(req_id, None)
            self._preempted_generators.pop(req_id, None)
            if self.encoder_runner is not None:
                self.encoder_runner.remove_request(req_id)
            self._remove_row(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            generator = self._remove_row(req_id)  # keep its state: it will resume
            if generator is not None:
                self._preempted_generators[req_id] = generator
        if self.lora_manager is not None:
            adapters = [new.lora_request for new in scheduler_output.scheduled_new_reqs
                        if new.lora_request is not None]
            if adapters:
                self.lora_manager.activate(adapters, set(self._lora_ids.values()))
        for new in scheduler_output.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                extra_group_block_ids=[list(ids) for ids in new.extra_group_block_ids],
            )
            self.requests[new.req_id] = state
            self.eos_token_ids[new.req_id] = new.eos_token_id
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs_req_ids.add(new.req_id)
            if new.pooling_params is not None:
                self._pooling_params[new.req_id] = new.pooling_params
            if new.lora_request is not None:
                self._lora_ids[new.req_id] = new.lora_request.lora_id
            if new.mm_features and self.encoder_runner is not None:
                self.encoder_runner.add_request(new.req_id, new.mm_features)
            self._add_row(state)
        if scheduler_output.free_encoder_ids and self.encoder_runner is not None:
            self.encoder_runner.free(scheduler_output.free_encoder_ids)
        if scheduler_output.num_blocks_after_rollback:
            self._cut_block_lists(scheduler_output.num_blocks_after_rollback)
        cached = scheduler_output.scheduled_cached_reqs
        if not cached.req_ids:
            return
        # Most cached requests are decodes with nothing new but their computed count:
        # per-request Python work only for resumed requests and new blocks (one step
        # in block_size); the counts are written as one array.
        requests, req_id_to_row = self.requests, batch.req_id_to_row
        extra = cached.extra_new_block_ids  # several KV groups only
        for index, (req_id, resumed, new_block_ids, num_computed) in enumerate(zip(
                cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids,
                cached.num_computed_tokens, strict=True)):
            if resumed:
                state = requests[req_id]
                state.num_computed_tokens = num_computed
                state.block_ids = list(new_block_ids)
                if extra:
                    state.extra_group_block_ids = [list(ids) for ids in extra[index]]
                self._add_row(state)
            elif new_block_ids:
                state = requests[req_id]
                state.block_ids.extend(new_block_ids)
                if extra:
                    for ids, new_ids in zip(state.extra_group_block_ids, extra[index],
                                            strict=True):
                        ids.extend(new_ids)
                batch.append_block_ids(req_id_to_row[req_id], new_block_ids,
                                       extra[index] if extra else None)
        rows = np.fromiter((req_id_to_row[r] for r in cached.req_ids), np.int64, cached.num_reqs)
        batch.num_computed_tokens[rows] = cached.num_computed_tokens

    def _cut_block_lists(self, num_blocks_after_rollback: dict[str, int]) -> None:
        """Rejected drafts freed some requests' tail blocks: forget them here too."""
        batch = self.input_batch
        for req_id, num_blocks in num_blocks_after_rollback.items():
            state = self.requests.get(req_id)
            if state is None:
                continue
            del state.block_ids[num_blocks:]
            for ids in state.extra_group_block_ids:  # every group's list has one length
                del ids[num_blocks:]
            row = batch.req_id_to_row.get(req_id)
            if row is not None:
                batch.num_blocks[row] = num_blocks

    def _add_row(self, state: CachedRequestState) -> None:
        row = self.input_batch.add_request(state)
        self.sampling_state.add_request(
            row, state.sampling_params, state.prompt_token_ids, state.output_token_ids,
            self.eos_token_ids.get(state.req_id),
            generator=self._preempted_generators.pop(state.req_id, None),
        )

    def _remove_row(self, req_id: str) -> torch.Generator | None:
        """Free the request's row (and what the draft model knows of its KV); returns its
        seeded generator (None if unseeded)."""
        if self.draft_model is not None:
            self.draft_model.forget(req_id)
        row = self.input_batch.remove_request(req_id)
        if row is not None:
            return self.sampling_state.remove_request(row)
        return None

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        batch = self.input_batch
        req_ids = list(scheduler_output.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        num_scheduled = np.fromiter(
            scheduler_output.num_scheduled_tokens.values(), np.int64, len(req_ids)
        )
        # Worked example: three requests scheduling [2, 5, 3] tokens, already
        # computed [0, 7, 20], block_size 2.
        #   cu_num_tokens = [2, 7, 10]
        #   req_indices   = [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]   request of each token
        #   offsets       = [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]   index within its request
        #   positions     = computed[req_indices] + offsets
        #                 = [0, 1, 7, 8, 9, 10, 11, 20, 21, 22]
        #   block number  = block_table[row, position // 2], e.g. request 1's
        #                   position 9 -> its 5th block; slot = block * 2 + 9 % 2
        cu_num_tokens = np.cumsum(num_scheduled)
        total = int(cu_num_tokens[-1])
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_tokens and self.draft_model is not None:
            # The scheduler's drafts are placeholders: the draft model's tokens replace
            # them (its K/V of the drafted positions written on the way).
            spec_tokens = self.draft_model.propose(
                batch, {req_id: len(drafts) for req_id, drafts in spec_tokens.items()})
        if spec_tokens:
            # Drafts sit right after each request's known tokens, where positions read.
            for req_id, drafts in spec_tokens.items():
                row = batch.req_id_to_row[req_id]
                start = batch.num_tokens[row]
                batch.token_ids[row, start:start + len(drafts)] = drafts
        req_indices = np.repeat(np.arange(len(req_ids)), num_scheduled)
        offsets = np.arange(total) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[rows]
        positions = num_computed[req_indices] + offsets
        token_rows = rows[req_indices]
        input_ids = batch.token_ids[token_rows, positions]
        block_indices = positions // self.block_size
        offsets_in_block = positions % self.block_size
        block_numbers = batch.block_table[token_rows, block_indices]
        slot_mapping = block_numbers.astype(np.int64) * self.block_size + offsets_in_block

        seq_lens = (num_computed + num_scheduled).astype(np.int32)
        query_start_loc = np.concatenate([[0], cu_num_tokens]).astype(np.int32)
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        block_table = batch.block_table[rows, :max_blocks]
        metadata = self._make_metadata(query_start_loc, seq_lens, block_table, slot_mapping)
        # Every other KV group: the same tokens, its own blocks (each group's table row
        # of a request is as long as group 0's).
        extra_group_metadata = [
            self._make_metadata(
                query_start_loc, seq_lens, table[rows, :max_blocks],
                table[token_rows, block_indices].astype(np.int64) * self.block_size
                + offsets_in_block)
            for table in batch.extra_block_tables
        ]
        if self.encoder_runner is not None and self.encoder_runner.has_requests:
            spans = self.encoder_runner.bidirectional_spans(req_ids, num_computed, num_scheduled)
            if spans and self.backend.name != "torch":
                raise NotImplementedError(
                    f"images whose tokens attend both ways (Gemma 3) need the torch attention "
                    f"backend; this engine runs {self.backend.name!r}")
            for group in (metadata, *extra_group_metadata):
                group.bidirectional_spans = spans

        # A request samples once every token it knows is computed; a request in the
        # middle of a chunked prefill does not.
        sample_req_indices = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        pool_req_indices = None
        if self._pooling_params:  # pooling requests pool instead of sampling
            pooling = self._pooling_params
            pool_req_indices = [i for i in sample_req_indices.tolist() if req_ids[i] in pooling]
            if pool_req_indices:
                sample_req_indices = np.setdiff1d(sample_req_indices, pool_req_indices)
        token_type_ids = self._token_type_ids(req_ids, req_indices, positions)
        sample_rows = rows[sample_req_indices]
        logits_indices = cu_num_tokens[sample_req_indices] - 1
        drafts = None
        if spec_tokens:
            drafts, logits_indices = self._draft_rows(
                [req_ids[i] for i in sample_req_indices.tolist()], sample_rows, spec_tokens,
                logits_indices)
        sampling_metadata = None
        if len(sample_req_indices):
            sampling_metadata = (
                self.sampling_state.make_metadata(sample_rows) if drafts is None
                else self.sampling_state.make_metadata(drafts.batch_rows, drafts.offsets,
                                                       drafts.draft_token_ids))
        return ModelInputs(
            req_ids=req_ids,
            row_indices=rows,
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=metadata,
            extra_group_metadata=extra_group_metadata,
            sample_req_indices=sample_req_indices,
            sample_rows=sample_rows,
            sampling_metadata=sampling_metadata,
            # The indices increase, so as many as there are tokens are all of them.
            logits_indices=(None if len(logits_indices) == total
                            else torch.from_numpy(logits_indices).to(self.device)),
            drafts=drafts,
            pool_req_indices=pool_req_indices,
            token_type_ids=token_type_ids,
            lora=self._lora_mapping(req_ids, req_indices),
            image_embeds=(self.encoder_runner.gather(req_ids, num_computed, num_scheduled)
                          if self.encoder_runner is not None
                          and self.encoder_runner.has_requests else None),
        )

    def _lora_mapping(self, req_ids: list[str], req_indices: np.ndarray
                      ) -> LoRAMapping | None:
        """The step's tokens by adapter (see LoRAModelManager.mapping); None without any."""
        if not self._lora_ids:
            return None
        ids = np.fromiter((self._lora_ids.get(r, 0) for r in req_ids), np.int64, len(req_ids))
        return self.lora_manager.mapping(ids[req_indices])

    def _token_type_ids(self, req_ids: list[str], req_indices: np.ndarray,
                        positions: np.ndarray) -> torch.Tensor | None:
        """Each token's type for a step with cross-encoder pairs, else None.

        Worked example: requests [a, b], b a pair whose second segment starts at 3,
        req_indices [0, 0, 1, 1, 1, 1, 1], positions [0, 1, 0, 1, 2, 3, 4]
          -> starts per request [inf, 3] -> types [0, 0, 0, 0, 0, 1, 1]
        """
        if not self._pooling_params:
            return None
        starts = np.full(len(req_ids), np.iinfo(np.int64).max, dtype=np.int64)
        for index, req_id in enumerate(req_ids):
            params = self._pooling_params.get(req_id)
            if params is not None and params.token_type_start is not None:
                starts[index] = params.token_type_start
        if not (starts < np.iinfo(np.int64).max).any():
            return None
        types = (positions >= starts[req_indices]).astype(np.int64)
        return torch.from_numpy(types).to(self.device)

    @staticmethod
    def _draft_rows(sample_req_ids: list[str], sample_rows: np.ndarray,
                    spec_tokens: dict[str, list[int]],
                    last_indices: np.ndarray) -> tuple[DraftRows, np.ndarray]:
        """Logits rows of a step with drafts: each sampling request's last 1 + k tokens;
        returns them and their token indices.

        Worked example: last token indices [4, 9] (requests a, b in batch rows [6, 2]),
        a has drafts [7, 8]:
          num_rows        = [3, 1];  starts = [0, 3]
          offsets         = [0, 1, 2, 0]
          logits_indices  = [2, 3, 4, 9]        (last - k .. last for each request)
          batch_rows      = [6, 6, 6, 2]
          draft_token_ids = [7, 8, -1, -1]      (row i verifies draft i; the last row none)
        """
        drafts = [spec_tokens.get(req_id, ()) for req_id in sample_req_ids]
        num_rows = np.fromiter((len(d) + 1 for d in drafts), np.int64, len(drafts))
        total = int(num_rows.sum())
        starts = np.cumsum(num_rows) - num_rows
        offsets = np.arange(total) - np.repeat(starts, num_rows)
        logits_indices = np.repeat(last_indices - num_rows + 1, num_rows) + offsets
        draft_token_ids = np.full(total, -1, dtype=np.int64)
        for start, draft in zip(starts.tolist(), drafts, strict=True):
            draft_token_ids[start:start + len(draft)] = draft
        rows = DraftRows(num_rows, starts, offsets, np.repeat(sample_rows, num_rows),
                         draft_token_ids)
        return rows, logits_indices

    def _make_metadata(self, query_start_loc, seq_lens, block_table, slot_mapping):
        return AttentionMetadata.from_host(query_start_loc, seq_lens, block_table,
                                           slot_mapping, self.device)

    def _compute_logits(self, inputs: ModelInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of the step's sampling rows [rows, vocab]."""
        if inputs.logits_indices is not None:
            hidden_states = hidden_states.index_select(0, inputs.logits_indices)
        return self.model.compute_logits(hidden_states)

    def _sample(
        self, inputs: ModelInputs, hidden_states: torch.Tensor,
        grammar: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], dict[str, Logprobs]]:
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        if len(inputs.sample_req_indices) == 0:
            return sampled_token_ids, {}
        logits = self._compute_logits(inputs, hidden_states)
        sample_rows, metadata = inputs.sample_rows, inputs.sampling_metadata
        with small_ops_on_this_thread(logits):
            if grammar is not None:
                self._set_grammar_rows(metadata, grammar, inputs)
            output = self.sampler(logits, metadata)
        sampled = output.sampled_token_ids
        sampled = sampled.numpy() if sampled.is_cpu else sampled.cpu().numpy()
        # Bookkeeping of the sampled tokens, for all rows at once (rows are distinct):
        # each token goes to its row's next position and the sampling state's counts.
        batch = self.input_batch
        batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = sampled
        batch.num_tokens[sample_rows] += 1
        self.sampling_state.append_output_tokens(sample_rows, sampled)
        token_ids = sampled.tolist()
        sample_req_indices = inputs.sample_req_indices.tolist()
        req_ids, requests = inputs.req_ids, self.requests
        for req_index, token_id in zip(sample_req_indices, token_ids, strict=True):
            sampled_token_ids[req_index] = [token_id]
            requests[req_ids[req_index]].output_token_ids.append(token_id)
        logprobs: dict[str, Logprobs] = {}
        lp = output.logprobs
        if lp is None:
            return sampled_token_ids, logprobs
        lp_token_ids, lp_values, lp_ranks = (
            lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        )
        for i, req_index in enumerate(sample_req_indices):
            req_id = req_ids[req_index]
            num_logprobs = requests[req_id].sampling_params.logprobs
            if num_logprobs is not None:
                logprobs[req_id] = Logprobs(
                    token_ids=[lp_token_ids[i][: 1 + num_logprobs]],
                    logprobs=[lp_values[i][: 1 + num_logprobs]],
                    ranks=[lp_ranks[i]],
                )
        return sampled_token_ids, logprobs

    def _sample_with_drafts(
        self, inputs: ModelInputs, hidden_states: torch.Tensor,
        grammar: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], dict[str, Logprobs]]:
        """`_sample` for a step with drafts: each sampling request gets its accepted
        drafts and one more token (engine/sample/rejection.py); requests without drafts
        one token, from the same distribution as `_sample`'s."""
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        if len(inputs.sample_req_indices) == 0:
            return sampled_token_ids, {}
        logits = self._compute_logits(inputs, hidden_states)
        metadata, drafts = inputs.sampling_metadata, inputs.drafts
        num_rows, starts = drafts.num_rows, drafts.starts
        with small_ops_on_this_thread(logits):
            if grammar is not None:
                self._set_grammar_rows(metadata, grammar, inputs)
            verified = self.draft_verifier(logits, metadata, drafts.draft_token_ids, num_rows)
        emitted, num_accepted = verified.emitted_token_ids, verified.num_accepted
        tp_group = get_tp_group()
        if tp_group.size > 1:  # rank 0's random draws decide, as with FirstRankSampler
            both = torch.from_numpy(np.concatenate([emitted, num_accepted])).to(self.device)
            both = tp_group.broadcast_from_first(both).cpu().numpy()
            emitted, num_accepted = both[:len(emitted)], both[len(emitted):]
        num_emitted = num_accepted + 1
        # Bookkeeping, as in `_sample`, of all emitted tokens at once. Worked example:
        # batch_rows [4, 4, 4, 9] (num_rows [3, 1]), offsets [0, 1, 2, 0], num_emitted [2, 1]:
        #   emitted rows = offsets < [2, 2, 2, 1] = [T, T, F, T]
        #   batch row 4 gets its 2 tokens at num_tokens[4] + [0, 1], row 9 one token.
        is_emitted = drafts.offsets < np.repeat(num_emitted, num_rows)
        rows, token_ids = drafts.batch_rows[is_emitted], emitted[is_emitted]
        batch = self.input_batch
        batch.token_ids[rows, batch.num_tokens[rows] + drafts.offsets[is_emitted]] = token_ids
        batch.num_tokens[inputs.sample_rows] += num_emitted
        self.sampling_state.append_output_tokens(rows, token_ids)
        token_id_list = token_ids.tolist()
        req_ids, requests = inputs.req_ids, self.requests
        lp = verified.logprobs
        lp_lists = (lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()) \
            if lp is not None else None
        logprobs: dict[str, Logprobs] = {}
        first_token = 0  # of the request, in token_id_list
        for i, req_index in enumerate(inputs.sample_req_indices.tolist()):
            start, count = int(starts[i]), int(num_emitted[i])
            token_ids = token_id_list[first_token:first_token + count]
            first_token += count
            sampled_token_ids[req_index] = token_ids
            state = requests[req_ids[req_index]]
            state.output_token_ids.extend(token_ids)
            num_logprobs = state.sampling_params.logprobs
            if lp_lists is not None and num_logprobs is not None:
                end = start + count
                logprobs[state.req_id] = Logprobs(
                    token_ids=[row[:1 + num_logprobs] for row in lp_lists[0][start:end]],
                    logprobs=[row[:1 + num_logprobs] for row in lp_lists[1][start:end]],
                    ranks=lp_lists[2][start:end],
                )
        return sampled_token_ids, logprobs

    @staticmethod
    def _set_grammar_rows(metadata: SamplingMetadata, grammar: GrammarBitmask,
                          inputs: ModelInputs) -> None:
        """Point each constrained request's mask rows at its logits rows: one each in a
        step without drafts (sampling request i's row is i), 1 + k consecutive rows in a
        step with drafts (GrammarBitmask's contract). The scheduler sends masks only for
        requests that sample: normally all of them.

        Worked example: sampling requests a (drafts [7, 8]), b (none), c (drafts [5]):
          logits rows  a a a b c c              -> a starts at 0, b at 3, c at 4
          grammar.req_ids [c, a], num_rows [2, 3]: bitmask rows c c a a a
          grammar_rows = [4, 5, 0, 1, 2]; grammar_bitmask = bitmask rows [0, 1, 2, 3, 4]
        """
        if inputs.drafts is not None:
            num_rows, starts = inputs.drafts.num_rows, inputs.drafts.starts
        else:
            starts = np.arange(len(inputs.sample_req_indices))
            num_rows = np.ones_like(starts)
        rows_of = {inputs.req_ids[r]: (int(starts[i]), int(num_rows[i]))
                   for i, r in enumerate(inputs.sample_req_indices)}
        counts = grammar.num_rows or [1] * len(grammar.req_ids)
        logits_rows: list[int] = []
        mask_rows: list[int] = []
        offset = 0
        for req_id, count in zip(grammar.req_ids, counts, strict=True):
            found = rows_of.get(req_id)
            if found is not None:  # normally every constrained request samples
                start, num = found
                if num != count:
                    raise ValueError(f"request {req_id} has {num} logits rows but {count} "
                                     "grammar mask rows")
                logits_rows.extend(range(start, start + num))
                mask_rows.extend(range(offset, offset + num))
            offset += count
        if logits_rows:
            metadata.grammar_rows = logits_rows
            metadata.grammar_bitmask = (grammar.bitmask if len(mask_rows) == offset
                                        else grammar.bitmask[mask_rows])

    def _compute_prompt_logprobs(
        self, scheduler_output: SchedulerOutput, inputs: ModelInputs, hidden_states: torch.Tensor
    ) -> dict[str, Logprobs]:
        """Logprobs of each prompt token given the ones before it (chunk by chunk).

        For a chunk covering prompt positions [s, e), position p predicts token p+1,
        so targets are prompt[s+1 : e+1] (the last prompt position predicts nothing).
        """
        result: dict[str, Logprobs] = {}
        if not self._prompt_logprobs_req_ids:
            return result  # the common step: nobody asked for them
        qsl = inputs.attn_metadata.query_start_loc_np
        for index, req_id in enumerate(inputs.req_ids):
            if req_id not in self._prompt_logprobs_req_ids:
                continue
            state = self.requests[req_id]
            num_top = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start_pos = int(self.input_batch.num_computed_tokens[inputs.row_indices[index]])
            if num_top is None or start_pos >= num_prompt - 1:
                continue
            end_pos = min(start_pos + int(qsl[index + 1] - qsl[index]), num_prompt - 1)
            token_start = int(qsl[index])
            hidden = hidden_states[token_start : token_start + end_pos - start_pos]
            targets = torch.tensor(
                state.prompt_token_ids[start_pos + 1 : end_pos + 1], device=self.device
            )
            tensors = compute_prompt_logprobs(self.model.compute_logits(hidden), targets, num_top)
            result[req_id] = Logprobs(
                token_ids=tensors.token_ids.tolist(),
                logprobs=tensors.logprobs.tolist(),
                ranks=tensors.ranks.tolist(),
            )
        return result
