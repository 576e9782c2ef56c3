"""Hiding KV loading behind recompute: the layer-pipelined loader, per-device profiles,
and the loading controller that picks the recompute ratio and the storage tier."""

from kvblend.pipeline.loader import LayerFeed, LoadFailure, LoadStats, PendingChunk

__all__ = ["LayerFeed", "LoadFailure", "LoadStats", "PendingChunk"]
