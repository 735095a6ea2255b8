"""Prompt sources for the serving benchmark.

Three datasets are supported:

* ``random``: prompts made of random token ids (uniform over the tokenizer's
  ordinary vocabulary) decoded to text, with input and output lengths drawn
  uniformly from ``[len * (1 - ratio), len * (1 + ratio)]``.
* ``prefix``: a few long random prefixes, each shared by many prompts that
  differ only in a short random suffix. This is the workload on which prefix
  caching pays off.
* ``jsonl``: a file with one JSON object per line, ``{"prompt": str,
  "max_tokens": int (optional)}``.

Everything here is deterministic for a given seed and tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Tokenizer files that mark a directory as a Hugging Face tokenizer directory.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class SampleRequest:
    """One prompt to send: the text, its length in tokens and the output budget."""

    prompt: str
    prompt_len: int
    max_tokens: int


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Load a Hugging Face tokenizer from a directory, a ``.gguf`` file, or a hub id.

    A ``.gguf`` file is read with ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``.
    A directory that holds no tokenizer files but exactly one ``.gguf`` file is
    treated as that file.
    """
    from transformers import AutoTokenizer

    path = os.path.expanduser(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        directory, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(
            directory, gguf_file=name, trust_remote_code=trust_remote_code
        )
    if os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, f)) for f in _HF_TOKENIZER_FILES
    ):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return AutoTokenizer.from_pretrained(
                path, gguf_file=ggufs[0], trust_remote_code=trust_remote_code
            )
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens in ``text``, without any special tokens added."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """``n`` integer lengths drawn uniformly from ``[length*(1-r), length*(1+r)]``, each >= 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    low = max(1, int(np.floor(length * (1.0 - range_ratio))))
    high = max(low, int(np.ceil(length * (1.0 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def _ordinary_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of the base vocabulary without special tokens (the ids random prompts draw from)."""
    vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no ordinary (non-special) tokens to sample from")
    return ids


def _random_text(
    tokenizer: Any, rng: np.random.Generator, vocab: np.ndarray, num_tokens: int
) -> tuple[str, int]:
    """Text that re-encodes to (about) ``num_tokens`` tokens; returns ``(text, actual_len)``.

    Decoding random ids and re-encoding the text rarely gives back the same
    number of tokens, so the id list is trimmed or extended a few times until
    the re-encoded length matches.
    """
    if num_tokens <= 0:
        return "", 0
    ids = rng.choice(vocab, size=num_tokens).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for _ in range(8):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == num_tokens:
            return text, num_tokens
        if len(encoded) > num_tokens:
            ids = encoded[:num_tokens]
        else:
            ids = encoded + rng.choice(vocab, size=num_tokens - len(encoded)).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, count_tokens(tokenizer, text)


def random_dataset(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random tokens with seeded random input and output lengths."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    vocab = _ordinary_token_ids(tokenizer)
    samples = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist(), strict=True):
        text, actual = _random_text(tokenizer, rng, vocab, n_in)
        samples.append(SampleRequest(prompt=text, prompt_len=actual, max_tokens=n_out))
    return samples


def prefix_dataset(
    tokenizer: Any,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` prompts sharing ``num_prefixes`` long prefixes, with unique suffixes.

    Prompt ``i`` uses prefix ``i % num_prefixes``; the order is then shuffled
    so requests for the same prefix are interleaved in time.
    """
    if num_prefixes < 1:
        raise ValueError("need at least one prefix")
    rng = np.random.default_rng(seed)
    vocab = _ordinary_token_ids(tokenizer)
    prefixes = [_random_text(tokenizer, rng, vocab, prefix_len)[0] for _ in range(num_prefixes)]
    samples = []
    for i in range(num_prompts):
        suffix, _ = _random_text(tokenizer, rng, vocab, suffix_len)
        # A newline keeps the suffix from merging with the prefix's last token.
        prompt = prefixes[i % num_prefixes] + "\n" + suffix
        samples.append(
            SampleRequest(
                prompt=prompt, prompt_len=count_tokens(tokenizer, prompt), max_tokens=output_len
            )
        )
    order = rng.permutation(num_prompts)
    return [samples[i] for i in order]


def jsonl_dataset(
    path: str,
    num_prompts: int | None,
    default_max_tokens: int,
    tokenizer: Any | None = None,
) -> list[SampleRequest]:
    """Prompts from a JSON-lines file, in file order; cycles if ``num_prompts`` exceeds the file.

    Each line is an object with a string ``prompt`` and an optional integer
    ``max_tokens``. Blank lines are skipped. Without a tokenizer the prompt
    length is recorded as 0 (the server's reported usage fills it in later).
    """
    records: list[tuple[str, int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            max_tokens = obj.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{path}:{lineno}: 'max_tokens' must be a positive integer")
            records.append((obj["prompt"], max_tokens))
    if not records:
        raise ValueError(f"{path}: no prompts")
    n = len(records) if num_prompts is None else num_prompts
    samples = []
    for i in range(n):
        prompt, max_tokens = records[i % len(records)]
        prompt_len = count_tokens(tokenizer, prompt) if tokenizer is not None else 0
        samples.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, max_tokens=max_tokens))
    return samples


def build_dataset(args: Any, tokenizer: Any | None) -> list[SampleRequest]:
    """Dispatch on ``args.dataset`` using the options added by ``benchmarks.serve.add_cli_args``."""
    if args.dataset in ("random", "prefix") and tokenizer is None:
        raise ValueError(f"the {args.dataset!r} dataset needs a tokenizer (--tokenizer)")
    if args.dataset == "random":
        return random_dataset(
            tokenizer,
            num_prompts=args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
        )
    if args.dataset == "prefix":
        return prefix_dataset(
            tokenizer,
            num_prompts=args.num_prompts,
            num_prefixes=args.prefix_num_prefixes,
            prefix_len=args.prefix_len,
            suffix_len=args.prefix_suffix_len,
            output_len=args.prefix_output_len,
            seed=args.seed,
        )
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("the 'jsonl' dataset needs --dataset-path")
        return jsonl_dataset(
            args.dataset_path,
            num_prompts=args.num_prompts,
            default_max_tokens=args.jsonl_output_len,
            tokenizer=tokenizer,
        )
    raise ValueError(f"unknown dataset {args.dataset!r}")


def summarize(samples: Sequence[SampleRequest]) -> str:
    """One line describing a dataset's size and token lengths."""
    if not samples:
        return "0 prompts"
    ins = [s.prompt_len for s in samples]
    outs = [s.max_tokens for s in samples]
    return (
        f"{len(samples)} prompts, input tokens {min(ins)}..{max(ins)} (total {sum(ins)}), "
        f"max output tokens {min(outs)}..{max(outs)} (total {sum(outs)})"
    )
