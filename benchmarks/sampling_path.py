"""Per-step cost of the sampling path in the model runner, without the lm_head.

    python -m benchmarks.sampling_path                 # default model, ngram k=7 and off
    python -m benchmarks.sampling_path --spec off --max-tokens 64

Offline `LLM` (float32), greedy, the copy prompts of `benchmarks.spec_decode` one at a
time (one request in the batch). Each step's `ModelRunner._sample` (no drafts) or
`_sample_with_drafts` (a verify step) is timed, and inside it the model's
`compute_logits` (the lm_head); the difference is the sampling path proper: metadata,
sampler or draft verifier, bookkeeping. It prints, per number of logits rows (1: a
decode step; 1 + k: a verify step), the steps seen and the medians of the three, and of
the step's `_prepare_inputs` (which gathers the sampling metadata, before the forward).

The lm_head right after a forward reads its weight from memory, not cache, so it is
slower here than in a loop of its own; the sampling path pays the same cold caches.
Figures move with other jobs on the machine: compare runs made back to back.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from benchmarks.spec_decode import COPY_PROMPTS
from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

_SAMPLE_METHODS = ("_sample", "_sample_with_drafts")


class StepTimer:
    """Wraps the runner's input preparation, sampling methods and its model's
    compute_logits (class-level patches, undone by `restore`): per step, (rows, sample
    seconds, logits seconds, prepare seconds)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float, float]] = []
        self._logits_s = self._prepare_s = 0.0
        self._rows = 0
        self._originals = {name: getattr(ModelRunner, name)
                           for name in (*_SAMPLE_METHODS, "_prepare_inputs")}
        for name in _SAMPLE_METHODS:
            setattr(ModelRunner, name, self._timed(self._originals[name]))
        prepare = self._originals["_prepare_inputs"]

        def timed_prepare(runner, scheduler_output):
            start = time.perf_counter()
            inputs = prepare(runner, scheduler_output)
            self._prepare_s = time.perf_counter() - start
            return inputs
        ModelRunner._prepare_inputs = timed_prepare

    def _timed(self, method):
        def timed(runner, inputs, hidden_states, grammar=None):
            self._watch(runner)
            self._logits_s, self._rows = 0.0, 0
            start = time.perf_counter()
            result = method(runner, inputs, hidden_states, grammar)
            if self._rows:  # a step in which some request sampled
                self.steps.append((self._rows, time.perf_counter() - start, self._logits_s,
                                   self._prepare_s))
            return result
        return timed

    def _watch(self, runner: ModelRunner) -> None:
        model = runner.model
        if "compute_logits" in vars(model):
            return
        original = model.compute_logits

        def compute_logits(hidden_states):
            start = time.perf_counter()
            logits = original(hidden_states)
            self._logits_s += time.perf_counter() - start
            self._rows += logits.shape[0]
            return logits
        model.compute_logits = compute_logits

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(ModelRunner, name, original)

    def table(self) -> list[tuple[int, int, float, float, float, float]]:
        """(rows, steps, sample ms, lm_head ms, sample minus lm_head ms, prepare ms),
        medians."""
        by_rows = collections.defaultdict(list)
        for rows, *times in self.steps:
            by_rows[rows].append(times)
        out = []
        for rows in sorted(by_rows):
            steps = by_rows[rows]
            out.append((rows, len(steps),
                        1e3 * statistics.median(s for s, _, _ in steps),
                        1e3 * statistics.median(lg for _, lg, _ in steps),
                        1e3 * statistics.median(s - lg for s, lg, _ in steps),
                        1e3 * statistics.median(p for _, _, p in steps)))
        return out


def run(spec: str, max_tokens: int, num_prompts: int, k: int) -> None:
    config = None if spec == "off" else {
        "method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    llm = LLM(dtype="float32", speculative_config=config)
    messages = [[{"role": "user", "content": p}] for p in COPY_PROMPTS[:num_prompts]]
    llm.chat(messages[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    timer = StepTimer()
    try:
        for message in messages:
            llm.chat([message], SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        timer.restore()
    print(f"speculation {spec}: {len(timer.steps)} sampling steps")
    print("| rows | steps | _sample ms | lm_head ms | sampling path ms | _prepare_inputs ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows, steps, sample_ms, logits_ms, path_ms, prepare_ms in timer.table():
        if steps >= 3:
            print(f"| {rows} | {steps} | {sample_ms:.3f} | {logits_ms:.3f} | {path_ms:.3f} "
                  f"| {prepare_ms:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=["on", "off", "both"], default="both")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=len(COPY_PROMPTS),
                        help="how many of the copy prompts")
    parser.add_argument("--k", type=int, default=7, help="ngram num_speculative_tokens")
    args = parser.parse_args()
    for spec in (["on", "off"] if args.spec == "both" else [args.spec]):
        run(spec, args.max_tokens, args.prompts, args.k)


if __name__ == "__main__":
    main()
