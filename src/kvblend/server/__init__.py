"""The OpenAI-compatible RAG server: ``create_app`` (FastAPI) and ``serve`` (uvicorn)."""

from kvblend.server.app import ServerState, create_app

__all__ = ["ServerState", "create_app"]
