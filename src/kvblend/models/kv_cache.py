"""A per-request KV cache that the caller owns and the model writes into, and a forked
cache: another choice's decode that reads a prompt's KV from its parent without a copy."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V buffers of shape (Hkv, capacity, head_dim), grown on demand.

    ``length`` is the number of valid positions; the model sets it after a forward.
    Positions are slots: slot p holds the token at global position p.

    The native int8 decode attends over float16 copies of the buffers (``decode_half``),
    which it keeps in step with them: it converts the slots a copy lacks and writes each new
    slot to both. A copy holds slots below ``half_synced[layer]``; ``write`` lowers that mark
    to where it writes, and code that writes into ``keys``/``values`` directly calls
    ``forget_half`` first (``blend.fusion.fuse`` does). ``half_copies = False`` keeps a
    cache's decode on its float32 buffers (exact attention).
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
        self.half_keys: list[torch.Tensor | None] = [None] * num_layers
        self.half_values: list[torch.Tensor | None] = [None] * num_layers
        self.half_synced = [0] * num_layers
        self.half_copies = True

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
        self.half_synced[layer] = min(self.half_synced[layer], start)
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def decode_half(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """float16 copies of ``layer``'s K and V for a native decode step at ``slot``, as big as
        the buffers, and how many leading slots they already hold (never past ``slot``: the
        kernel converts the rest below it); the caller marks ``half_synced[layer] = slot + 1``
        once the step wrote it. Made on a layer's first step; grown with the buffers."""
        keys, held = self.half_keys[layer], min(self.half_synced[layer], slot)
        if keys is None or keys.shape[1] < self.keys[layer].shape[1]:
            fresh = [torch.empty_like(self.keys[layer], dtype=torch.float16) for _ in range(2)]
            if keys is not None and held:
                fresh[0][:, :held] = keys[:, :held]
                fresh[1][:, :held] = self.half_values[layer][:, :held]
            self.half_keys[layer], self.half_values[layer] = fresh
        return self.half_keys[layer], self.half_values[layer], held

    def forget_half(self) -> None:
        """The float16 copies hold nothing any more (the buffers are about to be written directly)."""
        self.half_synced = [0] * self.num_layers

    def write_parts(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``write``, returning slots 0..start+T as consecutive (K, V) parts, in position
        order: one here, two for a ``ForkedCache`` (its parent's prompt, then its own)."""
        return [self.write(layer, start, k, v)]

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots 0..end (default: ``length``), as views."""
        end = self.length if end is None else end
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def truncate(self, length: int) -> None:
        """Forget positions past ``length`` (buffers are kept)."""
        self.length = min(self.length, length)


class ForkedCache(KVCache):
    """Another choice's cache after one prefill: positions below ``shared`` (the prompt)
    are read from ``parent``'s buffers, never copied; positions from ``shared`` on live in
    this cache's own buffers (own slot p - shared). The parent must not change its first
    ``shared`` positions while the fork lives (a decode only appends after them). Attention
    over a fork reads its two parts (``write_parts``); ``write`` and ``view``, which promise
    one contiguous set of slots, refuse."""

    def __init__(self, parent: KVCache, extra: int) -> None:
        keys = parent.keys[0]
        super().__init__(parent.num_layers, keys.shape[0], keys.shape[2], extra, keys.dtype, keys.device)
        self.parent = parent
        self.shared = parent.length
        self.length = parent.length

    @property
    def capacity(self) -> int:
        return self.shared + self.keys[0].shape[1]

    def reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        new_cap = max(capacity - self.shared, 2 * self.keys[0].shape[1])
        used = self.length - self.shared
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_empty((old.shape[0], new_cap, old.shape[2]))
                new[:, :used] = old[:, :used]
                buffers[i] = new

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a forked cache's slots are in two parts: use write_parts")

    def view(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a forked cache's slots are in two parts")

    def write_parts(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if start < self.shared:
            raise ValueError(f"a fork writes after its shared prompt ({self.shared} positions), not at {start}")
        end = start + k.shape[1]
        self.reserve(end)
        a, b = start - self.shared, end - self.shared
        self.keys[layer][:, a:b] = k
        self.values[layer][:, a:b] = v
        prompt = (self.parent.keys[layer][:, : self.shared], self.parent.values[layer][:, : self.shared])
        return [prompt, (self.keys[layer][:, :b], self.values[layer][:, :b])]

    def truncate(self, length: int) -> None:
        self.length = max(self.shared, min(self.length, length))
