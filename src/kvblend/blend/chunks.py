"""Computing a document's position-independent KV (its "chunk KV") alone."""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from kvblend.generation.chunked import SliceSize, Steps, forward_chunks, run_steps
from kvblend.models.transformer import Transformer
from kvblend.store.chunk import ChunkKV


def compute_chunk_kv(model: Transformer, chunk_prefix: Sequence[int], doc_ids: Sequence[int]) -> ChunkKV:
    """``compute_chunk_steps`` run to its end here, in one forward."""
    return run_steps(compute_chunk_steps(model, chunk_prefix, doc_ids), model)


@torch.inference_mode()
def compute_chunk_steps(model: Transformer, chunk_prefix: Sequence[int], doc_ids: Sequence[int],
                        slice_tokens: SliceSize = None) -> Steps:
    """Prefill ``chunk_prefix + doc_ids`` and keep the document's K/V for every layer; a step
    generator of forward slices of at most ``slice_tokens`` (None: one; a callable is asked
    per slice and may answer ``InPlace``: see ``forward_chunks``).

    The prefix (e.g. BOS) is what the model always sees first, so the document's first
    token is not mistaken for an attention sink. Keys are post-RoPE at positions
    ``len(chunk_prefix) ...``; ``ChunkKV.base_position`` records that.
    """
    p, n = len(chunk_prefix), len(doc_ids)
    cache = model.new_cache(p + n)
    ids = torch.tensor([*chunk_prefix, *doc_ids], dtype=torch.long, device=model.device)  # (p + n,)
    yield from forward_chunks(model, ids, cache, slice_tokens, "none")
    keys = tuple(k[:, p : p + n].clone() for k in cache.keys)
    values = tuple(v[:, p : p + n].clone() for v in cache.values)
    return ChunkKV(tuple(int(t) for t in doc_ids), p, keys, values)
