"""Schema fuzzing: schemathesis generates requests from the server's own /openapi.json
(valid ones, and invalid ones in "negative" mode) for every /v1/* operation and
/tokenize, /detokenize, at least 50 each, and for the other APIs' operations (OpenAI
Responses, Anthropic Messages, Ollama's /api/*), at least 25 each. No answer may be a 5xx, every answer must
match the documented schema (status, content type, body), and the server must answer
normally afterwards.

The server runs the echo FakeExecutor with a small context (max_model_len 48) and low
caps (n, prompts per request), so that any valid request finishes in milliseconds.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from server.common.lifecycle import ServerLimits
from tests.support.reliability_fixtures import start_server
from tests.support.server_fixtures import build_tokenizer_dir

NUM_EXAMPLES = 60
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer_dir = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    thread = start_server(tokenizer_dir, max_model_len=48, max_num_seqs=64,
                          limits=ServerLimits(max_n=4, max_prompts_per_request=4,
                                              max_request_body_bytes=1 << 20))
    yield thread
    # Afterwards the server still answers normally.
    response = httpx.post(thread.url + "/v1/completions", timeout=10, json={
        "prompt": "Hello world", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert httpx.get(thread.url + "/health").status_code == 200
    engine = thread.server.state.engine
    assert engine.num_unfinished_requests == 0
    thread.stop()


# The embedding routes answer this chat model with 400s (it does not pool); their
# success path is tests/server/test_embeddings_api.py's.
OPERATIONS = ["GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions",
              "POST /tokenize", "POST /detokenize", "POST /v1/embeddings"]
# The other APIs (translations onto the chat path): fewer examples each.
OTHER_API_OPERATIONS = [
    "POST /v1/responses", "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}", "POST /v1/messages",
    "POST /v1/messages/count_tokens", "POST /api/chat", "POST /api/generate",
    "POST /api/show", "POST /api/embed", "POST /api/embeddings", "POST /v1/score",
    "POST /v1/rerank", "POST /v1/chat/completions/render", "POST /v1/completions/render"]
# Operations without inputs: nothing to fuzz (tests/server/test_ollama_api.py calls them).
NO_INPUT_OPERATIONS = ["GET /api/tags", "GET /api/ps", "GET /api/version", "GET /v1/loads"]
NUM_OTHER_EXAMPLES = 25
GENERATING = {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
              "POST /detokenize", "POST /v1/responses", "POST /v1/messages",
              "POST /v1/messages/count_tokens", "POST /api/chat", "POST /api/generate",
              "POST /v1/chat/completions/render", "POST /v1/completions/render"}
# Operations whose `model` is required: a valid case names the served model.
MODEL_REQUIRED = {"POST /v1/messages", "POST /v1/messages/count_tokens", "POST /api/chat",
                  "POST /api/generate", "POST /api/show", "POST /api/embed",
                  "POST /api/embeddings"}


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return schema.include(path_regex=r"^/(v1/.*|api/.*|tokenize|detokenize)$")


@pytest.fixture(scope="module")
def http_session():
    import requests

    with requests.Session() as session:
        yield session


def test_every_v1_operation_is_fuzzed(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(OPERATIONS + OTHER_API_OPERATIONS + NO_INPUT_OPERATIONS), labels


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda mode: mode.value)
@pytest.mark.parametrize("label", OPERATIONS + OTHER_API_OPERATIONS)
def test_fuzz(api_schema, http_session, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label
    statuses: list[int] = []
    num_examples = NUM_EXAMPLES if label in OPERATIONS else NUM_OTHER_EXAMPLES
    # The other APIs' requests are valid less often (e.g. blocks in the wrong role):
    # more of them are "served".
    served_cases = st.booleans() if label in OPERATIONS else st.sampled_from([True] * 3 + [False])

    @given(case=operation.as_strategy(generation_mode=mode), served=served_cases)
    @settings(max_examples=num_examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def fuzz(case, served):
        if served and isinstance(case.body, dict):
            # A random `model` is a 404; a random `priority` (fcfs server), `best_of`
            # (!= n), `suffix` or continue_final_message (true needs add_generation_prompt
            # false) a 400: in half the cases leave them out, so that more requests reach
            # the engine.
            for field in ("model", "priority", "best_of", "suffix", "continue_final_message"):
                case.body.pop(field, None)
            if label in MODEL_REQUIRED:
                case.body["model"] = "fake-echo"
            if label == "POST /v1/messages":  # required; most values overflow the context
                case.body["max_tokens"] = 4
            # Tools need a tool-call parser (this server has none); options.num_ctx and
            # num_predict mostly overflow the context.
            for field in ("tools", "tool_choice", "options"):
                case.body.pop(field, None)
            case.body.pop("previous_response_id", None)  # a random id is a 404
        response = case.call_and_validate(session=http_session, checks=CHECKS, timeout=30)
        statuses.append(response.status_code)

    fuzz()
    print(f"\n{label} ({mode.value}): statuses {dict(sorted(Counter(statuses).items()))}")
    assert len(statuses) >= num_examples - 10, len(statuses)
    if mode is GenerationMode.POSITIVE and label in GENERATING:
        # Enough valid requests got through validation to exercise the engine path.
        assert sum(200 <= status < 300 for status in statuses) >= \
            (5 if label in OPERATIONS else 3), statuses
