"""Drop-in for RAG frameworks: LangChain and LlamaIndex, unchanged and without
``extra_body``, paste passages into the message text and call ``kvblend serve`` (the real
SmolLM2, in process on loopback). Once the passages are registered (or, with discovery,
seen twice) a later question over them reuses their KV: ``cached_tokens`` read from the raw
response covers at least 80% of the passages' tokens."""

from __future__ import annotations


import httpx
import pytest

from kvblend.engine import Engine
from kvblend.models import load_model
from kvblend.server.app import create_app
from kvblend.settings import Settings
from tests.server.helpers import uvicorn_thread

MODEL = "smollm2-135m"
KEYS = {"key-langchain": "langchain", "key-llamaindex": "llamaindex", "key-discovery": "discovery"}
PASSAGES = [
    "The Varden lighthouse stands on a granite spur at the mouth of the Selk estuary. It was "
    "built in 1871 by the harbour board of Marrow, after two grain ships ran aground on the "
    "shoals in a single winter. Its lamp burned colza oil until 1910, when it was converted to "
    "paraffin, and it was automated in 1987. The keeper's cottage is now a small museum about "
    "the estuary's fishing fleet.",
    "Marrow is a port town of about nine thousand people on the north bank of the Selk. Its "
    "economy grew on herring and later on the export of slate from the quarries at Penhallow, "
    "carried down the valley on a narrow-gauge railway that closed in 1953. The town hall, "
    "finished in 1889, houses the records of the harbour board, including the plans of the "
    "lighthouse and the accounts of its construction.",
    "The Penhallow quarries produced a blue-grey slate prized for roofing across the region. "
    "At their peak, around 1900, they employed more than six hundred workers, many of whom "
    "lived in terraces built by the quarry company. Production declined after the First World "
    "War, and the last pit closed in 1969. The flooded workings are now a nature reserve with "
    "a walking trail to the old incline.",
]
QUESTIONS = ["When was the Varden lighthouse built?", "What did the Penhallow quarries produce?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``kvblend serve``'s app over SmolLM2 under uvicorn in a thread; discovery on (it only
    adds passages outside the spans matched, so registered passages are matched as usual)."""
    settings = Settings(model=MODEL, api_keys=KEYS, state_dir=str(tmp_path_factory.mktemp("dropin")),
                        documents={"discover": True, "discover_tokens": 48})
    engine = Engine(load_model(MODEL))
    with uvicorn_thread(create_app(engine, settings)) as url:
        yield engine, url


def passage_tokens(engine: Engine) -> int:
    return sum(len(engine.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PASSAGES)


def register(url: str, key: str) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        for p in PASSAGES:
            assert client.post("/v1/documents", json={"text": p}).status_code == 200


def langchain_ask(url: str, key: str, question: str) -> dict:
    """A standard stuff-the-context chain; the raw usage of its answer."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are a helpful assistant."),
        ("human", "Answer using the context:\n\n{context}\n\nQuestion: {question}"),
    ])
    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=key, max_tokens=8, temperature=0)
    reply = (prompt | llm).invoke({"context": "\n\n".join(PASSAGES), "question": question})
    assert reply.content.strip()
    return reply.response_metadata["token_usage"]


def llamaindex_ask(url: str, key: str, question: str):
    """LlamaIndex's default text-QA prompt over the passages; the raw completion."""
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=f"{url}/v1", api_key=key, is_chat_model=True, max_tokens=8,
                     temperature=0, context_window=8192)
    messages = DEFAULT_TEXT_QA_PROMPT.format_messages(context_str="\n\n".join(PASSAGES), query_str=question)
    reply = llm.chat(messages)
    assert reply.message.content.strip()
    return reply.raw


def test_langchain_reuses_registered_passages(server) -> None:
    engine, url = server
    register(url, "key-langchain")
    for question in QUESTIONS:
        usage = langchain_ask(url, "key-langchain", question)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.8 * passage_tokens(engine), usage


def test_llamaindex_reuses_registered_passages_and_reports_the_spans(server) -> None:
    engine, url = server
    register(url, "key-llamaindex")
    for question in QUESTIONS:
        raw = llamaindex_ask(url, "key-llamaindex", question)
        assert raw.usage.prompt_tokens_details.cached_tokens >= 0.8 * passage_tokens(engine), raw.usage
        matches = raw.model_extra["kvblend"]["matches"]
        assert [m["source"] for m in matches] == ["stored"] * len(PASSAGES)
        assert all(m["document"] and m["message"] == 0 and m["end"] > m["start"] for m in matches)


def test_langchain_with_discovery_stores_passages_from_their_second_sighting(server) -> None:
    """Discovery's admission: passages pasted once are computed as text and never stored;
    the second time they are sent they are stored (computed alone, blended); from then on,
    whatever the question, they are hits. (That a passage seen once is not stored is
    tests/engine/test_shaping.py's and tests/server/test_cache_fill.py's.)"""
    engine, url = server
    first = langchain_ask(url, "key-discovery", QUESTIONS[0])  # nothing registered, seen once: computed as text
    assert first["prompt_tokens_details"]["cached_tokens"] < 0.5 * passage_tokens(engine), first
    engine.flush()
    # from the second sighting on, the passages are stored where they are not already inside
    # what the prefix cache serves (the retriever's order decides how far an exact prefix reaches)
    for question in (QUESTIONS[1], "Where is the Varden lighthouse?"):
        langchain_ask(url, "key-discovery", question)
        engine.flush()
    last = langchain_ask(url, "key-discovery", "Where exactly is the Varden lighthouse?")
    assert last["prompt_tokens_details"]["cached_tokens"] >= 0.8 * passage_tokens(engine), last
