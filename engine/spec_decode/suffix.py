"""Suffix lookup over this server's recent sequences (`method: suffix`).

Agent loops and repeated tasks make a model write what it (or another request) wrote
before. `SuffixIndex` remembers the last `max_sequences` finished sequences (prompt and
output, each cut to its last `max_tokens_per_sequence` tokens) and maps every n-gram of
length `min_n` in them to where it ends. A request's draft is what followed the
occurrence that matches the longest suffix of its tokens (up to `max_n`), most recent
first. Memory is bounded: at most max_sequences x max_tokens_per_sequence positions.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# Occurrences of one n-gram examined per lookup (the most recent ones).
_MAX_CANDIDATES = 16


class SuffixIndex:
    def __init__(self, min_n: int, max_n: int, max_sequences: int,
                 max_tokens_per_sequence: int = 4096):
        self.min_n = min_n
        self.max_n = max_n
        self.max_sequences = max_sequences
        self.max_tokens_per_sequence = max_tokens_per_sequence
        self._sequences: dict[int, np.ndarray] = {}
        self._order: deque[int] = deque()
        self._next_id = 0
        # n-gram (tuple of min_n tokens) -> [(sequence id, end position)], oldest first.
        self._ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def add(self, tokens: np.ndarray) -> None:
        """Remember a finished sequence (a copy of its last tokens); evicts the oldest."""
        tokens = np.array(tokens[-self.max_tokens_per_sequence:], dtype=np.int64)
        if len(tokens) <= self.min_n:
            return
        if len(self._order) >= self.max_sequences:
            self._evict(self._order.popleft())
        seq_id = self._next_id
        self._next_id += 1
        self._sequences[seq_id] = tokens
        self._order.append(seq_id)
        values = tokens.tolist()
        n = self.min_n
        for end in range(n - 1, len(values) - 1):  # at least one token follows
            self._ends.setdefault(tuple(values[end - n + 1:end + 1]), []).append((seq_id, end))

    def _evict(self, seq_id: int) -> None:
        values = self._sequences.pop(seq_id).tolist()
        n = self.min_n
        for end in range(n - 1, len(values) - 1):
            key = tuple(values[end - n + 1:end + 1])
            ends = self._ends.get(key)
            if ends is None:
                continue
            ends[:] = [e for e in ends if e[0] != seq_id]
            if not ends:
                del self._ends[key]

    def propose(self, tokens: np.ndarray, k: int) -> np.ndarray:
        """Up to k tokens that followed the best-matching remembered occurrence of the
        end of `tokens` (the longest match, at least min_n; ties: most recent)."""
        n = self.min_n
        if len(tokens) < n or k <= 0:
            return tokens[:0]
        candidates = self._ends.get(tuple(tokens[-n:].tolist()))
        if not candidates:
            return tokens[:0]
        suffix = tokens[-self.max_n:][::-1]
        best_len, best = 0, None
        for seq_id, end in reversed(candidates[-_MAX_CANDIDATES:]):
            seq = self._sequences[seq_id]
            # Length of the common suffix of tokens and seq[:end + 1], up to max_n.
            window = seq[max(0, end + 1 - self.max_n):end + 1][::-1]
            limit = min(len(window), len(suffix))
            mismatch = np.flatnonzero(window[:limit] != suffix[:limit])
            length = int(mismatch[0]) if mismatch.size else limit
            if length > best_len:
                best_len, best = length, seq[end + 1:end + 1 + k]
        return best if best is not None else tokens[:0]
