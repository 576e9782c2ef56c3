"""Model runtime: config, our layer-wise transformer, KV cache, weight loading, registry."""

from kvblend.models.config import ModelConfig
from kvblend.models.kv_cache import KVCache
from kvblend.models.loader import LoadedModel, load_hf_folder, load_model
from kvblend.models.registry import DEFAULT_MODEL, PACKAGED
from kvblend.models.attention import attend, causal_mask
from kvblend.models.transformer import Transformer

__all__ = [
    "DEFAULT_MODEL", "PACKAGED", "KVCache", "LoadedModel", "ModelConfig", "Transformer",
    "attend", "causal_mask", "load_hf_folder", "load_model",
]
