"""The continuous-batching scheduler.

There are no prefill and decode phases. Each request has `num_computed_tokens`;
each step the scheduler gives every request up to
`num_tokens - num_computed_tokens` new tokens within the step's token budget
(`max_num_batched_tokens`) and seat budget (`max_num_seqs`). A long prompt is thus
prefilled in chunks, and decodes (one new token each) share steps with prefills.

    step:  running requests first (in order)  ->  then waiting requests (queue order)
           allocate_slots() fails?  -> preempt the lowest-priority running request
                                       (free its blocks, reset it, FRONT of waiting);
                                       admit no waiting request this step.
           a waiting request does not fit (no seat or no KV blocks)?
                                    -> fcfs: it waits.  priority: preempt running
                                       requests of strictly lower priority (highest
                                       value, latest arrival first) until it fits.

Structured outputs (engine/structured_output/): a constrained request waits in
`waiting_for_grammar` until its grammar is compiled (off the step loop), then joins
the waiting queue; each step fills the next-token bitmask of the constrained requests
that sample (SchedulerOutput.grammar) and advances their matchers with the tokens
they keep. A constrained request's drafts are cut where its grammar refuses them, and
it gets one mask row per verified position. Unconstrained steps skip all of it.

Images (engine/multimodal/): a request whose next tokens reach an image's placeholder run
gets that image encoded in the same step, under a per-step encoder budget, unless the
encoder cache holds it already (engine/sched/encoder_cache.py); an image that does not
fit makes the request stop its step's tokens just before it. Text-only steps skip it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_hash import BlockHasher, get_hash_fn
from engine.kv_cache.groups import KVCacheGroupSpec
from engine.kv_cache.manager import KVCacheManager
from engine.multimodal.inputs import ImageFeature
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerStats
from engine.request import EngineCoreRequest, Request, RequestStatus
from engine.sched.encoder_cache import (
    EncoderCacheManager,
    EncoderPlan,
    commit_encoder_plan,
    plan_encoder_inputs,
    release_computed_images,
)
from engine.sched.output import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)
from engine.sched.request_queue import make_request_queue
from engine.spec_decode import Speculator
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_cache_groups: list[KVCacheGroupSpec] | None = None,
        max_loras: int = 0,  # --enable-lora: most adapters in one step (0: no adapters)
    ):
        if (
            not scheduler_config.enable_chunked_prefill
            and scheduler_config.max_num_batched_tokens < scheduler_config.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens "
                f"({scheduler_config.max_num_batched_tokens}) must be at least max_model_len "
                f"({scheduler_config.max_model_len}), or long prompts could never run"
            )
        self.config = scheduler_config
        self.max_loras = max_loras
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        # One group unless the model mixes full and sliding-window attention: the
        # manager then answers for every group (engine.kv_cache.groups).
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            kv_cache_groups,
        )
        self.block_hasher = (
            BlockHasher(cache_config.block_size, get_hash_fn(cache_config.prefix_caching_hash_algo))
            if cache_config.enable_prefix_caching
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner must forget them.
        self.finished_req_ids: set[str] = set()
        self._num_preemptions_since_stats = 0
        self._scheduled_times: dict[str, float] = {}
        # Structured outputs: None when this engine cannot constrain (constrained
        # requests are then refused). Requests compiling their grammar, those admitted
        # with one, and the error outputs of those whose compile failed.
        self.structured_output = structured_output
        self.waiting_for_grammar: list[Request] = []
        self._constrained_req_ids: set[str] = set()
        self._grammar_failures: list[EngineCoreOutput] = []
        # Speculative decoding (None: off, and the step loop never looks at drafts).
        # A draft needs the request's last token: with async scheduling the core runs
        # a step synchronously whenever `may_draft()` (EngineCore.step).
        self.speculator = Speculator(speculative_config) if speculative_config else None
        self.spec_max_running = (speculative_config.disable_by_batch_size
                                 if speculative_config else 0)
        # req_id -> block count after a rollback freed tail blocks, for the next step.
        self._num_blocks_after_rollback: dict[str, int] = {}
        # Images: encoder outputs the runner holds (embedding rows) and the step's budget.
        self.encoder_cache = EncoderCacheManager(
            scheduler_config.encoder_cache_size or scheduler_config.max_num_batched_tokens)
        self.encoder_budget = (scheduler_config.max_num_encoder_input_tokens
                               or scheduler_config.max_num_batched_tokens)
        self._encoder_cache_hits = 0  # since the last stats

    # ------------------------------------------------------------------ requests
    def add_request(self, core_request: EngineCoreRequest) -> Request:
        """Queue a validated request. The frontend has checked its length already."""
        request = Request.from_engine_core_request(core_request, self.block_hasher)
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        # A pooling prompt may fill the context (no token follows it); it is computed in
        # one step, so it must also fit the step's token budget.
        pooling = request.pooling_params is not None
        if request.num_prompt_tokens >= self.max_model_len + pooling:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens does not fit max_model_len "
                f"{self.max_model_len}"
            )
        if pooling and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"a pooling prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_num_batched_tokens {self.config.max_num_batched_tokens} (it is "
                "computed in one step)")
        for feature in request.mm_features:
            first, end = feature.embed_span() if feature.bidirectional else (0, 0)
            if end - first > self.config.max_num_batched_tokens:
                raise ValueError(
                    f"an image of {end - first} tokens that attend to each other must be "
                    f"computed in one step, but max_num_batched_tokens is "
                    f"{self.config.max_num_batched_tokens}")
        if request.lora_request is not None and not self.max_loras:
            raise ValueError(f"request {request.req_id!r} names LoRA adapter "
                             f"{request.lora_request.name!r}, but adapters need --enable-lora "
                             "(it would wait for an adapter slot forever)")
        # A request can grow to max_model_len, and never beyond the whole KV cache
        # (only a test-sized cache is smaller than max_model_len): past that it could
        # only preempt itself forever.
        num_cache_tokens = self.kv_cache_manager.num_tokens_fit(
            min(self.config.max_num_batched_tokens, self.max_model_len))
        if request.num_prompt_tokens >= num_cache_tokens:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens does not fit the KV cache "
                f"({num_cache_tokens} tokens)"
            )
        room = min(self.max_model_len, num_cache_tokens) - request.num_prompt_tokens
        request.max_tokens = min(request.max_tokens or room, room)
        params = request.sampling_params
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured outputs are not available in this engine")
            stop_token_ids = list(params.stop_token_ids)
            if request.eos_token_id is not None:
                stop_token_ids.insert(0, request.eos_token_id)
            request.grammar = self.structured_output.submit(params.structured_outputs,
                                                            stop_token_ids)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.requests[request.req_id] = request
            self.waiting_for_grammar.append(request)
            self._admit_compiled()  # a cached grammar is ready at once
            return request
        self.requests[request.req_id] = request
        self.waiting.add(request)
        return request

    def _admit_compiled(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail failed ones."""
        compiling = []
        for request in self.waiting_for_grammar:
            grammar = request.grammar
            if not self.structured_output.poll(grammar):
                compiling.append(request)
            elif grammar.error is not None:
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                self._grammar_failures.append(
                    EngineCoreOutput(request.req_id, [], "error", error=grammar.error))
            else:
                request.status = RequestStatus.WAITING
                self._constrained_req_ids.add(request.req_id)
                self.waiting.add(request)
        self.waiting_for_grammar = compiling

    def take_grammar_failures(self) -> list[EngineCoreOutput]:
        """Error outputs of requests whose grammar failed to compile, since the last call."""
        failures, self._grammar_failures = self._grammar_failures, []
        return failures

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[str]:
        """Finish (typically abort) requests wherever they are; frees their blocks.

        Unknown or already finished ids are ignored. Returns the ids finished here.
        """
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request, discard_cached=status == RequestStatus.FINISHED_ERROR)
            finished.append(req_id)
        return finished

    def _free_request(self, request: Request, discard_cached: bool = False) -> None:
        self.kv_cache_manager.free(request, discard_cached)
        if request.mm_features:
            release_computed_images(self.encoder_cache, request, everything=True)
        if self.speculator is not None:
            self.speculator.finish(request)
            self._num_blocks_after_rollback.pop(request.req_id, None)
        self.finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]
        self._scheduled_times.pop(request.req_id, None)
        if request.grammar is not None:
            request.grammar = None  # frees its matcher
            self._constrained_req_ids.discard(request.req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_grammar)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_grammar)

    def may_draft(self) -> bool:
        """Whether the next schedule() may give some running request drafts: few enough
        run (`disable_by_batch_size`) and one of them may speculate. Async scheduling
        then waits for the steps in flight (a request with a token still to come, a
        placeholder, is never given drafts)."""
        speculator = self.speculator
        return (speculator is not None and 0 < len(self.running) <= self.spec_max_running
                and any(speculator.may_propose(r) for r in self.running))

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: which requests compute how many tokens, into which blocks.

        Contract: the step fits `max_num_batched_tokens` tokens and `max_num_seqs`
        requests. Running requests come first, in order (`_schedule_running`), then
        waiting ones in queue order (`_schedule_waiting`); a step that had to preempt a
        running request for KV room admits no waiting request. When this returns, the
        scheduled tokens count as computed (`_count_scheduled_as_computed`) and the
        finished ids it reports are forgotten.

        Worked example (budget 8 tokens, room in the KV cache, fcfs): running A and B
        decode, waiting C has a 10-token prompt ->
            running phase:  A 1, B 1              (budget 8 -> 6)
            waiting phase:  C 6, its first chunk  (budget 6 -> 0; C computes 4 more next step)
            num_scheduled_tokens {A: 1, B: 1, C: 6}, 8 tokens in all.
        """
        if self.waiting_for_grammar:
            self._admit_compiled()
        step = _StepPlan(self.config.max_num_batched_tokens, self.encoder_budget)
        self._schedule_running(step)
        if not step.preempted:  # a step that preempted for room admits nobody
            self._schedule_waiting(step)
        output = self._make_output(step)
        if self.speculator is not None:
            output.scheduled_spec_decode_tokens = step.spec_tokens
            output.num_blocks_after_rollback = self._num_blocks_after_rollback
            self._num_blocks_after_rollback = {}
        self._count_scheduled_as_computed(step.num_scheduled_tokens)
        if step.with_images:
            for req_id in step.num_scheduled_tokens:
                release_computed_images(self.encoder_cache, self.requests[req_id])
        self.finished_req_ids = set()
        return output

    def _schedule_running(self, step: _StepPlan) -> None:
        """Give each running request, in order, the tokens it still lacks and the blocks
        for them, until the budget is spent.

        Contract: a decode gets 1 token (plus its drafts, when it speculates), a prefill
        the rest of its prompt up to the budget; no request computes a position at or
        beyond max_model_len. When the KV cache has no room for a request, its drafts
        go first, then running requests are preempted by the victim rule
        (`_preemption_victim`) one at a time until it fits; once the victim is the
        request itself, nothing after it runs this step. A victim the step had already
        scheduled (priority policy only) gives its tokens back. Skipped, but keeping
        their seats: a request with nothing to compute, and (async scheduling) one
        whose unknown last token may be its last or is needed by its grammar.

        Worked example (budget 8 tokens): running A decodes, B has 10 prompt tokens left
            -> A 1, B 7 (budget 0).
        Preemption (fcfs, KV cache full, each of running A, B, C needs a new block):
            A does not fit -> C, the last, is preempted (blocks freed, front of waiting);
            A and B now fit -> A 1, B 1; C waits, and no waiting request is admitted.
        """
        speculator = self.speculator
        if speculator is not None and len(self.running) > self.spec_max_running:
            speculator = None  # a wide batch: one more token per request costs more than it saves
        allocate_slots = self.kv_cache_manager.allocate_slots
        last_position = self.max_model_len - 1  # never compute a position at or beyond it
        running = self.running
        index = 0
        while index < len(running) and step.token_budget > 0:
            request = running[index]
            num_placeholders = request.num_output_placeholders
            if num_placeholders and not self._may_run_ahead(request):
                index += 1
                continue
            num_computed = request.num_computed_tokens
            num_new_tokens = min(
                len(request.all_token_ids) + num_placeholders - num_computed,
                step.token_budget,
                last_position - num_computed,
            )
            plan = None
            if request.mm_features and num_new_tokens > 0:
                plan = self._plan_encoder(step, request, num_computed, num_new_tokens)
                num_new_tokens = plan.num_new_tokens
            if num_new_tokens <= 0:
                index += 1
                continue
            drafts = None
            if (speculator is not None and num_new_tokens == 1 and not num_placeholders
                    and num_computed == len(request.all_token_ids) - 1):
                drafts = self._propose_drafts(speculator, request, step.token_budget)
                num_new_tokens += len(drafts)
            while (new_blocks := allocate_slots(request, num_new_tokens)) is None:
                if drafts:  # no room for the drafts: decode normally first
                    drafts = None
                    num_new_tokens = 1
                    continue
                victim = self._preemption_victim()
                if running.index(victim) < index:
                    # It stood before `request` (scheduled this step, or skipped), so
                    # `request` and everything after it move up one.
                    index -= 1
                self._preempt_in_step(step, victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # `request` itself was preempted; nothing lower is left to run
            step.add_running(request, num_new_tokens, new_blocks, drafts)
            if plan is not None:
                self._commit_encoder(step, plan, request)
            index += 1

    def _propose_drafts(self, speculator: Speculator, request: Request,
                        token_budget: int) -> list[int]:
        """A decode's drafts: as many as fit the budget, the model length and max_tokens
        (the bonus token counts: k drafts emit up to k + 1), cut where the request's
        grammar refuses them.

        Example: budget 3, max_model_len far, max_tokens 10 with 8 output tokens ->
        at most min(3 - 1, ..., 10 - 8 - 1) = 1 draft.
        """
        num_computed = request.num_computed_tokens
        drafts = speculator.propose(request, min(
            token_budget - 1, self.max_model_len - 1 - num_computed - 1,
            request.max_tokens - request.num_output_tokens - 1))
        if drafts and request.grammar is not None:
            kept = request.grammar.valid_draft(drafts)  # cut where it is refused
            speculator.record_grammar_cut(len(drafts) - len(kept))
            drafts = kept
        return drafts

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Admit waiting requests in queue order while the budget and the seats last.

        Contract: a request computes only what its longest cached prefix lacks
        (`get_computed_blocks`), up to the budget; without chunked prefill it computes
        all of that or waits, and so does everything behind it. A request without a
        seat or without KV blocks waits (fcfs), or (priority policy) preempts running
        requests of strictly lower priority, one at a time, until it fits; from the
        first such preemption on, only requests that outrank every victim are admitted.

        Worked example (budget 6 after the running phase, blocks of 4 tokens, fcfs):
            waiting C has a 10-token prompt whose first block (4 tokens) is cached
            -> C computes tokens 4..9: 6 tokens (budget 0); D behind it waits.
        Priority (max_num_seqs 2; running A p0 and B p3, each given 1 token; waiting C p1):
            no seat -> victim B (p3 > p1): preempted, its token back in the budget;
            C is admitted; B, back in waiting, does not outrank itself: the loop stops.
        """
        waiting, running = self.waiting, self.running
        # Requests whose LoRA adapter has no slot this step step aside (in order) and
        # keep their place; the others behind them may run.
        adapters = ({r.lora_request.lora_id for r in running if r.lora_request is not None}
                    if self.max_loras else set())
        no_slot: list[Request] = []
        while len(waiting) > 0 and step.token_budget > 0:
            request = waiting.peek()
            if step.preempted and request.priority >= min(v.priority for v in step.preempted):
                break  # after preempting, only requests that outrank every victim jump in
            lora = request.lora_request
            if lora is not None and lora.lora_id not in adapters:
                if len(adapters) >= self.max_loras:
                    no_slot.append(waiting.pop())
                    continue
            if len(running) < self.config.max_num_seqs:
                if request.pooling_params is None:
                    computed_blocks, num_computed = \
                        self.kv_cache_manager.get_computed_blocks(request)
                else:  # pooling reads every token's hidden state: it computes them all
                    computed_blocks, num_computed = None, 0
                num_new_tokens = request.num_tokens - num_computed
                if num_new_tokens > step.token_budget and (
                        not self.config.enable_chunked_prefill
                        or request.pooling_params is not None):
                    break  # it must be computed whole, and does not fit this step
                num_new_tokens = min(num_new_tokens, step.token_budget)
                plan = None
                if request.mm_features:
                    plan = self._plan_encoder(step, request, num_computed, num_new_tokens)
                    num_new_tokens = plan.num_new_tokens
                    if num_new_tokens == 0:
                        break  # its next image waits for encoder room; so do those behind
                if self.kv_cache_manager.allocate_slots(
                        request, num_new_tokens, computed_blocks, num_computed) is not None:
                    self._admit(step, request, num_computed, num_new_tokens)
                    if plan is not None:
                        self._commit_encoder(step, plan, request)
                    if lora is not None:
                        adapters.add(lora.lora_id)
                    continue
            # No seat, or no KV blocks: preempt a running request it outranks, then look
            # its prefix up again (the victim's blocks may be gone); or it waits.
            victim = self._preemption_victim(outranking=request)
            if victim is None:
                break
            self._preempt_in_step(step, victim)
        for request in reversed(no_slot):
            waiting.add_preempted(request)

    def _admit(self, step: _StepPlan, request: Request, num_computed: int,
               num_new_tokens: int) -> None:
        """Move `request`, the head of `waiting`, to `running`: new, or resumed after a
        preemption; its `num_computed` cached tokens count as computed and
        `num_new_tokens` more are scheduled."""
        self.waiting.pop()
        self.running.append(request)
        if request.status == RequestStatus.PREEMPTED:
            step.scheduled_resumed.append(request)
        else:
            step.scheduled_new.append(request)
            request.num_cached_tokens = num_computed
            self._scheduled_times[request.req_id] = time.time()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        step.num_scheduled_tokens[request.req_id] = num_new_tokens
        step.token_budget -= num_new_tokens

    def _plan_encoder(self, step: _StepPlan, request: Request, start: int,
                      num_new_tokens: int) -> EncoderPlan:
        return plan_encoder_inputs(self.encoder_cache, request, start, num_new_tokens,
                                   step.encoder_budget,
                                   step.encoder_budget == self.encoder_budget)

    def _commit_encoder(self, step: _StepPlan, plan: EncoderPlan, request: Request) -> None:
        """`request` got its tokens: its images are held for it, the new ones encoded."""
        rows, hits = commit_encoder_plan(self.encoder_cache, plan, request.req_id)
        step.encoder_budget -= rows
        step.encoder_inputs.extend(plan.to_encode)
        step.with_images = True
        self._encoder_cache_hits += hits

    def _count_scheduled_as_computed(self, num_scheduled_tokens: dict[str, int]) -> None:
        """The scheduled tokens count as computed from now on: the runner computes them
        before any later step. With async scheduling, a request that samples in this
        step gets a placeholder for that token until update_from_output appends it;
        the next schedule() may already compute its position (the runner has the
        token by then: steps run in order).

        Example (async): 5 tokens, 4 computed, 1 scheduled -> 5 computed, 1 placeholder;
        the next step may schedule position 5 before the sampled token is known.
        """
        requests = self.requests
        if self.config.async_scheduling:
            for req_id, num_tokens in num_scheduled_tokens.items():
                request = requests[req_id]
                request.num_computed_tokens += num_tokens
                if (request.pooling_params is None and request.num_computed_tokens
                        >= len(request.all_token_ids) + request.num_output_placeholders):
                    request.num_output_placeholders += 1
        else:
            for req_id, num_tokens in num_scheduled_tokens.items():
                requests[req_id].num_computed_tokens += num_tokens

    def _may_run_ahead(self, request: Request) -> bool:
        """Async scheduling: may `request`, whose last sampled token is not known yet,
        be scheduled for the next position already? Not if that token may be its last
        (max_tokens), nor with a grammar (its mask needs that token)."""
        return (request.grammar is None
                and request.num_output_tokens + request.num_output_placeholders
                < request.max_tokens)

    # ------------------------------------------------------------------ preemption
    def _preemption_victim(self, outranking: Request | None = None) -> Request | None:
        """The victim rule: the running request to preempt when room is short.

        The lowest-priority running request: under the priority policy the highest
        `priority` value, then the latest arrival; under fcfs the last in `running`.
        For a waiting request `outranking` that wants room: only under the priority
        policy, and only a victim of strictly lower priority; else None. The victim
        stays in `running` (`_preempt_in_step` takes it out).

        Example (priority): running A (p0, arrived 1), B (p2, 2), C (p2, 3) -> C;
        for a waiting D of p2 -> None (none is strictly lower), of p1 -> C.
        """
        running = self.running
        if self.config.policy != "priority":
            return running[-1] if outranking is None and running else None
        if not running:
            return None
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        if outranking is not None and victim.priority <= outranking.priority:
            return None
        return victim

    def _preempt_in_step(self, step: _StepPlan, victim: Request) -> None:
        """Preempt `victim` for room in this step: out of `running`, out of what the
        step has scheduled so far (its tokens back in the budget; only under the
        priority policy can a victim already be in the step, or stand before the
        request that needs the room), reset to waiting (`_preempt`), recorded as
        preempted."""
        running = self.running
        if victim is running[-1]:
            running.pop()
        else:
            running.remove(victim)
        step.take_back(victim)
        self._preempt(victim)
        step.preempted.append(victim)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, reset progress, front of waiting.

        The caller has taken `request` out of `running`. Runs before this step's tokens
        count as computed, so `num_computed_tokens` is what is written; blocks hashed
        for this step's tokens lose their hashes.
        """
        self.kv_cache_manager.free(request, num_written_tokens=request.num_computed_tokens)
        if request.mm_features:
            release_computed_images(self.encoder_cache, request, everything=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions_since_stats += 1
        self.waiting.add_preempted(request)

    # ------------------------------------------------------------------ output
    def _make_output(self, step: _StepPlan) -> SchedulerOutput:
        """The step's plan for the runner: new requests in full, running and resumed
        ones as a diff, in batch order (running, resumed, new)."""
        manager = self.kv_cache_manager
        scheduled_new = step.scheduled_new
        scheduled_resumed = step.scheduled_resumed
        scheduled_running = step.scheduled_running
        num_scheduled_tokens = step.num_scheduled_tokens
        new_block_ids = step.new_block_ids
        new_reqs = [
            NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=manager.get_block_ids(r.req_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_id=r.eos_token_id,
                extra_group_block_ids=manager.get_extra_group_block_ids(r.req_id),
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
                mm_features=r.mm_features or None,
            )
            for r in scheduled_new
        ]
        resumed_block_ids = [manager.get_block_ids(r.req_id) for r in scheduled_resumed]
        cached = CachedRequestData(
            req_ids=[r.req_id for r in scheduled_running]
            + [r.req_id for r in scheduled_resumed],
            resumed_from_preemption=[False] * len(scheduled_running)
            + [True] * len(scheduled_resumed),
            new_block_ids=[new_block_ids[r.req_id] for r in scheduled_running] + resumed_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running]
            + [r.num_computed_tokens for r in scheduled_resumed],
        )
        if manager.num_groups > 1:
            cached.extra_new_block_ids = self._extra_group_block_ids(
                scheduled_running, scheduled_resumed, new_block_ids)
        # Batch order: running first, then resumed, then new (the runner may reorder).
        # `num_scheduled_tokens` has the running ones first, then the admitted ones in
        # admission order: reorder only when resumed and new requests are both in it.
        ordered = num_scheduled_tokens
        if scheduled_resumed and scheduled_new:
            ordered = {r.req_id: num_scheduled_tokens[r.req_id] for r in scheduled_running}
            ordered.update({r.req_id: num_scheduled_tokens[r.req_id] for r in scheduled_resumed})
            ordered.update({r.req_id: num_scheduled_tokens[r.req_id] for r in scheduled_new})
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(ordered.values()),
            preempted_req_ids={r.req_id for r in step.preempted},
            finished_req_ids=self.finished_req_ids,
            grammar=(self._grammar_bitmask(ordered, step.spec_tokens)
                     if self._constrained_req_ids else None),
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_ids=self.encoder_cache.take_evicted(),
        )

    def _extra_group_block_ids(self, scheduled_running: list[Request],
                               scheduled_resumed: list[Request],
                               new_block_ids: dict[str, list[int]]) -> list[list[list[int]]]:
        """Groups 1..'s part of the diff: a running request's new blocks are the last
        as many of each group's list as group 0 got (every group grows at once); a
        resumed request's lists are whole."""
        manager = self.kv_cache_manager
        extra = []
        for request in scheduled_running:
            num_new = len(new_block_ids[request.req_id])
            extra.append([ids[len(ids) - num_new:] if num_new else [] for ids in
                          manager.get_extra_group_block_ids(request.req_id)])
        extra.extend(manager.get_extra_group_block_ids(r.req_id) for r in scheduled_resumed)
        return extra

    def _grammar_bitmask(self, num_scheduled_tokens: dict[str, int],
                         spec_tokens: dict[str, list[int]]) -> GrammarBitmask | None:
        """Masks of the constrained requests that sample this step (their scheduled
        tokens reach the end of their sequence; a mid-prefill chunk samples nothing):
        one row each, or 1 + k rows for a request verifying k drafts (the mask of each
        verified position, as one-token-at-a-time decoding would have it)."""
        req_ids, grammars, drafts = [], [], []
        for req_id in self._constrained_req_ids:
            num_tokens = num_scheduled_tokens.get(req_id)
            request = self.requests[req_id]
            if (num_tokens and request.grammar.active
                    and request.num_computed_tokens + num_tokens >= request.num_tokens):
                req_ids.append(req_id)
                grammars.append(request.grammar)
                if spec_tokens:
                    drafts.append(spec_tokens.get(req_id, []))
        if not req_ids:
            return None
        if not any(drafts):
            return GrammarBitmask(req_ids, self.structured_output.fill_bitmask(grammars))
        return GrammarBitmask(req_ids, self.structured_output.fill_bitmask(grammars, drafts),
                              num_rows=[1 + len(d) for d in drafts])

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's results: per request, append its sampled tokens up to the
        first that stops it (`_append_sampled`), roll back its rejected drafts, report
        it, free it if it finished; then the step's stats (`_step_outputs`).

        Contract: after the error outputs of requests whose grammar failed to compile,
        one EngineCoreOutput per scheduled request that got tokens, finished (stop,
        length, error) or has prompt logprobs; none for a request mid-prefill, nor for
        one finished or aborted while the step ran. A finished request is out of the
        queues and its blocks are free when this returns.

        Worked example (A decodes, max_tokens 5, 4 output tokens; B is mid-prefill):
            sampled {A: [17], B: []} -> A appends 17 and reaches max_tokens: output
            (A, [17], "length"), A freed; B: no output; stats: 1 generation token.
        """
        outputs: list[EngineCoreOutput] = self.take_grammar_failures()
        tally = _StepTally()
        now = time.time()
        computed_before = scheduler_output.num_computed_tokens_before()
        requests = self.requests
        req_id_to_index = runner_output.req_id_to_index
        sampled_token_ids = runner_output.sampled_token_ids
        errors = runner_output.errors
        all_logprobs = runner_output.logprobs
        all_prompt_logprobs = runner_output.prompt_logprobs
        running_status, last_unfinished = RequestStatus.RUNNING, RequestStatus.PREEMPTED
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted while the step ran
            num_computed_before = computed_before[req_id]
            if num_computed_before < request.num_prompt_tokens:  # (part of) a prefill
                tally.num_prompt_tokens += (
                    min(num_computed_before + num_tokens, request.num_prompt_tokens)
                    - num_computed_before
                )
            # Async scheduling: a later schedule() may have preempted it meanwhile;
            # the tokens this step sampled for it still count (the runner kept them).
            was_running = request.status == running_status
            if errors and req_id in errors:
                outputs.append(self._fail_request(request, was_running, errors[req_id]))
                continue
            if request.pooling_params is not None:
                if req_id in runner_output.pooled:  # its prompt is computed: done
                    outputs.append(self._finish_pooling(request, was_running,
                                                        runner_output.pooled[req_id]))
                continue
            index = req_id_to_index.get(req_id)
            sampled = sampled_token_ids[index] if index is not None else []
            new_token_ids = self._append_sampled(request, sampled) if sampled else []
            if spec_tokens and req_id in spec_tokens and sampled:
                self._roll_back_rejected(request, len(spec_tokens[req_id]), len(sampled) - 1)
            if new_token_ids:
                tally.count_generated(request, len(new_token_ids), now)
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            finished = request.status > last_unfinished  # request.is_finished
            if not new_token_ids and not finished and prompt_logprobs is None:
                continue  # mid-prefill: nothing to report
            outputs.append(EngineCoreOutput(  # positional: the fields in order
                req_id,
                new_token_ids,
                request.status.finish_reason if finished else None,  # finish_reason
                request.stop_reason,
                all_logprobs.get(req_id) if all_logprobs else None,  # new_logprobs
                prompt_logprobs,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            ))
            if finished:
                self._dequeue(request, was_running)
                self._free_request(request)
        return self._step_outputs(scheduler_output, runner_output, outputs, tally)

    def _append_sampled(self, request: Request, sampled: list[int]) -> list[int]:
        """Append a request's sampled tokens (one, or its accepted drafts and one more)
        up to the first that finishes it; returns the tokens appended. A grammar checks
        each one (idle until `after_token_id` ends free reasoning).

        Example: max_tokens 5 with 3 output tokens, sampled [7, 8, 9] -> 7 and 8 are
        appended, 8 is the 5th output token: FINISHED_LENGTH; returns [7, 8].
        """
        if request.num_output_placeholders:
            request.num_output_placeholders -= 1
        new_token_ids: list[int] = []
        grammar = request.grammar
        max_model_len = self.max_model_len
        for token_id in sampled:
            if grammar is not None and not grammar.active:
                # Free reasoning: the grammar starts after its end token.
                grammar.active = token_id == grammar.params.after_token_id
            elif grammar is not None and not grammar.accept(token_id):
                # Only a token the mask allowed can get here; end the output cleanly.
                logger.warning("request %s: grammar rejected token %d; stopping",
                               request.req_id, token_id)
                request.status = RequestStatus.FINISHED_STOPPED
                break
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            # Most tokens end nothing: the full stop rules run only for a token
            # that may stop it or at a length limit.
            if (token_id in request.stop_check_token_ids
                    or len(request.output_token_ids) >= request.max_tokens
                    or len(request.all_token_ids) >= max_model_len) and self._check_stop(
                        request, token_id):
                break
            if grammar is not None and grammar.terminated:
                request.status = RequestStatus.FINISHED_STOPPED  # complete, stop accepted
                break
        return new_token_ids

    def _finish_pooling(self, request: Request, running: bool,
                        vector: list[float]) -> EngineCoreOutput:
        """Finish a pooling request whose prompt the step computed: its output carries
        the vector; its blocks are free when this returns."""
        self._dequeue(request, running)
        request.status = RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        return EngineCoreOutput(request.req_id, [], "stop", pooled=vector)

    def _fail_request(self, request: Request, running: bool, error: str) -> EngineCoreOutput:
        """Finish a request whose step failed in the runner; its error output."""
        self._dequeue(request, running)
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        return EngineCoreOutput(request.req_id, [], "error", error=error)

    def _step_outputs(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                      outputs: list[EngineCoreOutput], tally: _StepTally) -> EngineCoreOutputs:
        """The step's outputs with the scheduler's stats and the first-scheduled times
        of the requests it started."""
        stats = self.make_stats()
        stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        stats.num_prompt_tokens = tally.num_prompt_tokens
        stats.num_generation_tokens = tally.num_generation_tokens
        stats.num_prompt_tokens_prefilled = tally.num_prompt_tokens_prefilled
        stats.inter_token_latencies_s = tally.inter_token_latencies_s
        if scheduler_output.scheduled_encoder_inputs or self._encoder_cache_hits:
            stats.mm_images_encoded = len(scheduler_output.scheduled_encoder_inputs)
            stats.mm_encoder_cache_hits, self._encoder_cache_hits = self._encoder_cache_hits, 0
            stats.mm_encoder_seconds = runner_output.encoder_seconds
        scheduled_times = {
            r.req_id: self._scheduled_times.pop(r.req_id)
            for r in scheduler_output.scheduled_new_reqs
            if r.req_id in self._scheduled_times
        }
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=stats, timestamp=time.time(),
            scheduled_times=scheduled_times,
        )

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After a verified draft: un-compute the rejected drafts' slots and free the
        blocks that held only them. The step computed the last token and the drafts;
        the sampled tokens are the accepted drafts plus one more (not computed yet)."""
        self.speculator.record(request.req_id, num_drafts, num_accepted, request.num_tokens)
        num_rejected = num_drafts - num_accepted
        if num_rejected == 0 or request.is_finished:
            return
        request.num_computed_tokens -= num_rejected
        num_blocks = self.kv_cache_manager.free_blocks_beyond(request, request.num_tokens)
        if num_blocks is not None:
            self._num_blocks_after_rollback[request.req_id] = num_blocks

    def _dequeue(self, request: Request, running: bool) -> None:
        """Take a request that is finishing out of `running` (or `waiting`)."""
        if running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set the finished status if `token_id` ends the request.

        `min_tokens` suppresses EOS and stop tokens only, never the length limits (a
        min_tokens beyond the room left in max_model_len would otherwise never end).
        EOS or a stop token that coincides with the length limit reports "stop".
        """
        params = request.sampling_params
        num_output_tokens = request.num_output_tokens
        if num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.take_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions_since_stats,
        )
        self._num_preemptions_since_stats = 0
        if self.max_loras:
            stats.running_lora_adapters = _count_adapters(self.running)
            stats.waiting_lora_adapters = _count_adapters(self.waiting)
        if self.structured_output is not None:
            stats.grammar_compile_seconds = self.structured_output.take_compile_seconds()
        if self.speculator is not None:
            spec = self.speculator.take_stats()
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_num_accepted_tokens_per_pos = spec.num_accepted_tokens_per_pos
            stats.spec_num_grammar_cut_tokens = spec.num_grammar_cut_tokens
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def _count_adapters(requests) -> dict[str, int]:
    """Adapter name -> how many of `requests` run under it (the base's are left out)."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.name
            counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class _StepPlan:
    """What one schedule() has decided so far; its phases fill it in."""

    token_budget: int  # tokens still free in this step
    encoder_budget: int  # encoder output rows still free in this step
    # req_id -> tokens this step: running requests first, then admitted ones in order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # running ones' new blocks
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    scheduled_resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> its drafts
    encoder_inputs: list[ImageFeature] = field(default_factory=list)  # images to encode
    with_images: bool = False  # some scheduled request reads image embeddings

    def add_running(self, request: Request, num_new_tokens: int,
                    new_blocks: list[KVCacheBlock], drafts: list[int] | None) -> None:
        """Schedule a running request's `num_new_tokens` (its drafts last) into its
        `new_blocks` (group 0's; possibly none)."""
        req_id = request.req_id
        self.scheduled_running.append(request)
        self.num_scheduled_tokens[req_id] = num_new_tokens
        if drafts:
            self.spec_tokens[req_id] = drafts
        self.new_block_ids[req_id] = [b.block_id for b in new_blocks] if new_blocks else []
        self.token_budget -= num_new_tokens

    def take_back(self, victim: Request) -> bool:
        """Unschedule `victim` if this step scheduled it as a running request, its
        tokens back in the budget; whether it had."""
        if victim not in self.scheduled_running:
            return False
        self.scheduled_running.remove(victim)
        self.new_block_ids.pop(victim.req_id)
        self.spec_tokens.pop(victim.req_id, None)
        self.token_budget += self.num_scheduled_tokens.pop(victim.req_id)
        return True


class _StepTally:
    """The token counts update_from_output gathers for the step's stats."""

    __slots__ = ("num_prompt_tokens", "num_generation_tokens", "num_prompt_tokens_prefilled",
                 "inter_token_latencies_s")

    def __init__(self) -> None:
        self.num_prompt_tokens = 0  # prompt tokens computed in the step
        self.num_generation_tokens = 0
        self.num_prompt_tokens_prefilled = 0  # whole prompts of requests that got a first token
        self.inter_token_latencies_s: list[float] = []

    def count_generated(self, request: Request, num_new_tokens: int, now: float) -> None:
        """`request` got its next `num_new_tokens` (> 0) at `now` (time.time())."""
        self.num_generation_tokens += num_new_tokens
        if request.last_token_time is None:  # its first token: the prompt is done
            self.num_prompt_tokens_prefilled += request.num_prompt_tokens
        else:
            self.inter_token_latencies_s.append(now - request.last_token_time)
        request.last_token_time = now
