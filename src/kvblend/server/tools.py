"""Tool calls: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on a model
whose chat template writes tool calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(Qwen2.5's and the Hermes format, as vLLM's ``hermes`` parser reads them).

``tool_plan`` checks the request (a 400 naming the field) and the template (one with no
tool format is a 400); the tools go to the template as its ``tools`` variable. ``auto``
parses whatever calls the answer holds; ``required`` and a named function are enforced
by the grammar (one call, its ``arguments`` following the function's ``parameters``
schema, strict); ``none`` renders the tools and parses nothing. Small models often
ignore the tags and answer with the call alone as JSON, bare or in a ```json fence
(Qwen2.5-Coder-0.5B does): an answer that is nothing but one call of the tools, or a
list of them, is read as calls too (``bare_calls``); JSON that names no tool stays text.
``ToolStream`` holds back, while streaming, the text that is or may become a call, and
turns the calls into ``tool_calls`` at the end of the choice.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from kvblend.generation.grammar import ResponseFormat
from kvblend.server.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS, MAX_TOOLS_BYTES = 128, 65536
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


class ToolPlan(NamedTuple):
    """The request's tools (as sent, for the template), their parameter schemas by name,
    ``choice`` ("auto", "none", "required" or a function's name) and ``parallel``."""

    tools: list[dict[str, Any]]
    parameters: dict[str, dict[str, Any]]
    choice: str
    parallel: bool

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def forced(self) -> ResponseFormat | None:
        """The grammar of a ``required`` or named call: one call of the tools allowed."""
        if self.choice in ("auto", "none"):
            return None
        names = list(self.parameters) if self.choice == "required" else [self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": self.parameters[n]},
                  "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        return ResponseFormat.json_schema({"anyOf": calls}, True, OPEN + "\n", "\n" + CLOSE)


def tool_plan(body: Any, tokenizer: Any) -> ToolPlan | None:
    """The request's ``ToolPlan``, None without tools; a 400 naming the field for a
    malformed tool, an unknown or malformed ``tool_choice``, or a template with no tool
    format."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS or len(json.dumps(tools)) > MAX_TOOLS_BYTES:
        raise bad_request(f"at most {MAX_TOOLS} tools of {MAX_TOOLS_BYTES} bytes of JSON in all", "tools")
    parameters = {}
    for i, tool in enumerate(tools):
        name, params = _tool(tool, i)
        if name in parameters:
            raise bad_request(f"two tools are named {name!r}", f"tools.{i}.function.name")
        parameters[name] = params
    _check_template(tokenizer)
    return ToolPlan(tools, parameters, _choice(choice, parameters), body.parallel_tool_calls is not False)


def _tool(tool: Any, i: int) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request('a tool is {"type": "function", "function": {"name": ..., "parameters": ...}}',
                          f"tools.{i}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request("a function name is 1-64 of letters, digits, '_' and '-'", f"tools.{i}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request("a function's parameters are a JSON Schema object", f"tools.{i}.function.parameters")
    return name, params


def _choice(choice: Any, parameters: dict[str, Any]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice is "auto", "none", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in parameters:
        raise bad_request(f"tool_choice names {name[:64]!r}, which is not one of the tools", "tool_choice")
    return name


def _check_template(tokenizer: Any) -> None:
    template = tokenizer.chat_template
    text = json.dumps(template) if isinstance(template, dict) else str(template or "")
    if "tools" not in text:
        raise bad_request("this model's chat template has no tool format", "tools")
    if OPEN not in text:
        raise bad_request(f"this model's chat template writes tool calls in a format kvblend does not read "
                          f"(it reads {OPEN}...{CLOSE}, Qwen2.5's and Hermes')", "tools")


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's content (its text outside the calls, None when empty) and its calls in
    OpenAI's shape; a block that is not a call of one of the tools stays in the content.
    Without ``parallel``, the first call only. An answer with no tagged call that is
    nothing but calls as JSON (``bare_calls``) is those calls, with no content."""
    bare = bare_calls(text, plan)
    if bare:
        return None, bare if plan.parallel else bare[:1]
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1), plan)
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    if not plan.parallel:
        calls = calls[:1]
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def bare_calls(text: str, plan: ToolPlan) -> list[dict[str, Any]]:
    """The calls of an answer that is only JSON (bare or in one ```json fence): one call
    object or a list of them, each naming one of the tools; [] for anything else."""
    raw = text.strip()
    fenced = _FENCE.fullmatch(raw)
    if fenced:
        raw = fenced.group(1)
    if not raw.startswith(("{", "[")):
        return []
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    items = data if isinstance(data, list) else [data]
    calls = [_call_of(item, plan) for item in items]
    return calls if calls and all(c is not None for c in calls) else []


def _call(raw: str, plan: ToolPlan) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return _call_of(data, plan)


def _call_of(data: Any, plan: ToolPlan) -> dict[str, Any] | None:
    if not isinstance(data, dict) or data.get("name") not in plan.parameters:
        return None
    args = data.get("arguments", {})
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": data["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


class ToolStream:
    """One streamed choice's text with tool calls held back: ``feed`` returns the text safe
    to send now (none from a call's opening tag on, nor a tail that may begin one, nor an
    answer that opens as JSON might: a bare call); ``finish`` the rest as content and the
    calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.sent = ""
        self.inside = False

    def feed(self, text: str) -> str:
        self.held += text
        if self.inside:
            return ""
        if not self.sent:
            opening = self.held.lstrip()
            if len(opening) < 3 and "```".startswith(opening):
                return ""  # too early to tell
            if opening.startswith("```") or opening[0] in "{[":
                self.inside = True  # the whole answer may be a bare call: held to the end
                return ""
        at = self.held.find(OPEN)
        if at >= 0:
            self.inside = True
            out, self.held = self.held[:at], self.held[at:]
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                         if OPEN.startswith(self.held[-k:])), 0)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The held text that is content (to send) and the calls (none: all of it is content)."""
        content, calls = parse_calls(self.held, self.plan)
        if not calls:
            return self.held, []
        return ("" if content is None else content), calls
