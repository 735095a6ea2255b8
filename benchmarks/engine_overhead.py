"""What the engine costs around the model: µs per step for each stage of the loop.

The real `EngineCore` (scheduler, KV cache manager with prefix caching, the model
runner's state updates and input preparation, the sampler over a 49,152-token
vocabulary, `update_from_output`), the real output path (msgspec encode, a ZMQ
PUSH over ipc:// to a receiving thread), and the real frontend (`AsyncEngine`:
msgspec decode, per-request state, incremental detokenization with stop strings,
and one OpenAI completion SSE chunk per token per stream). Only the model forward
is a stub: it returns at once (or after `--model-ms T`) and its "logits" are a
fixed random [rows, vocab] tensor, so the sampler does its real work on them.

    python -m benchmarks.engine_overhead                   # every workload, table + JSON
    python -m benchmarks.engine_overhead --workloads decode-256 --model-ms 5
    python -m benchmarks.engine_overhead --json results/engine_overhead.json
    python -m benchmarks.engine_overhead --workloads decode-256 --sampling greedy \
        --model-ms 5 --async-modes off on       # step period with/without async scheduling

Workloads: `decode-N` = N running requests, each with a ~1,000-token context,
decoding one token a step; `mix-256` = 256 decodes sharing every step with a
chunk of a new 1,000-token prompt (finished requests are replaced). Each runs
greedy-only ("greedy") and half greedy / half temperature 0.8 + top-p 0.95
("mixed"). The frontend is measured on the decode-256 greedy steps recorded from
the core, played back into an `AsyncEngine` with 256 streaming consumers, on one
core (the asyncio thread), HTTP writes excluded.

Stages (core, per step): schedule / update_from_output (scheduler), runner
bookkeeping (state diff + input preparation + the sampler's per-row bookkeeping),
the sampler's arithmetic over the logits (on a GPU it runs beside the model on
the device: reported apart), the model stub, and encode + send of the outputs.

`--sampler device` leaves the sampler's arithmetic out, as on a GPU, where it runs on
the device and the CPU never reads the logits: the stub sampler hands out the tokens
the real one picks for greedy rows (the argmax of the stub's fixed logits, computed
once), and everything around it (the runner's bookkeeping of the sampled tokens,
update_from_output, ...) runs as before. On a CPU the real sampler's pass over
[rows, 49,152] float32 logits (50 MB at 256 rows) also evicts the scheduler's state
from the caches, so the stages after it cost more than they would beside a GPU: run
both to see how much.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.core import EngineCore
from engine.core.core_proc import freeze_startup_heap
from engine.outputs import KVCacheInfo, ModelRunnerOutput
from engine.request import EngineCoreRequest
from engine.sample.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput

VOCAB_SIZE = 49_152  # SmolLM2's
PROMPT_LEN = 1_000
BLOCK_SIZE = 16


# ---------------------------------------------------------------------- the stub model
class StubModel(nn.Module):
    """Stands in for a model: forward returns at once (or after `model_ms`), and
    `compute_logits` hands out rows of one fixed random logits tensor."""

    def __init__(self, vocab_size: int, max_rows: int, model_ms: float, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_rows, vocab_size, generator=generator)
        self.model_s = model_ms / 1000

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.model_s:
            time.sleep(self.model_s)
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden_states.shape[0]]


class StubExecutor:
    """The real `ModelRunner` around a `StubModel`; no attention layers, no KV memory."""

    def __init__(self, config: EngineConfig, num_blocks: int, model_ms: float = 0.0):
        self.config = config
        self.num_blocks = num_blocks
        self.model_ms = model_ms
        self.runner = None

    def initialize(self) -> KVCacheInfo:
        from engine.attention.selector import select_attention_backend
        from engine.worker.model_runner import ModelRunner

        sched = self.config.scheduler_config
        device = torch.device("cpu")
        self.runner = ModelRunner(
            StubModel(VOCAB_SIZE, sched.max_num_seqs, self.model_ms),
            select_attention_backend("torch", device, BLOCK_SIZE), device,
            max_num_reqs=sched.max_num_seqs, max_model_len=sched.max_model_len,
            block_size=BLOCK_SIZE, vocab_size=VOCAB_SIZE,
        )
        self.runner.bind_kv_caches([])
        return KVCacheInfo(self.num_blocks, BLOCK_SIZE, sched.max_model_len, VOCAB_SIZE)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------- stage timing
# How stages are timed: "wall" (time.perf_counter) or "cpu" (time.thread_time: the
# CPU time of the thread doing the work, which on a machine shared with other jobs
# leaves out the time the thread waited for a core; the period stays wall time).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


class StageClock:
    """Accumulates the seconds spent in wrapped callables, per stage, per step."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, stage: str, fn: Callable) -> Callable:
        now = self.now

        def timed(*args, **kwargs):
            started = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[stage] += now() - started
        return timed

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def median_us(self, stage: str) -> float:
        return statistics.median(s.get(stage, 0.0) for s in self.steps) * 1e6


class _TimedSampler:
    """The runner calls `self.sampler(logits, metadata)`: time that call. With
    `device_tokens` (--sampler device) the logits are not read: row i samples
    device_tokens[i]."""

    def __init__(self, sampler, clock: StageClock, device_tokens: torch.Tensor | None = None):
        self.sampler = sampler
        self.clock = clock
        self.device_tokens = device_tokens

    def __call__(self, logits, metadata):
        started = self.clock.now()
        try:
            if self.device_tokens is not None:
                return SamplerOutput(sampled_token_ids=self.device_tokens[: logits.shape[0]],
                                     logprobs=None)
            return self.sampler(logits, metadata)
        finally:
            self.clock.current["sampler_math"] += self.clock.now() - started


def instrument(core: EngineCore, clock: StageClock, sampler: str = "cpu") -> None:
    scheduler = core.scheduler
    runner = core.executor.runner
    device_tokens = runner.model.logits.argmax(dim=-1) if sampler == "device" else None
    scheduler.schedule = clock.wrap("schedule", scheduler.schedule)
    scheduler.update_from_output = clock.wrap("update", scheduler.update_from_output)
    runner.execute_model = clock.wrap("runner_total", runner.execute_model)
    runner.model.forward = clock.wrap("model", runner.model.forward)
    runner.sampler = _TimedSampler(runner.sampler, clock, device_tokens)


# ---------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    num_decodes: int
    sampling: str  # greedy | mixed
    with_prefill: bool = False


def sampling_params(rng: random.Random, sampling: str, max_tokens: int) -> SamplingParams:
    if sampling == "mixed" and rng.random() < 0.5:
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class CoreResult:
    workload: str
    sampling: str
    num_running: int
    model_ms: float
    async_scheduling: bool
    clock: str = "wall"
    sampler: str = "cpu"
    stages_us: dict[str, float] = field(default_factory=dict)
    step_period_us: float = 0.0
    steps_per_s: float = 0.0
    tokens_per_s: float = 0.0


def run_core(workload: Workload, num_steps: int, model_ms: float,
             record: list[bytes] | None = None, seed: int = 0,
             prompt_len: int = PROMPT_LEN, async_scheduling: bool = False,
             clock: str = "wall", sampler: str = "cpu") -> CoreResult:
    import zmq

    from engine.ipc import Outputs, core_codec

    rng = random.Random(seed)
    n = workload.num_decodes
    decode_len = num_steps + 64
    max_model_len = prompt_len + decode_len + 64
    max_seqs = n + (4 if workload.with_prefill else 0)
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    num_blocks = max_seqs * blocks_per_request + 1
    config = EngineConfig(
        ModelConfig(model="stub"),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=max_seqs, max_model_len=max_model_len,
                        max_num_batched_tokens=8192, async_scheduling=async_scheduling),
    )
    core = EngineCore(config, StubExecutor(config, num_blocks, model_ms=0.0))
    counter = iter(range(10**9))

    def add(max_tokens: int) -> None:
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"req-{next(counter)}", prompt,
                                           sampling_params(rng, workload.sampling, max_tokens)))

    # Fill: every decode request prefilled (big chunks, untimed) and decoding.
    for _ in range(n):
        add(decode_len if not workload.with_prefill else rng.randrange(8, 2 * num_steps + 9))
    while len(core.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    # Timed steps: the step budget now leaves room for one prefill chunk beside the decodes.
    core.scheduler.config = SchedulerConfig(
        max_num_seqs=max_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=n + 256 if workload.with_prefill else n,
        async_scheduling=async_scheduling)
    core.executor.runner.model.model_s = model_ms / 1000

    context = zmq.Context()
    address = f"ipc:///tmp/pagedserve-overhead-{random.getrandbits(32)}"
    pull = context.socket(zmq.PULL)
    pull.bind(address)
    push = context.socket(zmq.PUSH)
    push.connect(address)
    received = [0]

    def drain() -> None:
        while pull.recv() != b"stop":
            received[0] += 1

    receiver = threading.Thread(target=drain, daemon=True)
    receiver.start()
    codec = core_codec()
    clock_name, now = clock, CLOCKS[clock]
    clock = StageClock(now)
    instrument(core, clock, sampler)
    warmup = min(20, num_steps // 5)
    freeze_startup_heap()  # as the core process does once it is built
    num_tokens = 0
    started = None
    for step in range(warmup + num_steps):
        if step == warmup:
            started = time.perf_counter()
        if workload.with_prefill:
            while core.scheduler.num_unfinished_requests < n + 1:
                add(rng.randrange(8, 2 * num_steps + 9))
        step_started = now()
        outputs = core.step()
        send_started = now()
        data = codec.encode(Outputs(outputs))
        push.send(data, copy=False)
        ended = now()
        clock.current["send"] = ended - send_started
        clock.current["step"] = ended - step_started
        if step >= warmup:
            num_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
            if record is not None:
                record.append(data)
        clock.end_step(keep=step >= warmup)
    elapsed = time.perf_counter() - started
    gc.unfreeze()  # this process goes on to the next workload
    push.send(b"stop")
    receiver.join(timeout=10)
    push.close(linger=0)
    pull.close(linger=0)
    context.term()

    med = clock.median_us
    runner_total, model, sampler_math = med("runner_total"), med("model"), med("sampler_math")
    stages = {
        "schedule": med("schedule"),
        "update_from_output": med("update"),
        "runner_bookkeeping": runner_total - model - sampler_math,
        "sampler_math": sampler_math,
        "model_stub": model,
        "encode_send": med("send"),
    }
    stages["core_overhead_total"] = (stages["schedule"] + stages["update_from_output"]
                                     + stages["runner_bookkeeping"] + stages["encode_send"])
    return CoreResult(
        workload=workload.name, sampling=workload.sampling, num_running=n, model_ms=model_ms,
        async_scheduling=async_scheduling, clock=clock_name, sampler=sampler,
        stages_us={k: round(v, 1) for k, v in stages.items()},
        step_period_us=round(elapsed / num_steps * 1e6, 1),
        steps_per_s=round(num_steps / elapsed, 1),
        tokens_per_s=round(num_tokens / elapsed, 1),
    )


# ---------------------------------------------------------------------- the frontend
@dataclass
class FrontendResult:
    num_streams: int
    num_steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    us_per_step: float


async def _run_frontend(recorded: list[bytes], num_streams: int, tokenizer,
                        now: Callable[[], float] = time.perf_counter) -> FrontendResult:
    from engine.frontend.async_engine import AsyncEngine
    from engine.frontend.core_client import AsyncEngineCoreClient
    from engine.ipc import frontend_codec
    from server.apis.openai.completions import CompletionChunkWriter

    codec = frontend_codec()
    start_playback = asyncio.Event()

    class PlaybackClient(AsyncEngineCoreClient):
        """Replays the core's recorded messages (decoded here, as a real client does)."""

        def __init__(self) -> None:
            super().__init__()
            self.kv_cache_info = KVCacheInfo(1 << 20, BLOCK_SIZE, 1 << 16, VOCAB_SIZE)
            self.messages = iter(recorded)

        async def _send(self, message) -> None:
            pass

        async def _next_message(self):
            await start_playback.wait()
            data = next(self.messages, None)
            if data is None:
                await asyncio.Event().wait()  # played out: idle like a quiet core
            return codec.decode(data)

        def shutdown(self) -> None:
            pass

        def check_alive(self) -> None:
            pass

    engine = AsyncEngine(PlaybackClient(), tokenizer, eos_token_id=None)
    rng = random.Random(0)
    num_tokens = [0]
    num_steps = len(recorded)

    async def consume(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=1 << 15, ignore_eos=True,
                                stop=["\n\n\n\n\n"])
        prompt = [rng.randrange(1000, 40_000) for _ in range(32)]
        writer = CompletionChunkWriter(f"cmpl-bench-{i}", 0, "stub")
        async for output in engine.generate(prompt, params, f"req-{i}"):
            for seq in output.outputs:
                num_tokens[0] += len(seq.delta_token_ids)
                writer.text(0, seq.delta_text)  # the server's chunk for a text delta
            if num_tokens[0] >= expected:
                done.set()

    # Recorded ids are req-<n> in the order the core added them: the first n decodes.
    expected = sum(
        len(o.new_token_ids) for data in recorded for o in codec.decode(data).outputs.outputs)
    done = asyncio.Event()
    tasks = [asyncio.create_task(consume(i)) for i in range(num_streams)]
    await asyncio.sleep(0.1)  # every request added
    started = now()
    start_playback.set()
    await asyncio.wait_for(done.wait(), timeout=600)
    seconds = now() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return FrontendResult(num_streams, num_steps, num_tokens[0], round(seconds, 3),
                          round(num_tokens[0] / seconds, 1), round(seconds / num_steps * 1e6, 1))


def run_frontend(recorded: list[bytes], num_streams: int, clock: str = "wall") -> FrontendResult:
    """`clock` "cpu": seconds are the process's CPU time (time.process_time)."""
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    now = time.process_time if clock == "cpu" else time.perf_counter
    return asyncio.run(_run_frontend(recorded, num_streams, tokenizer, now))


# ---------------------------------------------------------------------- report
def table(results: list[CoreResult]) -> str:
    columns = ["schedule", "update_from_output", "runner_bookkeeping", "encode_send",
               "core_overhead_total", "sampler_math", "model_stub"]
    header = ("| workload | sampling | sampler | async | " + " | ".join(columns)
              + " | step period | steps/s | tok/s |")
    lines = [header, "|" + "---|" * (len(columns) + 7)]
    for r in results:
        cells = [f"{r.stages_us[c]:,.0f}" for c in columns]
        lines.append(f"| {r.workload} | {r.sampling} | {r.sampler} | "
                     f"{'on' if r.async_scheduling else 'off'} | "
                     + " | ".join(cells)
                     + f" | {r.step_period_us:,.0f} | {r.steps_per_s:,.0f} | {r.tokens_per_s:,.0f} |")
    return "\n".join(lines)


WORKLOADS = {
    "decode-64": Workload("decode-64", 64, "greedy"),
    "decode-256": Workload("decode-256", 256, "greedy"),
    "decode-1024": Workload("decode-1024", 1024, "greedy"),
    "mix-256": Workload("mix-256", 256, "greedy", with_prefill=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--sampling", nargs="+", default=["greedy", "mixed"],
                        choices=["greedy", "mixed"])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per workload")
    parser.add_argument("--model-ms", type=float, default=0.0,
                        help="the stub model's forward time per step")
    parser.add_argument("--async-modes", nargs="+", default=["off"], choices=["off", "on"],
                        help="run each workload without and/or with async scheduling")
    parser.add_argument("--frontend-streams", type=int, default=256,
                        help="streams for the frontend run (0: skip it)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="time the stages by wall clock or by the thread's CPU time "
                             "(cpu: for a machine shared with other jobs)")
    parser.add_argument("--sampler", choices=["cpu", "device"], default="cpu",
                        help="cpu: the real sampler on the stub's logits; device: its "
                             "arithmetic left out, as on a GPU (see the module doc)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results: list[CoreResult] = []
    recorded: list[bytes] = []
    for name in args.workloads:
        for sampling in args.sampling:
            for mode in args.async_modes:
                workload = Workload(**{**asdict(WORKLOADS[name]), "sampling": sampling})
                record = (recorded if args.frontend_streams and name == "decode-256"
                          and sampling == "greedy" and mode == "off" and not recorded else None)
                result = run_core(workload, args.steps, args.model_ms, record,
                                  async_scheduling=mode == "on", clock=args.clock,
                                  sampler=args.sampler)
                results.append(result)
                print(f"{name} {sampling} sampler={args.sampler} async={mode}: {result.stages_us} "
                      f"period {result.step_period_us} µs", flush=True)
    print(f"\nµs per step (median over the timed steps, {args.clock} clock); "
          "period/steps/s/tok/s from wall time."
          "\nWith async scheduling the runner's stages run on the worker thread, beside the"
          " core's: the period, not the sum of the stages, is what counts.")
    print(table(results))
    frontend = None
    if recorded:
        frontend = run_frontend(recorded, args.frontend_streams, args.clock)
        print(f"\nfrontend: {frontend.num_streams} SSE streams, {frontend.tokens} tokens in "
              f"{frontend.seconds} s ({args.clock}) -> {frontend.tokens_per_s:,.0f} tokens/s on one core "
              f"({frontend.us_per_step:,.0f} µs per core step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"core": [asdict(r) for r in results],
                       "frontend": asdict(frontend) if frontend else None}, f, indent=1)


if __name__ == "__main__":
    main()
