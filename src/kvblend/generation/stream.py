"""Text generation: chat rendering, streaming decode, completions.

The decode rules (sampling, stop strings, EOS, max_tokens) are ``DecodeSlot``'s, in
``slot.py``; ``stream_from`` only runs the model for it, one token per forward.
"""

from __future__ import annotations

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


def chat_text(tokenizer: Any, conversation: list[dict[str, str]]) -> str:
    """``conversation`` through the model's chat template, ready for the reply. A template
    that refuses the conversation (e.g. one whose roles must alternate user/assistant) is
    an InvalidRequestError naming its reason, not an internal error."""
    from jinja2 import TemplateError  # transformers' templates are jinja2

    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template refused these messages: {exc}", "messages") from None


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
) -> Iterator[StreamEvent]:
    """Stream text from a prefilled cache (ours or a fused one); the cache grows in place.
    The tokens follow ``DecodeSlot``'s rules (stop strings, EOS, max_tokens capped to the
    context left)."""
    slot = DecodeSlot(tokenizer, cache, params, eos_ids, model.cfg.context_length)
    for event, _ in slot_steps(model, slot, first_logits):
        yield event


def stream(
    model: Transformer, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams, eos_ids: Sequence[int]
) -> Iterator[StreamEvent]:
    """Full prefill of ``prompt_ids`` then streaming decode."""
    params = cap_new_tokens(params, len(prompt_ids), model.cfg.context_length)
    cache, logits = prefill(model, prompt_ids, params.max_tokens)  # sized by the capped count
    yield from stream_from(model, tokenizer, cache, logits, params, eos_ids)


def collect(events: Iterator[StreamEvent], prompt_tokens: int) -> Completion:
    """Drain a stream into a Completion."""
    ids, parts, reason = [], [], "length"
    for e in events:
        ids.append(e.token_id)
        parts.append(e.text)
        reason = e.finish_reason or reason
    return Completion("".join(parts), ids, reason, prompt_tokens)
