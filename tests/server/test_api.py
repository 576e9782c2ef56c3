"""The OpenAI-compatible API of a real ``kvblend serve`` (tiny model), driven with httpx
and the official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import ALICE

DOCS = ["the doctor works in paris . the city of paris is blue .",
        "the company led by the doctor is headquartered in rome ."]
QUESTION = "where is the company headquartered ?"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=ALICE, max_retries=0, timeout=60)


@pytest.fixture
def model_id(alice):
    return alice.get("/v1/models").json()["data"][0]["id"]


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": QUESTION}], "documents": DOCS,
            "max_tokens": 8, "temperature": 0, **extra}


def test_models_and_health(server, alice, tiny_model_dir) -> None:
    models = alice.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == tiny_model_dir and card["object"] == "model" and card["max_model_len"] == 2048
    assert {"created", "owned_by"} <= set(card)
    health = httpx.get(server.url + "/health")  # no key needed
    assert health.status_code == 200 and health.content == b""


def test_chat_with_documents_through_the_openai_client(client, model_id) -> None:
    first = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0,
        extra_body={"documents": [DOCS[0], {"text": DOCS[1], "id": "d1"}], "kvblend": {"method": "blend"}})
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert isinstance(first.choices[0].message.content, str)
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= 6
    block = first.model_extra["kvblend"]
    assert block["method"] == "blend" and len(block["documents"]) == 2
    for doc in DOCS:  # wait for the misses' background write-back: storing is idempotent and synchronous
        assert client.post("/documents", body={"text": doc}, cast_to=object)["tokens"] > 0
    again = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "and " + QUESTION}], max_tokens=6, temperature=0,
        extra_body={"documents": DOCS})
    # the second time both documents' KV comes from the store (another question: the same prompt
    # again would be served the first blend whole, tests/server/test_cache_fill.py)
    assert again.model_extra["kvblend"]["doc_hits"] == {"memory": 2}
    doc_tokens = sum(d["tokens"] for d in again.model_extra["kvblend"]["documents"])
    assert again.usage.prompt_tokens_details.cached_tokens >= doc_tokens > 0
    assert 0 < again.model_extra["kvblend"]["recompute_fraction"] < 1


def test_per_request_strategy_options_reach_the_engine(client, model_id) -> None:
    def ask(**kvblend):
        return client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=6, temperature=0,
            extra_body={"documents": DOCS, "kvblend": kvblend})

    full = ask(method="full")
    chosen = ask(method="blend", selection="question", budget=False, sinks=2, shift=True, ratio=0.5)
    assert chosen.model_extra["kvblend"]["strategy"] == "question+sinks2+shift"
    assert 0 < chosen.model_extra["kvblend"]["recompute_fraction"] < 1
    exact = ask(method="blend", selection="question", shift=True, ratio=1.0)  # ratio 1 is a full prefill
    assert exact.choices[0].message.content == full.choices[0].message.content
    assert "strategy" not in full.model_extra["kvblend"]
    deviation = ask(method="blend", check_layers=[1], ratio=0.5)  # a deviation knob alone: deviation selection
    assert deviation.model_extra["kvblend"]["strategy"].split("+")[0] == "deviation"


def test_chat_streaming_with_usage_through_the_openai_client(client, model_id) -> None:
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"documents": DOCS, "kvblend": {"method": "full"}})  # full: the same KV both times
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in body)
    whole = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        extra_body={"documents": DOCS, "kvblend": {"method": "full"}})
    assert text == whole.choices[0].message.content  # greedy: streamed == non-streamed


def test_continuous_usage_gives_every_token_its_chunk_with_running_usage(client, model_id) -> None:
    """vLLM's ``continuous_usage_stats``: each token is one chunk (text or not), each chunk
    carries the running usage, the first token's chunk already knows the prompt's size."""
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"documents": DOCS, "kvblend": {"method": "full"}, "ignore_eos": True})
    role, *tokens, last = list(stream)
    assert role.usage.completion_tokens == 0 and last.choices == []
    assert [c.usage.completion_tokens for c in tokens] == list(range(1, 13)) and last.usage.completion_tokens == 12
    assert {c.usage.prompt_tokens for c in [*tokens, last]} == {last.usage.prompt_tokens} and last.usage.prompt_tokens > 0


def test_a_one_token_stream_ends_with_its_kvblend_block(alice, model_id) -> None:
    """The request's stats reach the stream before its first token, so a stream whose first
    token is its last still reports the method and time breakdown."""
    body = {**chat_body(model_id), "max_tokens": 1, "stream": True, "kvblend": {"method": "full"}}
    with alice.stream("POST", "/v1/chat/completions", json=body) as r:
        payloads = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["kvblend"]["method"] == "full"


def test_completions_with_documents(alice, model_id, client) -> None:
    body = {"model": model_id, "prompt": "the doctor works in", "documents": DOCS, "max_tokens": 5,
            "temperature": 0, "kvblend": {"method": "full"}}
    r = alice.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and isinstance(data["choices"][0]["text"], str)
    assert data["usage"]["prompt_tokens"] > sum(len(d.split()) for d in DOCS)
    streamed = client.completions.create(model=model_id, prompt="the doctor works in", max_tokens=5, temperature=0,
                                         stream=True, extra_body={"documents": DOCS, "kvblend": {"method": "full"}})
    chunks = list(streamed)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == data["choices"][0]["text"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_raw_sse_format_ends_with_done(alice, model_id) -> None:
    with alice.stream("POST", "/v1/chat/completions", json=chat_body(model_id, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert "usage" not in payloads[0]  # without include_usage no usage field at all
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_documents_api_warms_then_requests_hit(alice, model_id) -> None:
    text = "the river of oslo is green . the novel was published in madrid ."
    posted = alice.post("/v1/documents", json={"text": text, "id": "oslo-river", "metadata": {"src": "t"}})
    assert posted.status_code == 200, posted.text
    doc = posted.json()
    assert doc["id"] == "oslo-river" and doc["tokens"] == 14 and doc["tier"] == "memory"
    assert alice.post("/v1/documents", json={"text": text, "id": "oslo-river", "metadata": {"src": "t"}}).json() == doc
    auto = alice.post("/v1/documents", json={"text": text}).json()
    assert auto["id"] == alice.post("/v1/documents", json={"text": text}).json()["id"]  # idempotent without id
    listed = {d["id"] for d in alice.get("/v1/documents").json()["data"]}
    assert {"oslo-river", auto["id"]} <= listed
    r = alice.post("/v1/chat/completions", json={**chat_body(model_id), "documents": [{"id": "oslo-river"}]}).json()
    assert r["kvblend"]["documents"][0]["source"] == "memory"
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 14
    conflict = alice.post("/v1/documents", json={"text": "other text", "id": "oslo-river"})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "id"
    assert alice.delete("/v1/documents/oslo-river").json() == {"id": "oslo-river", "object": "document",
                                                                "deleted": True}
    gone = alice.post("/v1/chat/completions", json={**chat_body(model_id), "documents": [{"id": "oslo-river"}]})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "documents.0.id"
    alice.delete(f"/v1/documents/{auto['id']}")
    # deleted from the store too: the same text inline is a miss now, the same prompt too (the
    # blend kept whole that was made from the deleted KV went with it)
    r = alice.post("/v1/chat/completions", json={**chat_body(model_id), "documents": [text]}).json()
    assert r["kvblend"]["documents"][0]["source"] == "chunk"


def test_document_listing_says_has_more_only_when_more_remain(alice) -> None:
    ids = ["zz-page-1", "zz-page-2"]  # the last ids of the tenant: exactly two rows after "zz-page-"
    for i in ids:
        assert alice.post("/v1/documents", json={"text": f"page {i} of the listing .", "id": i}).status_code == 200
    try:
        whole = alice.get("/v1/documents", params={"after": "zz-page-", "limit": 2}).json()
        assert [d["id"] for d in whole["data"]] == ids and whole["has_more"] is False
        first = alice.get("/v1/documents", params={"after": "zz-page-", "limit": 1}).json()
        assert [d["id"] for d in first["data"]] == ids[:1] and first["has_more"] is True
        assert first["last_id"] == ids[0]
    finally:
        for i in ids:
            alice.delete(f"/v1/documents/{i}")


@pytest.mark.parametrize("metadata,param", [
    ({"k": "x" * 513}, "metadata"),  # OpenAI's bound on a value: 512 characters
    ({"k" * 65: "v"}, "metadata"),
    ({"k": 2**70}, "metadata"),
], ids=["long value", "long key", "integer past 64 bits"])
def test_document_metadata_is_bounded(alice, metadata, param) -> None:
    r = alice.post("/v1/documents", json={"text": "the nurse works in rome .", "id": "meta-1", "metadata": metadata})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    assert alice.get("/v1/documents/meta-1").status_code == 404  # nothing stored


def test_a_lone_surrogate_in_metadata_is_refused_and_stores_nothing(alice) -> None:
    raw = b'{"text": "the nurse works in rome .", "id": "meta-2", "metadata": {"a": "\\ud800"}}'
    r = alice.post("/v1/documents", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata"), r.text
    assert alice.get("/v1/documents").status_code == 200  # the tenant's listing still answers
    assert alice.get("/v1/documents/meta-2").status_code == 404


def test_unknown_harmless_fields_are_ignored_and_logged(server, alice, model_id) -> None:
    r = alice.post("/v1/chat/completions", json=chat_body(model_id, user="u1", metadata={"x": 1}, store=False,
                                                          parallel_tool_calls=True, n=1, presence_penalty=0))
    assert r.status_code == 200, r.text
    assert "ignored unknown request fields: metadata, store" in server.log()  # parallel_tool_calls is known now


def test_per_request_options_override_defaults(alice, model_id) -> None:
    full = alice.post("/v1/chat/completions", json=chat_body(model_id, kvblend={"method": "full"})).json()
    assert full["kvblend"]["method"] == "full" and full["kvblend"]["recompute_fraction"] == 1.0
    blend = alice.post("/v1/chat/completions",
                       json=chat_body(model_id, kvblend={"method": "blend", "ratio": 1.0})).json()
    assert blend["kvblend"]["method"] == "blend"
    assert blend["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]  # ratio 1 == full


def test_sampling_options_are_applied(alice, model_id) -> None:
    a = alice.post("/v1/chat/completions", json=chat_body(model_id, temperature=1.0, seed=7, top_k=20, top_p=0.9,
                                                          max_tokens=16)).json()
    b = alice.post("/v1/chat/completions", json=chat_body(model_id, temperature=1.0, seed=7, top_k=20, top_p=0.9,
                                                          max_tokens=16)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]  # seeded
    capped = alice.post("/v1/chat/completions", json=chat_body(model_id, max_completion_tokens=3,
                                                               ignore_eos=True)).json()
    assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_answer_before_them(alice, model_id) -> None:
    full = {"method": "full"}  # the same prompt KV both times (blend's reuse would differ between miss and hit)
    whole = alice.post("/v1/chat/completions", json=chat_body(model_id, max_tokens=8, ignore_eos=True,
                                                              kvblend=full)).json()
    text = whole["choices"][0]["message"]["content"]
    words = text.split()
    assert len(words) >= 4, text
    stop = " " + words[2]
    cut = alice.post("/v1/chat/completions", json=chat_body(model_id, max_tokens=8, ignore_eos=True, kvblend=full,
                                                            stop=[stop])).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
