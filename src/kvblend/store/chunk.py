"""The unit the chunk store holds: one document's position-independent KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkKV:
    """KV of one document, computed alone after a fixed chunk prefix.

    ``keys[l]`` and ``values[l]`` have shape (n_kv_heads, n_tokens, head_dim).
    Keys are post-RoPE at positions ``base_position .. base_position + n_tokens - 1``;
    moving them elsewhere is a pure rotation (``kvblend.rope.rotate``).
    """

    token_ids: tuple[int, ...]
    base_position: int
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError("keys and values must have one tensor per layer each")
        n = len(self.token_ids)
        for k, v in zip(self.keys, self.values):
            if k.shape != v.shape or k.dim() != 3 or k.shape[1] != n:
                raise ValueError(
                    f"per-layer K/V must be (heads, {n}, head_dim); got {tuple(k.shape)} / {tuple(v.shape)}"
                )

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer; always available (the fusion's view of a loaded chunk)."""
        return self.keys[layer], self.values[layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
