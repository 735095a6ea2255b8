"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF)."""

from engine.structured_output.manager import RequestGrammar, StructuredOutputManager
from engine.structured_output.params import GRAMMAR_KINDS, StructuredOutputsParams

__all__ = ["GRAMMAR_KINDS", "RequestGrammar", "StructuredOutputManager", "StructuredOutputsParams"]
