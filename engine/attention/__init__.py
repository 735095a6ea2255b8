"""Paged attention: the layer models call, its metadata and its backends."""

from engine.attention.forward_context import get_forward_context, set_forward_context
from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "get_forward_context", "set_forward_context"]
