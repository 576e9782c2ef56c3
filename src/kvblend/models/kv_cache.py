"""A per-request KV cache that the caller owns and the model writes into."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V buffers of shape (Hkv, capacity, head_dim), grown on demand.

    ``length`` is the number of valid positions; the model sets it after a forward.
    Positions are slots: slot p holds the token at global position p.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_kv_heads, max(capacity, 1), head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def reserve(self, capacity: int) -> None:
        """Grow every buffer to hold at least ``capacity`` positions (doubling), keeping contents."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_empty((old.shape[0], new_cap, old.shape[2]))
                new[:, : self.length] = old[:, : self.length]
                buffers[i] = new

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T, d) at slots start..start+T; return views of slots 0..start+T."""
        end = start + k.shape[1]
        self.reserve(end)
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots 0..end (default: ``length``), as views."""
        end = self.length if end is None else end
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def truncate(self, length: int) -> None:
        """Forget positions past ``length`` (buffers are kept)."""
        self.length = min(self.length, length)
