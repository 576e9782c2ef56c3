"""Request bodies of the OpenAI-compatible API, with kvblend's ``documents`` and ``kvblend``.

Models accept unknown fields (OpenAI clients send many; they are logged and ignored),
but every option that would change the answer and is not implemented is refused by
``unsupported`` with the field's name, never silently dropped. The server validates a body
strictly (``translate.parse``): no value is coerced from another JSON type, so an integer
field here takes a JSON integer (or null where optional) and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvblend.generation.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS
from kvblend.rag.retriever import MAX_TOP_K
from kvblend.settings import BlendOptions

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# OpenAI's metadata bounds (keys of 64 characters, string values of 512); kvblend allows 32 pairs
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
_DOC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def utf8_size(text: str) -> int | None:
    """``text``'s size in UTF-8, or None when it holds a lone surrogate (JSON can escape one;
    it is not Unicode text and cannot be stored, tokenized or sent back as UTF-8)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def check_metadata_text(text: str, limit: int, what: str) -> None:
    """ValueError unless ``text`` is at most ``limit`` characters of valid Unicode."""
    if len(text) > limit:
        raise ValueError(f"a metadata {what} is longer than {limit} characters")
    if utf8_size(text) is None:
        raise ValueError(f"a metadata {what} is not valid Unicode (lone surrogate escape)")


def check_doc_id(value: str) -> str:
    if not _DOC_ID.fullmatch(value):
        raise ValueError("document ids are 1-128 of letters, digits, '_', '.', ':', '-' starting with a letter or digit")
    return value


class DocumentRef(BaseModel):
    """``{"text": ...}`` (optionally with an ``id``) or ``{"id": ...}`` naming a stored document."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    id: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        return None if v is None else check_doc_id(v)

    @model_validator(mode="after")
    def _text_or_id(self) -> DocumentRef:
        if self.text is None and self.id is None:
            raise ValueError("a document needs text or id")
        return self


class KvblendOptions(BlendOptions):
    """Per-request overrides of the server's blend defaults: the knobs of
    ``settings.BlendOptions`` (defined there once; ``settings.BlendSettings`` validates the
    merged result and its errors name the field), and ``explain``, which is not a knob."""

    explain: bool | None = None  # the response's kvblend block lists the recomputed tokens (server/explain.py)
    match: bool | None = None  # false: do not look for stored documents in the messages' text


class RetrievalOptions(BaseModel):
    """``"retrieval": {"top_k": k}``: blend the caller's top-k indexed chunks instead of
    ``documents`` (k is a JSON integer, as every integer of a body, bounded by the server's
    ``retrieval.max_top_k``)."""

    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(ge=1, le=MAX_TOP_K)


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the request's usage (OpenAI);
    ``continuous_usage_stats`` (with ``include_usage``; vLLM's name): every chunk carries the
    running usage, and every generated token gets its chunk, one whose text is empty (a
    special token, or bytes held back for a stop string or an unfinished character)
    included, so a client can time each token."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    documents: list[str | DocumentRef] | None = None
    retrieval: RetrievalOptions | None = None
    kvblend: KvblendOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # OpenAI's bounds: a signed 64-bit integer
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices: one prefill, the decode forked
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's extension (1: none)
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]; ids checked by translate
    logprobs: bool | int | None = None  # a chat's is a flag, a completion's a count (translate.logprob_count)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool = False  # vLLM's extension: decode up to max_tokens even past EOS (load tests)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> str:
        """The message's text; content parts other than text are refused (400 by the caller)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content.{i}: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's extra chat-template variables (``{"enable_thinking": false}``); checked by
    # ``generation.stream.validate_template_kwargs``
    chat_template_kwargs: Any = None
    # function calling (``server.tools`` checks them); a completion's are refused
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class DocumentCreate(BaseModel):
    """Body of ``POST /v1/documents``."""

    model_config = ConfigDict(extra="forbid")
    text: str
    id: str | None = None
    metadata: dict[str, str | int | float | bool | None] = Field(default_factory=dict, max_length=32)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        return None if v is None else check_doc_id(v)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            check_metadata_text(key, MAX_METADATA_KEY_CHARS, "key")
            if isinstance(value, str):
                check_metadata_text(value, MAX_METADATA_VALUE_CHARS, f"value of {key!r}")
            elif isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"metadata value of {key!r} must be a finite number")
            elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"metadata value of {key!r} must fit in 64 bits")
        return v


# Options beyond the core (OpenAI's audio and predicted outputs, vLLM's sampling, guided
# decoding and prompt extensions), each with the values that leave the answer as kvblend
# computes it: a default sent explicitly is accepted; anything else is refused by name.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "audio": (None,), "prediction": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "logits_processors": (None,), "vllm_xargs": (None,),
    "min_p": (None, 0), "min_tokens": (None, 0),
    "length_penalty": (None, 1), "use_beam_search": (None, False), "best_of": (None, 1),
    "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "echo": (None, False), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),
}


FORMATS = ("text", "json_object", "json_schema")  # response_format types (translate.response_format)
CHAT_ONLY = ("chat_template_kwargs",)  # implemented for chats (``ChatCompletionRequest``)


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (by type too: ``True`` is not ``1``)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _refusal(name: str, neutral: tuple[Any, ...]) -> str:
    default = neutral[-1]
    return f"{name} is not supported" + (f" (only its default, {json.dumps(default)})" if default is not None else "")


def unsupported(body: _Common) -> tuple[str, str] | None:
    """(field, reason) of the first option that would change the answer and is not
    implemented, or None. Default-valued options (``min_p`` 0, ``best_of`` 1, ...) are
    accepted. ``n``, logprobs, the penalties and ``logit_bias`` are implemented (their
    values are checked by ``translate.sampling_params``)."""
    extra = body.model_extra or {}
    completion = isinstance(body, CompletionRequest)
    checks: list[tuple[str, bool, str]] = []
    for name in ("tools", "functions"):
        checks.append((name, bool(extra.get(name)), f"{name} (function calling) are not supported"))
    for name in ("tool_choice", "function_call"):
        checks.append((name, extra.get(name) not in (None, "none"), f"{name} is not supported"))
    fmt = extra.get("response_format")
    checks.append(("response_format", fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in FORMATS),
                   f"response_format's type is one of {', '.join(FORMATS)}"))
    checks.append(("modalities", extra.get("modalities") not in (None, ["text"]), "only text output is supported"))
    for name, neutral in NEUTRAL.items():  # sent as unknown fields, or typed (a completion's echo, best_of)
        if name in CHAT_ONLY and not completion:
            continue  # a chat's own field (a completion renders no template: refused there)
        value = extra[name] if name in extra else getattr(body, name, None)
        checks.append((name, not _neutral(value, neutral), _refusal(name, neutral)))
    # vLLM's add_special_tokens: a chat's template writes its own (default false), a
    # completion gets the tokenizer's (default true); the other value is not implemented
    special = (None, True) if completion else (None, False)
    checks.append(("add_special_tokens", not _neutral(extra.get("add_special_tokens"), special),
                   _refusal("add_special_tokens", special)))
    checks.append(("stream_options", body.stream_options is not None and not body.stream,
                   "stream_options is only allowed when stream is true"))
    if completion:
        checks.append(("suffix", bool(body.suffix), "suffix is not supported"))
    for name, bad, reason in checks:
        if bad:
            return name, reason
    return None


def ignored_fields(body: BaseModel) -> list[str]:
    """Unknown fields of a body (logged, then ignored)."""
    return sorted((body.model_extra or {}).keys())
