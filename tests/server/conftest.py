"""Fixtures the server tests share across modules."""

from __future__ import annotations

import pytest

from tests.support.server_fixtures import build_tokenizer_dir, start_echo_chat_server


@pytest.fixture(scope="session")
def echo_chat_server(tmp_path_factory):
    """One echo chat server (start_echo_chat_server) for the Responses, Anthropic and
    Ollama API tests; a test that changes its state puts it back."""
    thread = start_echo_chat_server(build_tokenizer_dir(tmp_path_factory.mktemp("echo-tok")))
    yield thread
    thread.stop()
