"""Unit tests, laid out like the code."""
