"""Micro-benchmark: one scheduler step (schedule + update_from_output) at steady decode.

256 running requests, 1,000-token prompts, block size 16, prefix caching on (sha256),
a pool large enough that nothing is preempted. The requests are prefilled first;
then N decode rounds are timed, each with a fake model-runner output that samples
one token per request (building that output is not timed: a real runner does it).

    python -m benchmarks.scheduler_step                 # the default setup
    python -m benchmarks.scheduler_step --profile       # plus a cProfile of the rounds

Every request crosses a block boundary on the same round (they all have the same
length), so one round in `block_size` allocates and hashes a block per request:
the median shows the common round, the mean and the max include those.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams
from engine.sched import Scheduler, SchedulerOutput


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    """One sampled token for every request whose tokens are all computed after the step."""
    req_ids = list(out.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [token] if requests[r].num_computed_tokens == requests[r].num_tokens else []
        for r in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def build(args: argparse.Namespace) -> Scheduler:
    # Room for every timed round plus the tokens sampled while others still prefill.
    max_len = args.prompt_len + args.warmup + args.steps + 256
    blocks_per_request = -(-max_len // args.block_size)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.num_requests,
            max_num_batched_tokens=args.prefill_budget,
            max_model_len=max_len + 1,
        ),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=True,
                    prefix_caching_hash_algo=args.hash_algo),
        num_blocks=args.num_requests * blocks_per_request + 1,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_len - args.prompt_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = [rng.randrange(32_000) for _ in range(args.prompt_len)]
        scheduler.add_request(EngineCoreRequest(f"req-{i}", prompt, params))
    return scheduler


def prefill(scheduler: Scheduler, num_requests: int) -> None:
    """Run steps until every request is running and decoding one token a step."""
    while True:
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner_output(scheduler, out, token=7))
        if (len(scheduler.running) == num_requests
                and all(n == 1 for n in out.num_scheduled_tokens.values())
                and len(out.num_scheduled_tokens) == num_requests):
            return


def run_rounds(scheduler: Scheduler, num_rounds: int, num_requests: int, clock=time.perf_counter
               ) -> tuple[list[float], list[float]]:
    """Time `num_rounds` decode rounds; returns per-round schedule and update seconds."""
    schedule_s, update_s = [], []
    for _ in range(num_rounds):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        runner_output = fake_runner_output(scheduler, out, token=7)
        t2 = clock()
        scheduler.update_from_output(out, runner_output)
        t3 = clock()
        assert len(out.num_scheduled_tokens) == num_requests and not out.preempted_req_ids
        schedule_s.append(t1 - t0)
        update_s.append(t3 - t2)
    return schedule_s, update_s


def summarize(label: str, seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)

    def pct(q: float) -> float:
        return us[min(len(us) - 1, int(q * len(us)))]

    return (f"{label:<22} median {statistics.median(us):7.0f} µs   mean {statistics.fmean(us):7.0f} µs"
            f"   p10 {pct(0.10):7.0f}   p99 {pct(0.99):7.0f}   max {us[-1]:7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxhash"])
    parser.add_argument("--prefill-budget", type=int, default=16_384,
                        help="max_num_batched_tokens while prefilling")
    parser.add_argument("--warmup", type=int, default=32, help="untimed decode rounds")
    parser.add_argument("--steps", type=int, default=512, help="timed decode rounds")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: this thread's CPU time (steadier on "
                             "a loaded machine)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed rounds")
    args = parser.parse_args()

    t0 = time.perf_counter()
    scheduler = build(args)
    prefill(scheduler, args.num_requests)
    run_rounds(scheduler, args.warmup, args.num_requests)
    setup_s = time.perf_counter() - t0

    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    schedule_s, update_s = run_rounds(scheduler, args.steps, args.num_requests, clock)
    if profiler:
        profiler.disable()

    total_s = [a + b for a, b in zip(schedule_s, update_s, strict=True)]
    print(f"{args.num_requests} decode requests, prompt {args.prompt_len} tokens, block size "
          f"{args.block_size}, prefix caching {args.hash_algo}; {args.steps} rounds timed "
          f"by {args.clock} clock (setup {setup_s:.1f} s){' under cProfile' if profiler else ''}")
    print(summarize("schedule()", schedule_s))
    print(summarize("update_from_output()", update_s))
    print(summarize("one step (both)", total_s))
    if profiler:
        stats = pstats.Stats(profiler).strip_dirs().sort_stats("tottime")
        stats.print_stats(20)


if __name__ == "__main__":
    main()
