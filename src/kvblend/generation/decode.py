"""Prefill-then-decode loops over our transformer and a caller-owned KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from kvblend.generation.sampling import SamplingParams
from kvblend.generation.slot import DecodeSlot, StreamEvent
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer


class StepOutput(NamedTuple):
    token_id: int
    logits: torch.Tensor  # (V,) the distribution the token was drawn from


def slot_steps(model: Transformer, slot: DecodeSlot, first_logits: torch.Tensor
               ) -> Iterator[tuple[StreamEvent, torch.Tensor]]:
    """Feed ``slot`` the model's logits, one forward per token over ``slot.cache`` (grown in
    place), until it finishes; yield each event with the (V,) logits its token was drawn
    from. The next token is only computed when the consumer asks for it."""
    logits = first_logits.reshape(-1)  # (V,)
    while True:
        event = slot.next_event(logits)
        yield event, logits
        if slot.finished:
            return
        ids = torch.tensor([event.token_id], device=model.device)  # (1,)
        logits = model(ids, slot.cache)[0]  # (V,)


def decode_steps(
    model: Transformer,
    cache: KVCache,
    first_logits: torch.Tensor,
    params: SamplingParams,
    eos_ids: Sequence[int] = (),
) -> Iterator[StepOutput]:
    """Yield tokens starting from the logits a prefill produced; the cache grows in place.

    ``DecodeSlot``'s rules without text: stops after ``max_tokens`` (capped to the
    context left) or at an EOS token (yielded, unless ``ignore_eos``); stop strings need
    ``stream_from``. The next token is only computed when the consumer asks for it.
    """
    slot = DecodeSlot(None, cache, params, eos_ids, model.cfg.context_length)
    for event, logits in slot_steps(model, slot, first_logits):
        yield StepOutput(event.token_id, logits)


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
