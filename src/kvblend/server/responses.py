"""Completion objects and SSE chunks in OpenAI's shapes (chat and text completions).

``run_to_end`` collects a request while watching for the client leaving (vLLM's race
against ``http.disconnect``); ``sse_stream`` turns a request's events into SSE lines,
ending with ``data: [DONE]`` — after an error event when the request fails mid-stream.
A stream that is cancelled (the client left) cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from kvblend.engine import RequestStats
from kvblend.engine.scheduler import RequestHandle
from kvblend.generation import StreamEvent
from kvblend.generation.sampling import TokenLogprobs
from kvblend.server.errors import APIError, from_exception
from kvblend.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvblend.server.tools import ToolPlan, ToolStream, parse_calls
from kvblend.server.usage import kvblend_block, usage


@dataclass
class ChoiceResult:
    """One choice's text, tokens, finish reason and (when asked) logprobs, as collected."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    offset: int = 0  # characters of the token strings already sent (a completion's text_offset)
    tools: ToolStream | None = None  # a streamed chat's held-back tool calls (Shape.tools)


@dataclass
class StreamResult:
    """What the HTTP layer collected of one request's stream (each choice's text and
    tokens, stats, error or disconnect), for its response and log line (the scheduler's
    ``Outcome`` is another thing: how the request ended for the worker). ``text``,
    ``token_ids`` and ``finish_reason`` are choice 0's; ``tokens`` counts every choice's."""

    choices: list[ChoiceResult] = field(default_factory=lambda: [ChoiceResult()])
    tokens: int = 0
    finished: int = 0  # choices that have ended
    stats: RequestStats | None = None
    error: APIError | None = None
    disconnected: bool = False
    ended: bool = False  # set once the request was accounted for

    @property
    def text(self) -> list[str]:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    def add(self, item: StreamEvent | RequestStats) -> None:
        if isinstance(item, RequestStats):
            self.stats = item
            return
        while len(self.choices) <= item.index:
            self.choices.append(ChoiceResult())
        choice = self.choices[item.index]
        self.tokens += 1
        choice.token_ids.append(item.token_id)
        choice.text.append(item.text)
        if item.logprobs is not None:
            choice.logprobs.append(item.logprobs)
        if item.finish_reason is not None:
            choice.finish_reason = item.finish_reason
            self.finished += 1


@dataclass(frozen=True)
class Shape:
    """Which object family a route answers with."""

    chat: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    sources: tuple[dict[str, Any], ...] | None = None  # retrieved chunks used (retrieval requests)
    explain: Callable[[RequestStats], dict[str, Any]] | None = None  # when the request asked (server/explain.py)
    matches: tuple[dict[str, Any], ...] | None = None  # spans of the messages that became documents
    replica: str | None = None  # the model replica that served it (Ray Serve; None in one process)
    n: int = 1  # choices
    token_text: TokenText | None = None  # a token's string, when the request asked for logprobs
    tools: ToolPlan | None = None  # a chat whose answer may hold tool calls (server/tools.py)

    def kvblend(self, stats: RequestStats | None, queue_s: float, explain: bool = True,
                replica: str | None = None) -> dict[str, Any]:
        """The response's ``kvblend`` block, with the retrieved sources and the matched
        spans when there are any and, when asked and ``explain``, the recomputed tokens.
        ``replica``: the replica that answered, when it is not the one first sent to (a
        request sent again after its replica was lost)."""
        block = kvblend_block(stats, queue_s)
        replica = replica or self.replica
        if self.sources is not None:
            block["sources"] = list(self.sources)
        if self.matches is not None:
            block["matches"] = list(self.matches)
        if replica is not None:
            block["replica"] = replica
        if explain and self.explain is not None and stats is not None:
            block["explain"] = self.explain(stats)
        return block

    def _whole(self, index: int, c: ChoiceResult) -> dict[str, Any]:
        """One choice of a whole response; a chat's tool calls parsed out of its text."""
        text = "".join(c.text)
        choice = self.choice(text, c.finish_reason or "stop", chunk=False, index=index,
                             logprobs=self.logprobs(c, c.logprobs))
        if self.tools is not None:
            content, calls = parse_calls(text, self.tools)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        return choice

    def tool_chunks(self, index: int, choice: ChoiceResult, text: str, reason: str | None) -> list[dict[str, Any]]:
        """A streamed chat choice's ``text`` through its tool-call holdback: the choices of
        the chunks to send (at its end, the held content and one delta per call)."""
        if choice.tools is None:
            choice.tools = ToolStream(self.tools)
        shown = choice.tools.feed(text)
        if reason is None:
            return [self.choice(shown, None, True, index=index)] if shown else []
        rest, calls = choice.tools.finish()
        out = [self.choice(shown + rest, None if calls else reason, True, index=index)]
        for k, call in enumerate(calls):
            out.append({"index": index, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                        "finish_reason": None})
        if calls:
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"})
        return out

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.object_id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str | None, finish_reason: str | None, chunk: bool, first: bool = False, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if not chunk:
            return {"index": index, "message": {"role": "assistant", "content": text or ""}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, choice: ChoiceResult, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """``entries`` (the choice's tokens of one chunk, or all of them) in this route's
        shape, None when the request asked for no logprobs; advances the choice's offset."""
        if self.token_text is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        shaped = completion_logprobs(entries, self.token_text, choice.offset)
        choice.offset += sum(len(t) for t in shaped["tokens"])
        return shaped

    def completion(self, out: StreamResult, queue_s: float) -> dict[str, Any]:
        body = self.base(chunk=False)
        body["choices"] = [self._whole(i, c) for i, c in enumerate(out.choices)]
        body["usage"] = usage(out.stats, out.tokens)
        body["system_fingerprint"] = None
        body["kvblend"] = self.kvblend(out.stats, queue_s)
        return body


async def _collect(handle: RequestHandle, out: StreamResult) -> None:
    async for item in handle.aevents():
        out.add(item)


async def _wait_disconnect(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(handle: RequestHandle, request: HTTPRequest, out: StreamResult) -> StreamResult:
    """Collect the request into ``out``, racing it against the client's disconnect; on a
    disconnect the request is cancelled (its slot freed) and ``disconnected`` is set. When
    the caller's task is cancelled instead (Ray Serve's proxy cancels the handler of a
    client that left, where uvicorn sends ``http.disconnect``), the request is cancelled,
    ``disconnected`` set, and the cancellation goes on."""
    work = asyncio.ensure_future(_collect(handle, out))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        out.disconnected = not work.done()  # a request already finished is not a client that left
        raise
    finally:
        watch.cancel()
        if not work.done():
            handle.cancel()
            work.cancel()
    if work in done:
        exc = work.exception()
        if exc is not None:
            out.error = from_exception(exc)
        return out
    out.disconnected = True
    return out


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse_stream(handle: RequestHandle, shape: Shape, include_usage: bool, out: StreamResult,
                     on_end: Callable[[StreamResult], None], continuous: bool = False) -> AsyncIterator[str]:
    """SSE lines of one request; ``on_end`` runs exactly once when the stream ends for any
    reason (finished, failed, or cancelled by the client leaving). ``include_usage``: a
    last chunk with the usage, ``"usage": null`` on the others; ``continuous``: the running
    usage on every chunk instead, and a chunk for every token, text or not."""

    def usage_field() -> dict[str, Any]:
        if continuous:
            return {"usage": usage(out.stats, out.tokens)}
        return {"usage": None} if include_usage else {}

    try:
        yield sse({**shape.base(True), "choices": [shape.choice("", None, True, first=True, index=i)
                                                   for i in range(shape.n)], **usage_field()})
        async for item in handle.aevents():
            out.add(item)
            if isinstance(item, RequestStats):
                continue
            choice = out.choices[item.index]
            if shape.tools is not None:  # tool calls held back, sent whole at the choice's end
                for part in shape.tool_chunks(item.index, choice, item.text, item.finish_reason):
                    chunk = {**shape.base(True), "choices": [part], **usage_field()}
                    if part["finish_reason"] is not None and out.finished == shape.n:
                        chunk["kvblend"] = shape.kvblend(out.stats, handle.queue_s, replica=handle.replica)
                    yield sse(chunk)
                continue
            lps = None if item.logprobs is None else shape.logprobs(choice, [item.logprobs])
            if item.finish_reason is None:
                if item.text or continuous or lps is not None:  # a token's logprobs get their chunk
                    yield sse({**shape.base(True), "choices": [shape.choice(item.text, None, True, index=item.index,
                                                                            logprobs=lps)], **usage_field()})
                continue
            last = {**shape.base(True), "choices": [shape.choice(item.text, item.finish_reason, True,
                                                                 index=item.index, logprobs=lps)], **usage_field()}
            if out.finished == shape.n:  # the request's last chunk of choices
                last["kvblend"] = shape.kvblend(out.stats, handle.queue_s, replica=handle.replica)
            yield sse(last)
        if include_usage:  # the explanation went with the last choice chunk already
            yield sse({**shape.base(True), "choices": [], "usage": usage(out.stats, out.tokens),
                       "kvblend": shape.kvblend(out.stats, handle.queue_s, explain=False,
                                                 replica=handle.replica)})
        yield sse("[DONE]")
    except asyncio.CancelledError:
        out.disconnected = True
        handle.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        out.error = from_exception(exc)
        yield sse(out.error.body())
        yield sse("[DONE]")
    finally:
        if not handle.done:
            handle.cancel()
            out.disconnected = out.disconnected or out.error is None
        out.ended = True
        on_end(out)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that cancels its request however the response ends — also when
    the client leaves before the body generator ever started (its ``finally`` never runs)."""

    def __init__(self, handle: RequestHandle, out: StreamResult, on_end: Callable[[StreamResult], None],
                 body: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.handle, self.out, self.on_end = handle, out, on_end

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.done:
                self.handle.cancel()
            if not self.out.ended:
                self.out.disconnected, self.out.ended = True, True
                self.on_end(self.out)
