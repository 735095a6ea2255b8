"""The engine core's side of structured outputs: compiles, matchers and bitmasks.

    scheduler.add_request      submit(params)  -> RequestGrammar (compile queued or cached)
    scheduler.schedule         poll()          -> admit the request once compiled
                               valid_draft()   -> a draft cut where the grammar refuses it
                               fill_bitmask()  -> [rows, words] mask of the rows that sample
                                                  (with drafts: 1 + k rows per request)
    runner / sampler           masks those rows' logits (forbidden tokens -> -inf)
    scheduler.update_from_output  accept(token) advances the request's matcher

Compiles run on a small thread pool (xgrammar releases the GIL), never in the step
loop, behind a cache keyed by the spec: equal schemas compile once. A request whose
compile takes longer than `compile_timeout_s` fails alone. The first compile also
builds the tokenizer's vocabulary table (a few tenths of a second), so a server that
never sees a constrained request pays nothing.

A grammar with `after_token_id` (a reasoning model's `</think>`) stays inactive, neither
masking nor advancing, until the output holds that token.

A matcher advances only on tokens the request keeps: a preempted request keeps its
output tokens (recompute re-prefills them), so its matcher stays valid as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output.backend import GrammarBackend, library_message
from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
_CACHE_ENTRIES = 256
_COMPILE_THREADS = 2


@dataclass
class CompileResult:
    compiled: Any = None  # xgrammar CompiledGrammar
    error: str | None = None
    seconds: float = 0.0


@dataclass
class RequestGrammar:
    """One request's grammar: a (shared) compile and, once compiled, its own matcher."""

    params: StructuredOutputsParams
    stop_token_ids: list[int]
    future: Future
    submitted_at: float = field(default_factory=time.monotonic)
    matcher: Any = None
    error: str | None = None
    # False until the output reaches `params.after_token_id` (free reasoning first).
    active: bool = True

    def __post_init__(self) -> None:
        self.active = self.params.after_token_id is None

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by one token; False if the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` (speculative decoding) that the grammar takes
        token after token without ending; the matcher is left as it was.

        Cut before the first refused token and before a stop token that would end the
        output (its next row would have no mask; the step's last row samples it). An
        inactive grammar (free reasoning) cuts before its `after_token_id`: the row after
        that token needs the grammar's first mask.

        Worked example, regex `[0-9]{2}`, draft ["4", "2", EOS, "x"]: "4" and "2" are
        taken, EOS would end the output -> ["4", "2"] (rolled back by 3: nothing moved).
        """
        if not self.active:
            after = self.params.after_token_id
            return draft[:draft.index(after)] if after in draft else draft
        matcher = self.matcher
        num_accepted = 0  # tokens the matcher took, to roll back
        num_valid = len(draft)
        for i, token_id in enumerate(draft):
            if not matcher.accept_token(token_id):
                num_valid = i
                break
            num_accepted += 1
            if matcher.is_terminated():
                num_valid = i
                break
        if num_accepted:
            matcher.rollback(num_accepted)
        return draft[:num_valid]

    @property
    def terminated(self) -> bool:
        """The output is complete and its stop token was accepted."""
        return self.active and self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compile_seconds: list[float] = []  # compiles finished since take_compile_seconds()
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------ compiles
    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = GrammarBackend(self._load_tokenizer(), self.vocab_size)
            return self._backend

    def submit(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> RequestGrammar:
        """Start (or reuse) the compile of `params`; never blocks."""
        return RequestGrammar(params, list(stop_token_ids), self._compile_future(params))

    def check(self, params: StructuredOutputsParams,
              on_done: Callable[[str | None], None]) -> None:
        """Compile `params` (or reuse its compile) and call `on_done(error or None)` from
        a grammar thread once it is done; never blocks. A request for the same spec that
        follows reuses the compile."""

        def report(future: Future) -> None:
            if future.cancelled():
                on_done("the engine is shutting down")
            else:
                on_done(future.result().error)

        self._compile_future(params).add_done_callback(report)

    def _compile_future(self, params: StructuredOutputsParams) -> Future:
        future = self._cache.get(params.key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, params)
            self._cache[params.key] = future
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(params.key)
        return future

    def _compile(self, params: StructuredOutputsParams) -> CompileResult:
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(params)
        except Exception as exc:  # noqa: BLE001 - a bad spec fails its requests only
            return CompileResult(error=f"invalid {params.kind}: {library_message(exc)}")
        seconds = time.perf_counter() - started
        with self._stats_lock:
            self._compile_seconds.append(seconds)
        return CompileResult(compiled=compiled, seconds=seconds)

    def poll(self, grammar: RequestGrammar) -> bool:
        """True once `grammar` is usable (its matcher built) or has failed (`.error`)."""
        if grammar.matcher is not None or grammar.error is not None:
            return True
        if not grammar.future.done():
            waited = time.monotonic() - grammar.submitted_at
            if waited > self.compile_timeout_s:
                grammar.error = (f"grammar compilation took longer than "
                                 f"{self.compile_timeout_s:g} s")
                return True
            return False
        result: CompileResult = grammar.future.result()
        if result.error is not None:
            grammar.error = result.error
        else:
            try:
                grammar.matcher = self.backend.matcher(result.compiled, grammar.stop_token_ids)
            except Exception as exc:  # noqa: BLE001 - e.g. a stop id the grammar rejects
                grammar.error = f"cannot build the grammar matcher: {library_message(exc)}"
        return True

    def take_compile_seconds(self) -> list[float]:
        """Durations of the compiles finished since the last call (for metrics)."""
        with self._stats_lock:
            seconds, self._compile_seconds = self._compile_seconds, []
        return seconds

    # ------------------------------------------------------------ the step
    def fill_bitmask(self, grammars: list[RequestGrammar],
                     drafts: list[list[int]] | None = None):
        """[rows, words] int32: the next-token masks of `grammars`, one row each, or with
        `drafts` (speculative decoding: grammar i verifies `drafts[i]`, which
        `valid_draft` kept) 1 + len(drafts[i]) consecutive rows each: row j of grammar i
        is its mask after taking drafts[i][:j]. The matchers are left as they were.

        Worked example, grammars [g, h], drafts [[5, 6], []]: 4 rows: g's mask, g's after
        5, g's after 5 6, h's mask.
        """
        if drafts is None:
            drafts = [[]] * len(grammars)
        bitmask = self.backend.allocate_bitmask(len(grammars) + sum(map(len, drafts)))
        row = 0
        for grammar, draft in zip(grammars, drafts, strict=True):
            matcher = grammar.matcher
            matcher.fill_next_token_bitmask(bitmask, row)
            row += 1
            num_accepted = 0
            for token_id in draft:
                if not matcher.accept_token(token_id):
                    break
                num_accepted += 1
                matcher.fill_next_token_bitmask(bitmask, row)
                row += 1
            if num_accepted:
                matcher.rollback(num_accepted)
            if num_accepted < len(draft):
                raise RuntimeError(f"a draft that valid_draft did not keep: {draft}")
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
