"""Model configuration: one frozen dataclass, and the adapter from Hugging Face configs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from kvblend.errors import UnsupportedModelError
from kvblend.rope import RopeConfig

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only transformer of the Llama family or Qwen2."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {self.arch!r}; kvblend runs {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split into {self.num_kv_heads} KV groups")
        if self.rope.head_dim != self.head_dim:
            raise ValueError("rope.head_dim must equal head_dim")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        """Query heads sharing one KV head (1 without grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_length(self) -> int:
        """Longest sequence the model serves (dynamic NTK stretches the trained window)."""
        if self.rope.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in fp32."""
        return 2 * self.num_layers * self.kv_size * 4

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Build from a transformers ``PretrainedConfig`` (v4 or v5 RoPE fields)."""
        arch = getattr(hf, "model_type", None)
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; kvblend runs {', '.join(SUPPORTED_ARCHS)}"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rope=_rope_from_hf(hf, head_dim),
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=arch != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=_sliding_window(hf, arch),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_as_tuple(getattr(hf, "eos_token_id", None)),
        )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _sliding_window(hf: Any, arch: str) -> int | None:
    if arch == "qwen2":
        if getattr(hf, "use_sliding_window", False):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=True is not supported")
        return None
    return getattr(hf, "sliding_window", None)


def _rope_params(hf: Any) -> dict[str, Any]:
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    legacy = dict(getattr(hf, "rope_scaling", None) or {})
    legacy.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    legacy.setdefault("rope_type", legacy.pop("type", "default"))
    return legacy


def _rope_from_hf(hf: Any, head_dim: int) -> RopeConfig:
    p = _rope_params(hf)
    optional = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "mscale", "mscale_all_dim", "truncate", "original_max_position_embeddings")
    extra = {k: p[k] for k in optional if p.get(k) is not None}
    partial = p.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return RopeConfig(
        head_dim=head_dim,
        theta=float(p.get("rope_theta", 10000.0)),
        rope_type=p.get("rope_type", "default"),
        factor=float(p.get("factor") or 1.0),
        partial_rotary_factor=float(partial or 1.0),
        max_position_embeddings=hf.max_position_embeddings,
        **extra,
    )


DECODE_ONLY_FIELDS = ("bos_token_id", "eos_token_ids")  # never change a token's K/V


def kv_config_digest(config: ModelConfig) -> str:
    """sha256 hex of the canonical JSON of every config field that can change the KV a
    model computes (all fields but ``DECODE_ONLY_FIELDS``: head counts, sizes, norm eps,
    sliding window, biases, RoPE, ...). Part of every chunk key, so a store shared by
    engines with different configs never serves one's KV to another. Fields added to
    ``ModelConfig`` later are covered without a change here."""
    fields = {k: v for k, v in asdict(config).items() if k not in DECODE_ONLY_FIELDS}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
