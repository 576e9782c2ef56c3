"""The OpenAI sampling surface through the real ``openai`` client: logprobs (chat and
completions, streamed and not) equal to a full forward pass's log-softmax, ``n`` choices
from one prefill, ``seed``, penalties and ``logit_bias`` (in-process app, tiny engine)."""

from __future__ import annotations

import pytest
import torch

from kvblend.engine import Engine, Request
from kvblend.generation import SamplingParams
from tests.conftest import make_loaded
from tests.server.helpers import openai_in_process

MESSAGES = [{"role": "user", "content": "who is the doctor ? where does the doctor work ?"}]
FULL = {"kvblend": {"method": "full"}, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_in_process(Engine(make_loaded()), tmp_path_factory.mktemp("state")) as served:
        yield served


def full_forward_logprobs(engine: Engine, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """log_softmax of one full forward over prompt + answer at each answer token: (T,)."""
    model = engine.model
    ids = torch.tensor(prompt_ids + answer[:-1])
    logits = model(ids, model.new_cache(len(ids)), "all")  # (P+T-1, V)
    rows = torch.log_softmax(logits[len(prompt_ids) - 1:].double(), -1)  # (T, V)
    return rows.gather(1, torch.tensor(answer)[:, None])[:, 0]


def chat_ids(engine: Engine) -> list[int]:
    return list(engine.layout(Request(messages=MESSAGES, method="full")).ids)


def test_chat_logprobs_equal_a_full_forward_log_softmax(served) -> None:
    engine, _, client = served
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body=FULL)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 == r.usage.completion_tokens
    text_of = lambda t: engine.tokenizer.decode([t])  # noqa: E731
    vocab = {text_of(t): t for t in range(len(engine.tokenizer))}
    answer = [vocab[c.token] for c in content]
    expected = full_forward_logprobs(engine, chat_ids(engine), answer)
    assert [c.logprob for c in content] == pytest.approx(expected.tolist(), abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == 5 and c.top_logprobs[0].token == c.token  # greedy: the best one
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-9)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


def test_streamed_chat_logprobs_are_the_same_one_entry_per_token(served) -> None:
    _, _, client = served
    args = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                extra_body=FULL)
    whole = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(**args, stream=True) for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [(e.token, round(e.logprob, 6)) for e in whole]
    assert [len(e.top_logprobs) for e in streamed] == [2] * 6


def test_completion_logprobs_have_openais_legacy_shape_streamed_and_not(served) -> None:
    engine, _, client = served
    prompt = "the doctor works in"
    args = dict(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=3, extra_body=FULL)
    lp = client.completions.create(**args).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(value, abs=1e-9)  # the drawn token is among them
    ids = list(engine.layout(Request(question=prompt, use_chat_template=False, method="full")).ids)
    vocab = {engine.tokenizer.decode([t]): t for t in range(len(engine.tokenizer))}
    expected = full_forward_logprobs(engine, ids, [vocab[t] for t in lp.tokens])
    assert lp.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


def biased_logprobs(client, forced: int) -> list:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3, logit_bias={str(forced): 100},
                                          extra_body=FULL).choices[0].logprobs.content


def test_logprobs_are_of_the_distribution_the_draw_used_after_logit_bias(served) -> None:
    engine, _, client = served
    forced = engine.tokenizer("paris", add_special_tokens=False)["input_ids"][0]
    content = biased_logprobs(client, forced)
    assert [c.token for c in content] == [engine.tokenizer.decode([forced])] * 4
    assert all(c.logprob > -1e-6 for c in content)  # +100 on one token: all the mass after the bias
    assert all(c.top_logprobs[0].token == c.token for c in content)


def test_logprobs_mode_raw_reports_the_models_distribution_when_logit_bias_forces_a_token(tmp_path) -> None:
    with openai_in_process(Engine(make_loaded()), tmp_path, logprobs_mode="raw") as (engine, _, client):
        forced = engine.tokenizer("paris", add_special_tokens=False)["input_ids"][0]
        content = biased_logprobs(client, forced)
        expected = full_forward_logprobs(engine, chat_ids(engine), [forced] * 4)
    assert [c.logprob for c in content] == pytest.approx(expected.tolist(), abs=1e-4)  # raw, not the biased ~0
    assert all(c.logprob < -0.5 for c in content)


def test_n_choices_share_one_prefill_and_a_seed_reproduces_them(served, monkeypatch) -> None:
    engine, _, client = served
    prefills = []
    real = engine.prepare_steps

    def counted(*args, **kwargs):
        prefills.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "prepare_steps", counted)
    args = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, n=3, seed=1234, extra_body=FULL)
    first = client.chat.completions.create(**args)
    assert len(prefills) == 1 and first.kvblend["choices"] == 3  # the stats say it: 3 choices, one prefill
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # each choice draws with its own generator
    assert first.usage.completion_tokens == 36 and first.usage.prompt_tokens == len(chat_ids(engine))
    again = client.chat.completions.create(**args)
    assert [c.message.content for c in again.choices] == texts
    streamed = {i: "" for i in range(3)}
    finished = set()
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert len(prefills) == 3  # one per request


def test_completions_serve_n_choices_too(served) -> None:
    _, _, client = served
    r = client.completions.create(model="tiny", prompt="the doctor", max_tokens=4, temperature=1.0, n=2, seed=3,
                                  logprobs=1, extra_body=FULL)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == 4 for c in r.choices)


def test_penalties_decode_by_the_engines_rules(served) -> None:
    engine, _, client = served
    penalties = dict(frequency_penalty=1.5, presence_penalty=0.5)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                       extra_body=FULL, **penalties)
    expected = engine.generate(Request(messages=MESSAGES, method="full"),
                               SamplingParams(max_tokens=10, ignore_eos=True, **penalties))
    plain = engine.generate(Request(messages=MESSAGES, method="full"), SamplingParams(max_tokens=10, ignore_eos=True))
    assert r.choices[0].message.content == expected.text
    assert expected.token_ids != plain.token_ids  # the penalties changed the greedy answer
    assert len(set(expected.token_ids)) > len(set(plain.token_ids))


def test_the_repetition_penalty_counts_the_prompt(served) -> None:
    engine, http, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **FULL}
    plain = http.post("/v1/chat/completions", json=body).json()
    penalised = http.post("/v1/chat/completions", json={**body, "repetition_penalty": 5.0}).json()
    assert plain["choices"][0]["message"]["content"] != penalised["choices"][0]["message"]["content"]


def itl_count(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("kvblend:inter_token_latency_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no inter-token latency count in /metrics")


def test_inter_token_latency_is_measured_within_each_choice(served) -> None:
    _, http, client = served
    before = itl_count(http)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=1.0, n=3, seed=2,
                                   extra_body=FULL)
    assert itl_count(http) - before == 3 * 4  # not 14: the gap between two choices' tokens is no latency


def test_more_choices_than_the_batch_has_rows_is_a_400_naming_n(served) -> None:
    _, http, _ = served
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "n": 9}  # default scheduler.max_running: 8
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "max_running" in r.text
    assert http.post("/v1/chat/completions", json={**body, "n": 8}).status_code == 200
