"""Text generation: chat rendering, streaming decode, completions.

The decode rules (sampling, stop strings, EOS, max_tokens) are ``DecodeSlot``'s, in
``slot.py``; ``stream_from`` only runs the model for it, one token per forward.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kvblend.errors import InvalidRequestError
from kvblend.generation.decode import prefill, slot_steps
from kvblend.generation.sampling import SamplingParams
from kvblend.generation.slot import DecodeSlot, StreamEvent, cap_new_tokens
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


class Completion(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


CHAT_ROLES = ("system", "user", "assistant")


def validate_messages(messages: Any) -> tuple[dict[str, str], ...]:
    """Chat messages as copies, or InvalidRequestError: a non-empty list of mappings, each
    with a role among system/user/assistant and text content (other keys are kept)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"bad chat message {m!r}: needs role system/user/assistant and text content")
        out.append(dict(m))
    return tuple(out)


# apply_chat_template's own arguments and the variables kvblend sets itself: a client's
# template variables may not name them (vLLM refuses chat_template and tokenize alike)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "tools", "documents", "return_dict", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "return_tensors", "tokenizer_kwargs", "processor_kwargs",
})
MAX_TEMPLATE_KWARGS = 32  # variables per request
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024  # their JSON, UTF-8
MAX_TEMPLATE_KWARGS_DEPTH = 16  # lists and objects within each other (a deep one overflows the copy's stack)
TEMPLATE_KWARGS_FIELD = "chat_template_kwargs"


def validate_template_kwargs(kwargs: Any, tools: bool = False) -> dict[str, Any]:
    """A copy of a client's extra chat-template variables (vLLM's ``chat_template_kwargs``,
    e.g. ``{"enable_thinking": false}``), or InvalidRequestError naming the field: a mapping
    of at most 32 identifiers, none of them one kvblend sets (``RESERVED_TEMPLATE_KWARGS``),
    to JSON values of at most 16 KiB in all. A variable the template does not read changes
    nothing, as in vLLM. ``tools``: the variables may also hold ``tools``, the request's
    tool definitions the server put there (checked by ``server.tools``, not here)."""
    if kwargs is None:
        return {}
    if tools and isinstance(kwargs, Mapping) and "tools" in kwargs:
        rest = validate_template_kwargs({k: v for k, v in kwargs.items() if k != "tools"})
        return {**rest, "tools": copy.deepcopy(kwargs["tools"])}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError("chat_template_kwargs must be an object", TEMPLATE_KWARGS_FIELD)
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs", TEMPLATE_KWARGS_FIELD)
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier() or len(key) > 64:
            raise InvalidRequestError(f"chat_template_kwargs key {str(key)[:64]!r} is not a template variable name "
                                      "(an identifier of at most 64 characters)", TEMPLATE_KWARGS_FIELD)
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}: kvblend sets it",
                                      TEMPLATE_KWARGS_FIELD)
    if _depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise InvalidRequestError(f"chat_template_kwargs nest deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels",
                                  TEMPLATE_KWARGS_FIELD)
    try:
        size = len(json.dumps(kwargs, ensure_ascii=False, allow_nan=False).encode())
    except (TypeError, ValueError):  # not JSON, NaN, or text that is not Unicode
        raise InvalidRequestError("chat_template_kwargs values must be JSON values (finite numbers, valid text)",
                                  TEMPLATE_KWARGS_FIELD) from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(f"chat_template_kwargs is {size} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}",
                                  TEMPLATE_KWARGS_FIELD)
    return copy.deepcopy(dict(kwargs))


def _depth(value: Any) -> int:
    """How deep lists and mappings nest in ``value`` (1 for a mapping of scalars), walked
    without recursion and stopping past the bound."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_TEMPLATE_KWARGS_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def _own_arguments(tokenizer: Any) -> frozenset[str]:
    """The named arguments of this tokenizer's ``apply_chat_template`` (a client's template
    variable must not become one of them, whatever transformers version adds)."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def chat_text(tokenizer: Any, conversation: list[dict[str, str]], template_kwargs: Mapping[str, Any] | None = None) -> str:
    """``conversation`` through the model's chat template, ready for the reply, with the
    client's ``template_kwargs`` (checked by ``validate_template_kwargs``) as extra template
    variables. A template that refuses the conversation (e.g. one whose roles must
    alternate user/assistant) is an InvalidRequestError naming its reason and the field at
    fault (``chat_template_kwargs`` when the conversation renders without them), not an
    internal error."""
    from jinja2 import TemplateError  # transformers' templates are jinja2

    # ``tools``: the request's tool definitions, set by the server (a client's
    # chat_template_kwargs may not: ``validate_template_kwargs``)
    taken = sorted(set(template_kwargs) & (_own_arguments(tokenizer) - {"tools"})) if template_kwargs else []
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {taken[0]!r}: kvblend sets it",
                                  TEMPLATE_KWARGS_FIELD)

    def render(extra: Mapping[str, Any]) -> str:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **extra)

    try:
        return render(template_kwargs or {})
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        jinja_own = isinstance(exc, TemplateError)
        if not template_kwargs and not jinja_own:
            raise  # the template failing on messages alone, in a way jinja does not own: a bug to see
        # a value of the wrong type is the variables'; the template's own refusal is theirs
        # only when the conversation renders without them
        field = TEMPLATE_KWARGS_FIELD if template_kwargs and (not jinja_own or _renders(render)) else "messages"
        what = "these messages" if field == "messages" else "these chat_template_kwargs"
        raise InvalidRequestError(f"the model's chat template refused {what}: {exc}", field) from None


def _renders(render: Any) -> bool:
    """Whether ``render`` succeeds without a client's template variables."""
    try:
        render({})
    except Exception:  # noqa: BLE001 - any failure: the conversation alone fails too
        return False
    return True


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the model's chat template, ready for the reply."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template: send a plain prompt instead")
    return tokenizer(chat_text(tokenizer, list(validate_messages(messages))), add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """A plain prompt with the tokenizer's usual special tokens (e.g. BOS)."""
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    return ids


def stream_from(
    model: Transformer,
    tokenizer: Any,
    cache: KVCache,
    first_logits: torch.Tensor,
    params: SamplingParams,
    eos_ids: Sequence[int],
    prompt_ids: Sequence[int] = (),
) -> Iterator[StreamEvent]:
    """Stream text from a prefilled cache (ours or a fused one); the cache grows in place.
    The tokens follow ``DecodeSlot``'s rules (stop strings, EOS, max_tokens capped to the
    context left; ``prompt_ids`` for the repetition penalty). One choice: ``n`` > 1 is the
    scheduler's (one prefill, the decode forked), a ValueError here."""
    if params.n != 1:
        raise ValueError("stream_from decodes one choice; n > 1 is served by the scheduler")
    slot = DecodeSlot(tokenizer, cache, params, eos_ids, model.cfg.context_length, prompt_ids)
    for event, _ in slot_steps(model, slot, first_logits):
        yield event


def stream(
    model: Transformer, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, eos_ids: Sequence[int]
) -> Iterator[StreamEvent]:
    """Full prefill of ``prompt_ids`` then streaming decode."""
    params = cap_new_tokens(params, len(prompt_ids), model.cfg.context_length)
    cache, logits = prefill(model, prompt_ids, params.max_tokens)  # sized by the capped count
    yield from stream_from(model, tokenizer, cache, logits, params, eos_ids, prompt_ids)


def collect(events: Iterator[StreamEvent], prompt_tokens: int) -> Completion:
    """Drain a stream into a Completion."""
    ids, parts, reason = [], [], "length"
    for e in events:
        ids.append(e.token_id)
        parts.append(e.text)
        reason = e.finish_reason or reason
    return Completion("".join(parts), ids, reason, prompt_tokens)
