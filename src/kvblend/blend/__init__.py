"""CacheBlend: chunk KV, position recovery, selective recompute (fusion)."""

from kvblend.blend.config import METHODS, BlendConfig
from kvblend.blend.fusion import FusionOutput, FusionPlan, PlacedChunk, fuse
from kvblend.blend.layout import PromptLayout, render_layout

__all__ = ["METHODS", "BlendConfig", "FusionOutput", "FusionPlan", "PlacedChunk", "PromptLayout", "fuse",
           "render_layout"]
