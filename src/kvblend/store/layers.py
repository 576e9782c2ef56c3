"""Reading one stored chunk layer by layer, for loading that overlaps computation.

A :class:`LayeredChunk` is a handle on a chunk that a slow tier (disk, Redis) holds: each
``read(layer)`` fetches and verifies that layer alone (per-tensor checksums, the entry's
identity, and at the first read its token ids, base position and layer count). Once every
layer has been read, the assembled entry can be promoted to faster tiers without another
read or any re-encoding. Not thread-safe: one loader reads it, in layer order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvblend.store.entry import Entry, EntryHeader, decode_layer
from kvblend.store.keys import ChunkKey
from kvblend.store.tier import Tier


class LayeredChunk:
    """A stored chunk in ``tier``, read one layer at a time (see the module docstring).

    ``base_position`` and ``n_layers`` are what the reader expects (the chunk prefix's
    length, the model's depth): an entry that disagrees is treated as unreadable.
    """

    def __init__(self, tier: Tier, key: ChunkKey, token_ids: Sequence[int], base_position: int, n_layers: int,
                 dtype: torch.dtype, promote: Callable[[Entry], object] | None = None) -> None:
        self.tier = tier
        self.key = key
        self.token_ids = tuple(int(t) for t in token_ids)
        self.base_position = base_position
        self.n_layers = n_layers
        self.dtype = dtype
        self._promote = promote
        self._header: EntryHeader | None = None
        self._raw: dict[str, torch.Tensor] = {}
        self._owned = True

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tier_name(self) -> str:
        return self.tier.name

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) of ``layer`` in the reader's dtype, each (heads, tokens, head_dim), owned by
        the caller for reading; None when the layer is missing, corrupt (the tier removes the
        entry) or the entry is not the chunk expected."""
        first = self._header is None
        read = self.tier.read_layer(self.key, layer, self.token_ids if first else None)
        if read is None or not self._expected(read.header):
            return None
        self._header = read.header
        self._raw.update(read.tensors)
        self._owned = self._owned and read.owned
        return decode_layer(read.header, read.tensors, layer, self.dtype, owned=read.owned)

    def _expected(self, header: EntryHeader) -> bool:
        if self._header is not None:
            return header is self._header or header == self._header
        return header.base_position == self.base_position and header.n_layers == self.n_layers

    def promote(self) -> bool:
        """Hand the whole entry to the promotion callback once every layer has been read;
        False (nothing done) before that or without a callback."""
        header = self._header
        if self._promote is None or header is None or set(self._raw) != set(header.checksums):
            return False
        self._promote(Entry(header, dict(self._raw), owned=self._owned))
        return True
