"""Tool calls through the real ``openai`` client: ``tools`` rendered by the model's own
template, ``tool_choice`` required / named enforced by the grammar and parsed into
``tool_calls`` (whole and streamed as deltas the client reassembles), the Hermes /
Qwen2.5 ``<tool_call>`` format parsed and held back while streaming, bad input a 400
naming the field (tiny random model with a byte-level tokenizer)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from starlette.testclient import TestClient

from kvblend.engine import Engine
from kvblend.server import create_app
from kvblend.server.tools import ToolPlan, ToolStream, parse_calls
from kvblend.settings import Settings
from tests.server.test_structured_outputs import byte_level_model

TOOLS_CHATML = (  # a Qwen2.5-like template: tools in the system turn, calls as <tool_call> JSON
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "shout", "parameters": {
        "type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]
FULL = {"kvblend": {"method": "full"}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    loaded = byte_level_model(max_position_embeddings=2048)  # the tools' JSON is a token per byte
    loaded.tokenizer.chat_template = TOOLS_CHATML
    engine = Engine(loaded)
    settings = Settings.load(model="tiny", state_dir=str(tmp_path_factory.mktemp("state")))
    with TestClient(create_app(engine, settings)) as http:
        yield engine, http, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    else:
        assert name == "shout" and isinstance(args["loud"], bool)


def test_required_gives_a_tool_call_of_one_of_the_tools(served) -> None:
    _, _, client = served
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=seed, extra_body=FULL)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)
        assert not choice.message.content


def test_a_named_function_streams_as_deltas_the_client_reassembles(served) -> None:
    _, _, client = served
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "shout"}},
            max_tokens=200, temperature=1.0, seed=5, stream=True, extra_body=FULL):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                slot = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                slot["name"] += delta.function.name or ""
                slot["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "shout"
    check_call("shout", calls[0]["arguments"])


def test_the_tools_reach_the_prompt_through_the_template(served) -> None:
    _, http, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **FULL}
    plain = http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    with_tools = http.post("/v1/chat/completions", json={**body, "tools": TOOLS}).json()["usage"]["prompt_tokens"]
    assert with_tools - plain > len(json.dumps(TOOLS[0]))  # one token per byte: the tools' JSON is there


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_input_is_a_400_naming_the_field_and_the_next_request_succeeds(served, fields, param) -> None:
    _, http, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **FULL}
    r = http.post("/v1/chat/completions", json={**body, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_model_whose_template_has_no_tool_format_says_so(tmp_path) -> None:
    engine = Engine(byte_level_model())  # plain ChatML: no tools variable
    settings = Settings.load(model="tiny", state_dir=str(tmp_path))
    with TestClient(create_app(engine, settings)) as http:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "no tool format" in r.json()["error"]["message"]


def test_completions_still_refuse_tools(served) -> None:
    _, http, _ = served
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


PLAN = ToolPlan(TOOLS, {"get_weather": {}, "shout": {}}, "auto", True)
HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
          '<tool_call>{"name": "shout", "arguments": {"loud": true}}</tool_call>')


def test_hermes_calls_are_parsed_and_other_text_stays_content() -> None:
    content, calls = parse_calls(HERMES, PLAN)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("shout", {"loud": True})]
    assert parse_calls(HERMES, PLAN._replace(parallel=False))[1][0]["function"]["name"] == "get_weather"
    unknown = '<tool_call>{"name": "fly", "arguments": {}}</tool_call>'
    assert parse_calls(unknown, PLAN) == (unknown, [])  # not a call of these tools: text


@pytest.mark.parametrize("cut", [1, 3, 7, 11])
def test_a_stream_holds_back_a_call_however_the_text_is_cut(cut) -> None:
    stream, shown = ToolStream(PLAN), []
    for i in range(0, len(HERMES), cut):
        shown.append(stream.feed(HERMES[i:i + cut]))
    rest, calls = stream.finish()
    assert "".join(shown) + rest == "Let me check. " + "" and len(calls) == 2
    plain = ToolStream(PLAN)
    assert "".join(plain.feed(ch) for ch in "a <tool and more") + plain.finish()[0] == "a <tool and more"


BARE = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'


@pytest.mark.parametrize("answer", [BARE, ' {"name": "get_weather", "arguments": {"city": "Oslo"}}',
                                    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'])
def test_an_answer_that_is_only_a_call_as_json_is_a_call(answer) -> None:
    content, calls = parse_calls(answer, PLAN)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("answer", ['{"name": "fly", "arguments": {}}', '```json\n{"city": "Oslo"}\n```',
                                    '{"name": "get_weather"} and then some', "```python\nprint(1)\n```"])
def test_json_that_is_not_only_calls_of_the_tools_stays_content(answer) -> None:
    assert parse_calls(answer, PLAN) == (answer, [])


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_a_stream_holds_back_an_answer_that_may_be_a_bare_call(cut) -> None:
    stream, shown = ToolStream(PLAN), []
    for i in range(0, len(BARE), cut):
        shown.append(stream.feed(BARE[i:i + cut]))
    assert "".join(shown) == "" and stream.finish()[1][0]["function"]["name"] == "get_weather"
    for text in ("`x is code`", "```python\nprint(1)\n```", "plain words"):
        plain = ToolStream(PLAN)
        shown = "".join(plain.feed(text[i:i + cut]) for i in range(0, len(text), cut))
        rest, calls = plain.finish()
        assert shown + rest == text and calls == []
