"""Chunk KV store: content keys, tiers (memory, disk, Redis), integrity, eviction.

``build_store(StoreConfig(...))`` gives a :class:`TieredStore`; keys come from
``chunk_key(token_ids, KeyContext(...))``; ``WriteBack`` writes new chunks in the background.
"""

from kvblend.store.base import ChunkStore, EntryInfo, StoreStats
from kvblend.store.chunk import ChunkKV
from kvblend.store.config import StoreConfig, build_store
from kvblend.store.disk import DiskStore
from kvblend.store.keys import ChunkKey, KeyContext, chunk_key
from kvblend.store.memory import MemoryStore
from kvblend.store.remote import RedisStore
from kvblend.store.tiered import Lookup, TieredStore
from kvblend.store.writeback import WriteBack

__all__ = [
    "ChunkKV",
    "ChunkKey",
    "ChunkStore",
    "DiskStore",
    "EntryInfo",
    "KeyContext",
    "Lookup",
    "MemoryStore",
    "RedisStore",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
    "WriteBack",
    "build_store",
    "chunk_key",
]
