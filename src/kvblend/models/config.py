"""Model configuration: one frozen dataclass, and the adapter from Hugging Face configs.

Architectures differ by a few per-architecture flags (Gemma 3: q/k norms, sandwich
norms, embedding scale, GELU-tanh, query scale, per-layer RoPE and sliding windows);
the layer code reads the flags, never the architecture name."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from kvblend.errors import UnsupportedModelError
from kvblend.rope import RopeConfig

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "gemma3")
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3"}
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only transformer (Llama family, Qwen2, Gemma 3).

    ``layer_types`` (empty: every layer alike) marks each layer "full_attention" or
    "sliding_attention"; with it, ``sliding_window`` and ``rope_local`` apply only to the
    sliding layers. Without it, ``sliding_window`` applies to every layer (Mistral).
    ``norm_plus_one``: the checkpoint stores RMSNorm weights w for a scale of 1 + w
    (folded into our weights at load). ``query_scale``: attention-score scale (None:
    1/sqrt(head_dim)). ``final_logit_softcap``: logits = cap * tanh(logits / cap).
    """

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
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None
    qk_norm: bool = False
    sandwich_norm: bool = False
    norm_plus_one: bool = False
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    query_scale: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {self.arch!r}; kvblend runs {', '.join(SUPPORTED_ARCHS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split into {self.num_kv_heads} KV groups")
        if self.rope.head_dim != self.head_dim or (self.rope_local and self.rope_local.head_dim != self.head_dim):
            raise ValueError("rope.head_dim must equal head_dim")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} per layer ({self.num_layers})")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported activation {self.hidden_act!r}; kvblend runs {ACTIVATIONS}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError("sliding_window must be positive")
        if self.embed_scale <= 0 or (self.query_scale is not None and self.query_scale <= 0):
            raise ValueError("embed_scale and query_scale must be positive")
        if self.final_logit_softcap is not None and self.final_logit_softcap <= 0:
            raise ValueError("final_logit_softcap must be positive")

    def is_sliding(self, layer: int) -> bool:
        """Whether this layer attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of this layer (None: it sees every earlier key)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE this layer's queries and keys are rotated with (Gemma 3: local or global)."""
        if self.rope_local is not None and self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.rope_local
        return self.rope

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
        """Build from a transformers ``PretrainedConfig`` or its config.json (v4 or v5 RoPE fields)."""
        model_type = getattr(hf, "model_type", None)
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            hint = " (multimodal Gemma 3: kvblend runs the text-only gemma3_text)" if model_type == "gemma3" else ""
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}; kvblend runs {', '.join(SUPPORTED_ARCHS)}{hint}"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        extra = _gemma3_fields(hf, head_dim) if arch == "gemma3" else {}
        rope = extra.pop("rope", None) or _rope_from_hf(_rope_params(hf), hf, head_dim)
        return cls(
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rope=rope,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            o_bias=arch != "qwen2" and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=_sliding_window(hf, arch),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_as_tuple(getattr(hf, "eos_token_id", None)),
            **extra,
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


def _rope_from_hf(p: dict[str, Any], hf: Any, head_dim: int) -> RopeConfig:
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


GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _gemma3_rope_params(hf: Any, layer_type: str) -> dict[str, Any]:
    """One layer type's RoPE fields: v5 nests them by layer type; v4 configs give
    rope_theta/rope_scaling (global) and rope_local_base_freq (local, never scaled)."""
    params = getattr(hf, "rope_parameters", None) or {}
    if layer_type in params:
        out = dict(params[layer_type])
    elif layer_type == "full_attention":
        out = dict(getattr(hf, "rope_scaling", None) or {})
        out["rope_type"] = out.pop("type", out.get("rope_type", "default"))
        out.setdefault("rope_theta", getattr(hf, "rope_theta", None))
    else:
        out = {"rope_type": "default", "rope_theta": getattr(hf, "rope_local_base_freq", None)}
    if out.get("rope_theta") is None:
        out["rope_theta"] = GEMMA3_THETA[layer_type]
    return out


def _gemma3_layer_types(hf: Any) -> tuple[str, ...]:
    types = getattr(hf, "layer_types", None)
    if types:
        return tuple(types)
    pattern = getattr(hf, "sliding_window_pattern", None) or getattr(hf, "_sliding_window_pattern", None) or 6
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf.num_hidden_layers))


def _gemma3_fields(hf: Any, head_dim: int) -> dict[str, Any]:
    """Gemma 3's flags: per-layer RoPE and windows, q/k and sandwich norms stored as
    w for (1 + w), sqrt(hidden) embedding scale, GELU-tanh, query_pre_attn_scalar."""
    if getattr(hf, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("Gemma with attention-logit softcapping is not supported")
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention is not supported")
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"unsupported Gemma 3 activation {act!r}")
    return dict(
        rope=_rope_from_hf(_gemma3_rope_params(hf, "full_attention"), hf, head_dim),
        rope_local=_rope_from_hf(_gemma3_rope_params(hf, "sliding_attention"), hf, head_dim),
        layer_types=_gemma3_layer_types(hf),
        qk_norm=True, sandwich_norm=True, norm_plus_one=True,
        embed_scale=math.sqrt(hf.hidden_size), hidden_act="gelu_tanh",
        query_scale=float(getattr(hf, "query_pre_attn_scalar", None) or head_dim) ** -0.5,
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
    )
