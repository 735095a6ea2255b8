"""Helpers shared by the tests (fixtures, fakes, reference models)."""
