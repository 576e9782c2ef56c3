"""Token logprobs in OpenAI's response shapes: a chat choice's ``logprobs.content`` and a
text completion's ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).

The numbers are the sampler's (``generation.sampling.TokenLogprobs``: the model's raw
distribution, before bias, penalties and temperature, as vLLM reports them); here they
only get their token strings: each token decoded alone, special tokens kept, its
``bytes`` that string's UTF-8 (a token holding part of a character decodes to U+FFFD, as
vLLM's do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvblend.generation.sampling import TokenLogprobs

TokenText = Callable[[int], str]


def token_text(tokenizer: Any) -> TokenText:
    """A token id's string: the token decoded alone, special tokens included."""
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(entries: Sequence[TokenLogprobs], text_of: TokenText) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk: its tokens only)."""
    content = []
    for lp in entries:
        item = _entry(text_of(lp.token_id), lp.logprob)
        item["top_logprobs"] = [_entry(text_of(t), v) for t, v in lp.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprobs], text_of: TokenText, offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion (or of one chunk): each token's string,
    logprob, top alternatives with the drawn token among them (OpenAI: up to logprobs+1),
    and its offset in characters, counted from ``offset`` (the characters of the tokens
    sent before)."""
    tokens, offsets, tops = [], [], []
    for lp in entries:
        text = text_of(lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {text_of(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries], "top_logprobs": tops,
            "text_offset": offsets}
