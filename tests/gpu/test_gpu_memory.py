"""KV sizing on CUDA: with --gpu-memory-utilization 0.5 the process's peak stays under
half the device, and the KV cache takes most of that half.

Run in a fresh process, so nothing an earlier test allocated counts. The model is a
tiny one with wide KV (8 layers x 8 KV heads x 128): its blocks are large enough that
half an H200 is ~10^5 of them, not the ~10^7 a 2-layer toy would need. Skipped
without CUDA (marked gpu).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.model_fixtures import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[2]
UTILIZATION = 0.5

CHILD = """
import json, sys
import torch
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", gpu_memory_utilization=float(sys.argv[2]),
          max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048)
prompts = [[3 + (i * 7 + j) % 400 for j in range(100 + 10 * i)] for i in range(64)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
             use_tqdm=False)
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
reserved = torch.cuda.memory_reserved()
caches = llm.engine_core.executor.runner.kv_caches
print("RESULT " + json.dumps({
    "total": total,
    "peak_reserved": torch.cuda.max_memory_reserved(),
    "non_torch": (total - free) - reserved,
    "kv_bytes": sum(c.numel() * c.element_size() for c in caches),
    "num_blocks": llm.engine_core.kv_cache_info.num_blocks,
}))
"""


def test_half_the_device_means_half(tmp_path):
    model_dir = build_tiny_checkpoint(
        tmp_path / "wide-kv", "llama", num_hidden_layers=8, hidden_size=256,
        intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=1024,
    )
    import torch

    torch.cuda.empty_cache()  # what earlier tests in this process keep reserved would count
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(UTILIZATION)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    print(result)
    budget = UTILIZATION * result["total"]
    peak = result["peak_reserved"] + result["non_torch"]
    assert peak <= budget, f"peak {peak / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB"
    # The cache took the budget, less weights, activations and the CUDA context (< 4 GiB here).
    assert result["kv_bytes"] >= budget - (4 << 30), result
