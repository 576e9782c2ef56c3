"""Rendering a request into token ids with known spans: prefix, documents, suffix.

Each document is tokenized alone (no special tokens) and the ids are concatenated;
joined text is never re-tokenized, so every method sees exactly the same ids.
Documents sit at the start of the (last) user turn, where the chat template puts content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvblend.errors import InvalidRequestError

_SENTINEL = "\x00KVBLEND_DOCUMENTS\x00"


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of one prompt: ``prefix + docs[0] + ... + docs[-1] + suffix``."""

    prefix: tuple[int, ...]
    docs: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        out = list(self.prefix)
        for d in self.docs:
            out.extend(d)
        return out + list(self.suffix)

    @property
    def doc_starts(self) -> list[int]:
        starts, pos = [], len(self.prefix)
        for d in self.docs:
            starts.append(pos)
            pos += len(d)
        return starts

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.docs)) + len(self.suffix)


def tokenize_document(tokenizer: Any, doc: str | Sequence[int]) -> tuple[int, ...]:
    """A document's own ids: text tokenized alone without BOS/EOS, or ids as given."""
    if isinstance(doc, str):
        return tuple(tokenizer(doc, add_special_tokens=False)["input_ids"])
    ids = tuple(int(t) for t in doc)
    vocab = len(tokenizer)  # computed by the tokenizer on each call: once per document
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequestError("document token ids must be within the tokenizer's vocabulary")
    return ids


def _chat_messages(system: str | None, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system is not None else []
    out += [dict(m) for m in messages]
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if not users:
        raise InvalidRequestError("the conversation needs a user message to hold the documents")
    out[users[-1]]["content"] = _SENTINEL + out[users[-1]]["content"]
    return out


def _split_template(tokenizer: Any, system: str | None, messages: Sequence[dict[str, str]]) -> tuple[str, str]:
    text = tokenizer.apply_chat_template(_chat_messages(system, messages), tokenize=False, add_generation_prompt=True)
    if text.count(_SENTINEL) != 1:
        raise InvalidRequestError("the chat template altered the document placeholder")
    head, _, tail = text.partition(_SENTINEL)
    return head, tail


def render_layout(
    tokenizer: Any,
    documents: Sequence[str | Sequence[int]],
    question: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    system: str | None = None,
    use_chat_template: bool = True,
) -> PromptLayout:
    """Lay out a RAG prompt. Give ``question`` (one user turn) or chat ``messages``."""
    if (question is None) == (messages is None):
        raise InvalidRequestError("give exactly one of question or messages")
    docs = tuple(tokenize_document(tokenizer, d) for d in documents)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        msgs = messages if messages is not None else [{"role": "user", "content": question}]
        head, tail = _split_template(tokenizer, system, msgs)
        encode = lambda s: tuple(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        return PromptLayout(encode(head), docs, encode(tail))
    if messages is not None:
        raise InvalidRequestError("this model has no chat template: send a question, not messages")
    bos = (tokenizer.bos_token_id,) if tokenizer.bos_token_id is not None else ()
    head = tuple(tokenizer(system, add_special_tokens=False)["input_ids"]) if system else ()
    layout = PromptLayout(bos + head, docs, tuple(tokenizer(question, add_special_tokens=False)["input_ids"]))
    if not len(layout):
        raise InvalidRequestError("the prompt is empty: give a question, documents or a system prompt")
    return layout
