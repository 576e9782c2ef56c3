"""Prefill-then-decode loops over our transformer and a caller-owned KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from kvblend.generation.sampling import Sampler, SamplingParams
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


class StepOutput(NamedTuple):
    token_id: int
    logits: torch.Tensor  # (V,) the distribution the token was drawn from


def decode_steps(
    model: Transformer,
    cache: KVCache,
    first_logits: torch.Tensor,
    params: SamplingParams,
    eos_ids: Sequence[int] = (),
) -> Iterator[StepOutput]:
    """Yield tokens starting from the logits a prefill produced; the cache grows in place.

    Stops after ``max_tokens`` or at an EOS token (yielded, unless ``ignore_eos``).
    The next token is only computed when the consumer asks for it.
    """
    sampler = Sampler(params)
    logits = first_logits.reshape(-1)
    eos = set() if params.ignore_eos else set(eos_ids)
    for step in range(params.max_tokens):
        token = sampler(logits)
        yield StepOutput(token, logits)
        if token in eos or step == params.max_tokens - 1:
            return
        ids = torch.tensor([token], device=model.device)
        logits = model(ids, cache)[0]


def prefill(model: Transformer, prompt_ids: Sequence[int], extra_capacity: int = 0) -> tuple[KVCache, torch.Tensor]:
    """Full prefill of ``prompt_ids`` into a fresh cache; returns it and the last logits (V,)."""
    cache = model.new_cache(len(prompt_ids) + extra_capacity)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=model.device)
    return cache, model(ids, cache)[0]


def generate_ids(
    model: Transformer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_ids: Sequence[int] = (),
) -> list[int]:
    """Token ids generated after ``prompt_ids`` (EOS included when hit)."""
    room = max(0, model.cfg.context_length - len(prompt_ids))
    cache, logits = prefill(model, prompt_ids, min(params.max_tokens, room))  # never sized past the context
    return [s.token_id for s in decode_steps(model, cache, logits, params, eos_ids)]
