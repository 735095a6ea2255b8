"""Speculative decoding: proposers of draft tokens and the per-request bookkeeping.

The scheduler asks a `Speculator` for each decoding request's draft tokens, schedules
them as ordinary extra slots, and after the step tells it how many the model accepted
(the verification itself is a sampler rule: engine/sample/rejection.py). See
docs/speculative-decoding.md for the whole flow.
"""

from engine.spec_decode.ngram import find_ngram_draft
from engine.spec_decode.speculator import DRAFT_PLACEHOLDER, SpecDecodingStats, Speculator

__all__ = ["DRAFT_PLACEHOLDER", "SpecDecodingStats", "Speculator", "find_ngram_draft"]
