"""N-gram prompt lookup (vLLM's `method: ngram`): continue a request's own text.

If the last n tokens of a sequence occurred earlier in it, the tokens that followed
that occurrence are a cheap guess for what comes next: copying, rewriting and code
edits repeat long stretches of the prompt.
"""

from __future__ import annotations

import numpy as np


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the earliest occurrence of the longest suffix of
    `tokens` whose length is in [min_n, max_n]; empty if there is none. (vLLM's rule:
    the earliest occurrence leaves the most tokens after it in a repeating text.)

    Worked example: tokens [5 1 2 3 9 1 2 3 7 1 2 3], min_n 2, max_n 3, k 4.
      suffix of 3 = [1 2 3] occurs ending at 3 and at 7 (the suffix itself, ending at
      11, does not count); the earliest is 3 -> draft tokens[4:8] = [9 1 2 3].
    Occurrences are grown from length 1: `ends` holds the end positions j of the
    occurrences of the suffix of the current length (j < len - 1, so at least one
    token follows); one more token of the suffix keeps those with
    tokens[j - length] == tokens[-1 - length].
    """
    num_tokens = len(tokens)
    if num_tokens < min_n + 1 or k <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_end = int(ends[0]) if (min_n <= 1 and ends.size) else -1
    length = 1
    while length < max_n and ends.size:
        ends = ends[ends >= length]
        ends = ends[tokens[ends - length] == tokens[num_tokens - 1 - length]]
        length += 1
        if length >= min_n and ends.size:
            best_end = int(ends[0])
    if best_end < 0:
        return tokens[:0]
    return tokens[best_end + 1: best_end + 1 + k]
