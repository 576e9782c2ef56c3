"""Rotary position embeddings (RoPE), with the scaling variants Hugging Face configs use.

RoPE rotates each pair of key/query dimensions by an angle ``position * inv_freq[i]``.
A post-RoPE key can therefore be moved to another position by one more rotation:
``rotate(rope(k, p), d) == rope(k, p + d)``. That identity is what lets a document's
cached keys be reused at any position in a prompt (CacheBlend's position recovery).
Dynamic NTK past ``max_position_embeddings`` is the exception: its frequencies depend on
the sequence's length, so keys made in a sequence of another length are un-rotated with
their own frequencies and re-rotated with the new ones (``reposition_tables``).

Angles are computed in float64 and cast at the end, so composing rotations is exact to
float32 rounding even at large positions (float32 angles would drift ~1e-3 rad at 8k).

Supported: default, linear, dynamic (NTK), llama3 and yarn scaling; partial rotary
(``rotary_dim < head_dim``: the tail dims pass through); half-split pairing (dim i with
i + rotary_dim/2, as in Llama/Qwen) and interleaved pairing (2i with 2i+1, GPT-J style).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch

from kvblend.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Everything that decides the rotation applied at a position.

    ``factor`` and the other scaling fields only matter for the types that read them.
    ``max_position_embeddings`` is the dynamic-NTK threshold; yarn and llama3 use
    ``original_max_position_embeddings``.
    """

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    interleaved: bool = False
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE type {self.rope_type!r}; kvblend supports {', '.join(ROPE_TYPES)}"
            )
        if self.head_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"rotary dim must be a positive even number, got {self.rotary_dim}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("RoPE theta and factor must be positive")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def original_context(self) -> int:
        return self.original_max_position_embeddings or self.max_position_embeddings

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): part of a chunk's cache key."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _llama3_inv_freq(cfg: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = cfg.original_context
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_correction_range(cfg: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_context / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    extrapolation = _base_inv_freq(dim, cfg.theta)
    interpolation = extrapolation / cfg.factor
    low, high = _yarn_correction_range(cfg, dim)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per pair
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq(cfg: RopeConfig, seq_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies, (rotary_dim // 2,) float64.

    ``seq_len`` only matters for dynamic NTK, which raises the base once a sequence
    grows past ``max_position_embeddings``.
    """
    dim = cfg.rotary_dim
    if cfg.rope_type == "default":
        return _base_inv_freq(dim, cfg.theta)
    if cfg.rope_type == "linear":
        return _base_inv_freq(dim, cfg.theta) / cfg.factor
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg, _base_inv_freq(dim, cfg.theta))
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg, dim)
    length = max(seq_len or 0, cfg.max_position_embeddings)
    scale = cfg.factor * length / cfg.max_position_embeddings - (cfg.factor - 1)
    return _base_inv_freq(dim, cfg.theta * scale ** (dim / (dim - 2)))


def attention_scaling(cfg: RopeConfig) -> float:
    """Factor yarn applies to cos/sin (1.0 for every other type)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.attention_factor is not None:
        return cfg.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.mscale and cfg.mscale_all_dim:
        return mscale(cfg.factor, cfg.mscale) / mscale(cfg.factor, cfg.mscale_all_dim)
    return mscale(cfg.factor)


def _angles_cos_sin(
    angles: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def cos_sin(
    cfg: RopeConfig,
    positions: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions``, each (T, rotary_dim // 2), scaled for yarn.

    ``seq_len`` defaults to ``max(positions) + 1`` (what dynamic NTK keys on).
    """
    if seq_len is None and cfg.rope_type == "dynamic" and positions.numel():
        seq_len = int(positions.max()) + 1
    freqs = inv_freq(cfg, seq_len).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # (T, rd/2)
    return _angles_cos_sin(angles, attention_scaling(cfg), dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x`` (..., T, head_dim) by per-position angles; cos/sin are (T, rd/2).

    Dimensions past the rotary dim pass through unchanged. Writes into ``out`` (same shape
    as x, must not overlap it; e.g. a slot range of a KV cache) or a new tensor, half by
    half (four kernels, no temporaries), and returns it.
    """
    rd = cos.shape[-1] * 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    x1, x2 = _halves(x[..., :rd], interleaved)
    y1, y2 = _halves(out[..., :rd], interleaved)
    torch.mul(x1, cos, out=y1)
    y1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=y2)
    y2.addcmul_(x1, sin)
    if rd < x.shape[-1]:
        out[..., rd:] = x[..., rd:]
    return out


def _halves(rot: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of each rotated pair: even/odd dims or first/second half."""
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    half = rot.shape[-1] // 2
    return rot[..., :half], rot[..., half:]


def rotation_tables(
    delta: int | torch.Tensor,
    n: int,
    cfg: RopeConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin that move ``n`` post-RoPE keys by ``delta`` (int or (n,) offsets): (n or 1, rd/2).

    A pure rotation, without yarn's scaling (that was applied once, when the key was made).
    """
    d = torch.as_tensor(delta, dtype=torch.float64, device=device)
    d = d.reshape(1) if d.dim() == 0 else d
    if d.shape[0] not in (1, n):
        raise ValueError(f"delta must be a scalar or have {n} entries, got {d.shape[0]}")
    angles = d[:, None] * inv_freq(cfg, seq_len).to(device)[None, :]
    return _angles_cos_sin(angles, 1.0, dtype)


def length_dependent(cfg: RopeConfig, seq_len: int) -> bool:
    """Whether a sequence of ``seq_len`` tokens is rotated with other frequencies than a
    short one: dynamic NTK past ``max_position_embeddings``. Keys made at another
    length then differ from this sequence's even at the same position."""
    return cfg.rope_type == "dynamic" and seq_len > cfg.max_position_embeddings


def reposition_tables(
    cfg: RopeConfig,
    n: int,
    old: tuple[int, int],
    new: tuple[int, int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin (n or 1, rd/2) that move ``n`` consecutive post-RoPE keys made at
    ``old = (start, seq_len)`` to ``new = (start, seq_len)``; None when nothing moves.

    ``seq_len`` is the length of the sequence the keys were (or are to be) rotated in,
    which only dynamic NTK reads. With equal frequencies this is ``rotation_tables`` of
    the shift. Otherwise each token's angle is un-rotated with the old frequencies and
    rotated with the new ones: ``(new_start + t) * f_new - (old_start + t) * f_old``,
    which a single shift cannot express.
    """
    f_old, f_new = inv_freq(cfg, old[1]), inv_freq(cfg, new[1])
    if torch.equal(f_old, f_new):
        delta = new[0] - old[0]
        return rotation_tables(delta, n, cfg, dtype, device, old[1]) if delta else None
    t = torch.arange(n, dtype=torch.float64)[:, None]
    angles = (new[0] + t) * f_new[None, :] - (old[0] + t) * f_old[None, :]  # (n, rd/2)
    return _angles_cos_sin(angles.to(device), 1.0, dtype)


def rotate(
    k: torch.Tensor,
    delta: int | torch.Tensor,
    cfg: RopeConfig,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Move post-RoPE keys ``k`` (..., T, head_dim) by ``delta`` positions.

    ``delta`` is an int or a (T,) tensor of per-token offsets, so that
    ``rotate(rope(k, p), d) == rope(k, p + d)``. For dynamic NTK this holds while both
    positions use the same frequencies (inside ``max_position_embeddings``); keys made
    at another sequence length need ``reposition_tables``.
    """
    cos, sin = rotation_tables(delta, k.shape[-2], cfg, k.dtype, k.device, seq_len)
    return apply_rope(k, cos, sin, cfg.interleaved)
