"""The cache fills where the traffic is (issue #40), on the real SmolLM2 behind the HTTP
API: a miss is stored by the request that missed, so each of three concurrent clients hits
its documents on its second request; a repeated plain prompt and a chat's previous turn
(prompt and answer) are served from the prefix cache."""

from __future__ import annotations

import json

import httpx
import pytest

from kvblend.data import MUSIQUE_RAG, format_musique_passage
from kvblend.engine import Engine
from kvblend.server.app import create_app
from kvblend.settings import Settings
from tests.server.helpers import concurrently, uvicorn_thread

MODEL = "smollm2-135m"
SYSTEM = "Answer the question from the passages. Give only the answer, in a few words."


def passages() -> list[str]:
    items = json.loads(MUSIQUE_RAG.read_text(encoding="utf-8"))
    return [format_musique_passage(c["title"], c["text"]) for item in items for c in item["ctxs"]]


def serve(smollm2, tmp_path, **settings):
    engine = Engine(smollm2)
    app = create_app(engine, Settings(model=MODEL, state_dir=str(tmp_path), **settings))
    return engine, uvicorn_thread(app)


def ask(url: str, messages: list[dict], **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def server(smollm2_calibrated, tmp_path_factory):
    engine, running = serve(smollm2_calibrated, tmp_path_factory.mktemp("fill"))
    with running as url:
        yield url
    engine.close()


def test_each_of_three_concurrent_clients_hits_its_documents_on_its_second_request(server) -> None:
    docs = passages()

    def client(i: int) -> list[tuple[int, int, int]]:  # (hits, misses, chunks) per request
        got = []
        for k in range(2):  # back to back, while the other clients prefill theirs; another question
            # each time (a repeat of the whole prompt would be served its first blend whole)
            block = ask(server, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Question {i}.{k}: who is named first?"}],
                        documents=docs[2 * i : 2 * i + 2])["kvblend"]
            got.append((sum(block["doc_hits"].values()), block["doc_misses"], len(block["documents"])))
        return got

    for (hits, misses, chunks), again in concurrently(client, 3).values():
        # a long passage is stored as chunks, each a hit; the first request's are misses it stored
        assert chunks >= 2 and (hits, misses) == (0, chunks) and again == (chunks, 0, chunks)


def test_a_repeated_plain_prompt_is_served_from_the_cache(server) -> None:
    # text no test stores (passages' words reversed): a prompt holding runs of stored text is
    # blended instead, its runs reused (tests/server/test_any_chunking.py)
    context = "\n\n".join(" ".join(reversed(p.split())) for p in passages()[6:8])
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{context}\n\nQuestion: which place is described first?"}]
    first, again = ask(server, messages), ask(server, messages)
    assert cached(first) < 0.1 * first["usage"]["prompt_tokens"]
    assert cached(again) >= 0.9 * again["usage"]["prompt_tokens"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_repeated_prompt_pasting_stored_passages_is_served_its_first_blend(server) -> None:
    """A prompt holding runs of stored text is a blend, never exact; its repeat (and the next
    turn of its chat) is served the first blend's KV whole: cached almost entirely, the same answer."""
    docs = [passages()[i] for i in (8, 11)]
    ask(server, [{"role": "user", "content": "Which is first?"}], documents=docs)  # stores them
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "\n\n".join(docs) + "\n\nQuestion: which place is described first?"}]
    first, again = ask(server, messages), ask(server, messages)
    assert first["kvblend"]["method"] == "blend" and first["kvblend"]["doc_hits"]  # runs of stored text reused
    n = first["usage"]["prompt_tokens"]
    assert first["kvblend"]["prefix_hit_tokens"] < 0.1 * n  # blended: only the text before the first run is exact
    assert again["kvblend"]["prefix_hit_tokens"] == n - 1 and not again["kvblend"]["doc_hits"]  # nothing blended again
    assert cached(again) == n - 1
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the second?"}]
    assert cached(ask(server, turn2)) > first["usage"]["prompt_tokens"]


def test_a_chats_next_turn_reuses_the_previous_prompt_and_answer(server) -> None:
    context = "\n\n".join(passages()[9:11])
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"{context}\n\nQuestion: what is the first passage about?"}]
    first = ask(server, turn1)
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the second?"}]
    second = ask(server, turn2)
    prompt1, answer1 = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
    assert cached(second) > prompt1  # the answer's tokens too, not only the previous prompt
    assert cached(second) >= prompt1 + answer1 - 2  # all of it but the last token (never computed) and its EOS
