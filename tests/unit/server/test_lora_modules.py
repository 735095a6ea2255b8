"""--lora-modules' value (server/common/lora.py): name=path entries, vLLM's JSON object
(whose spaces are not separators), or a JSON list of either."""

from __future__ import annotations

import pytest

from server.common.lora import lora_modules_list, parse_lora_module


def test_entries_separated_by_spaces():
    assert lora_modules_list("sql=/a/sql  chat=/a/chat") == ["sql=/a/sql", "chat=/a/chat"]


def test_a_json_object_keeps_its_spaces():
    text = '{"name": "chat", "path": "/a/chat"}'
    assert [parse_lora_module(e) for e in lora_modules_list(text)] == [
        {"name": "chat", "path": "/a/chat"}]


def test_a_json_list_of_either():
    entries = lora_modules_list('["sql=/a/sql", {"name": "chat", "path": "/a/chat"}]')
    assert [parse_lora_module(e) for e in entries] == [
        {"name": "sql", "path": "/a/sql"}, {"name": "chat", "path": "/a/chat"}]


@pytest.mark.parametrize("bad", ["sql", "=/a/sql", '{"name": "x"}'])
def test_malformed_entries_say_so(bad):
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_module(bad)
