"""Structured outputs: ``response_format`` json_object and json_schema (strict) through the
real ``openai`` client, streamed and not, for every method; a schema xgrammar cannot
compile is a 400 naming it; grammars are compiled once per schema (in-process app over a
tiny random model whose tokenizer is byte-level, so every JSON text has tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvblend.engine import Engine
from kvblend.generation import grammar
from tests.conftest import CHATML, make_hf_model
from tests.server.helpers import openai_in_process

MESSAGES = [{"role": "user", "content": "Where does the doctor work? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                                           "sure": {"type": "boolean"},
                                           "floor": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "sure", "floor"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def byte_level_tokenizer():
    """One token per byte (GPT-2's byte alphabet, no merges) and ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", additional_special_tokens=specials[1:])
    tok.chat_template = CHATML
    return tok


def byte_level_model(**overrides):
    from kvblend.models.config import ModelConfig
    from kvblend.models.loader import LoadedModel, build_model

    tok = byte_level_tokenizer()
    hf = make_hf_model("llama", seed=1, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, **overrides)
    cfg = ModelConfig.from_hf(hf.config)
    model = build_model(cfg, {k: v.clone() for k, v in hf.state_dict().items()}, "cpu", torch.float32)
    return LoadedModel("tiny-bytes", Path("."), cfg, model, tok, "tiny-bytes-1")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_in_process(Engine(byte_level_model()), tmp_path_factory.mktemp("state")) as served:
        yield served


@pytest.mark.parametrize("method", ["full", "blend", "reuse", "prefix"])
def test_a_strict_json_schema_answer_is_valid_for_every_method(served, method) -> None:
    _, _, client = served
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed, response_format=JSON_SCHEMA,
            extra_body={"kvblend": {"method": method}, "documents": ["The doctor works in Paris on floor 3."]})
        assert r.model_extra["kvblend"]["method"] == method
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        answer = json.loads(choice.message.content)
        assert set(answer) == {"city", "sure", "floor"}
        assert list(answer) == ["city", "sure", "floor"] and answer["city"] in ("Paris", "Lyon", "Nice")
        assert isinstance(answer["sure"], bool) and type(answer["floor"]) is int and 0 <= answer["floor"] <= 99


def test_without_a_format_the_same_model_does_not_write_that_json(served) -> None:
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=0,
                                       extra_body={"kvblend": {"method": "full"}})
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)  # a random model: the mask is what made it JSON


def test_a_streamed_json_schema_answer_is_the_same_as_the_whole_one(served) -> None:
    _, _, client = served
    args = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=7, response_format=JSON_SCHEMA,
                extra_body={"kvblend": {"method": "full"}})
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                       if c.choices)
    assert streamed == whole and json.loads(streamed)["sure"] in (True, False)


def test_json_object_gives_an_object_in_chat_and_completions(served) -> None:
    _, _, client = served
    done = 0
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"},
                                           extra_body={"kvblend": {"method": "full"}})
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":  # a random model may still be inside a string at max_tokens
            assert isinstance(json.loads(text), dict)
            done += 1
    assert done >= 1
    c = client.completions.create(model="tiny", prompt="JSON:", max_tokens=150, temperature=0, n=2, seed=1,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "a", "schema": SCHEMA, "strict": True}}, "kvblend": {"method": "full"}})
    assert [set(json.loads(ch.text)) for ch in c.choices] == [set(SCHEMA["properties"])] * 2


def test_n_choices_each_follow_the_schema(served) -> None:
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=3, n=3,
                                       response_format=JSON_SCHEMA, extra_body={"kvblend": {"method": "full"}})
    assert len(r.choices) == 3 and all(json.loads(c.message.content).keys() == SCHEMA["properties"].keys()
                                       for c in r.choices)


@pytest.mark.parametrize("schema,names", [
    ({"type": "nonsense"}, "nonsense"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "$defs"),
    ({"type": "string", "pattern": "(?<=a)b"}, "Lookbehind"),
    # compiled by xgrammar but not enforced ([1, 1] passes uniqueItems): refused, never ignored
    ({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "'uniqueItems' (at #/properties/ids)"),
    ({"$defs": {"n": {"not": {"type": "string"}}}, "$ref": "#/$defs/n"}, "'not' (at #/$defs/n)"),
])
def test_a_schema_xgrammar_cannot_compile_is_a_400_naming_it_and_the_next_request_succeeds(served, schema,
                                                                                            names) -> None:
    _, http, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and names in err["message"], err
    ok = http.post("/v1/chat/completions", json={**body, "response_format": JSON_SCHEMA, "max_tokens": 120})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("fmt,param", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
])
def test_a_malformed_response_format_is_a_400_naming_the_field(served, fmt, param) -> None:
    _, http, _ = served
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_grammars_are_compiled_once_per_schema(served, monkeypatch) -> None:
    engine, _, client = served
    compiles = []
    real = grammar.Grammars._compile

    def counted(self, fmt):
        compiles.append(fmt)
        return real(self, fmt)

    monkeypatch.setattr(grammar.Grammars, "_compile", counted)
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema, "strict": True}}
    for seed in range(3):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=seed,
                                       response_format=fmt, extra_body={"kvblend": {"method": "full"}})
    assert len(compiles) == 1


def test_keywords_are_found_only_where_a_schema_can_hold_them() -> None:
    """A property named like a keyword, and keyword-like text inside enum/const data, are
    not keywords; a keyword nested in anyOf / items / additionalProperties is."""
    ok = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"uniqueItems": True}]}},
          "required": ["not"]}
    grammar.refuse_unenforced(ok)
    for bad, where in (({"anyOf": [{"type": "integer", "multipleOf": 3}]}, "#/anyOf/0"),
                       ({"type": "array", "items": {"type": "object", "dependentRequired": {}}}, "#/items"),
                       ({"type": "object", "additionalProperties": {"if": {}}}, "#/additionalProperties")):
        with pytest.raises(grammar.GrammarError, match=f"at {where}"):
            grammar.refuse_unenforced(bad)


def test_a_deeply_nested_schema_is_walked_without_recursion() -> None:
    """A client's schema nested past Python's recursion limit: refused by name, not a
    RecursionError on the worker."""
    schema: dict = {"type": "array", "items": {"type": "integer", "uniqueItems": True}}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(grammar.GrammarError, match="uniqueItems"):
        grammar.refuse_unenforced(schema)


def test_logprobs_under_a_schema_are_of_the_masked_distribution(served) -> None:
    _, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=5, response_format=JSON_SCHEMA,
                                       extra_body={"kvblend": {"method": "full"}})
    first = r.choices[0].logprobs.content[0]
    # a schema's answer can only open with "{" (the byte-level vocabulary has one token for it):
    # the draw's distribution puts all its mass there and lists no forbidden alternative
    assert first.token == "{" and first.logprob == pytest.approx(0.0, abs=1e-9)
    assert [t.token for t in first.top_logprobs] == ["{"]
