"""Per model, device and dtype: what prefill, recompute and loading cost here, measured.

A :class:`Profile` holds three fits and the tiers' load speeds:

* full prefill: ``T(L) = a + b L + c L²`` seconds for a prompt of L tokens;
* one layer's selective recompute: ``t(n, N) = a + b n + c n N`` seconds for n active
  tokens attending over a context of N tokens (projections and MLP ∝ n, attention ∝ n N);
* each store tier: ``latency + bytes / bytes_per_s`` seconds to read one layer of a chunk
  (memory is lent, not read: it costs nothing).

``measure_profile`` times them in a few seconds on the real model (random token ids,
synthetic chunks written to each tier under a private tenant and removed afterwards).
Profiles are JSON files under ``$KVBLEND_HOME/profiles``, named by the model's weights
fingerprint, the device and the dtype (``profile_path``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvblend.models.attention import attend_planned, plan_attention
from kvblend.models.config import ModelConfig
from kvblend.models.loader import cache_home
from kvblend.models.transformer import Transformer
from kvblend.store import codec
from kvblend.store.chunk import ChunkKV
from kvblend.store.keys import KeyContext, chunk_key
from kvblend.store.tier import Tier

PROFILE_TENANT = "kvblend-profile"
PREFILL_LENGTHS = (128, 256, 512, 1024)
LAYER_ACTIVE = (16, 128, 512, 1536)
LAYER_CONTEXT = (1024, 3072)
TIER_TOKENS = (32, 512)


@dataclass(frozen=True)
class TierSpeed:
    """How long one layer of a chunk takes to read from a tier. ``immediate``: lent from
    process memory, free."""

    latency_s: float = 0.0
    bytes_per_s: float = math.inf
    immediate: bool = False

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bytes_per_s <= 0:
            raise ValueError("latency_s must be >= 0 and bytes_per_s > 0")

    def layer_s(self, nbytes: int) -> float:
        return 0.0 if self.immediate else self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    """Measured costs of one model on one device and dtype (see the module docstring).
    ``quality``: next-token KL against fp32 chunk storage, per storage dtype (optional)."""

    model_fingerprint: str
    device: str
    dtype: str
    prefill: tuple[float, float, float]
    layer: tuple[float, float, float]
    tiers: dict[str, TierSpeed] = field(default_factory=dict)
    quality: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(float(x) for x in self.prefill))
        object.__setattr__(self, "layer", tuple(float(x) for x in self.layer))
        if len(self.prefill) != 3 or len(self.layer) != 3:
            raise ValueError("prefill and layer fits need three coefficients each")

    def prefill_s(self, length: int) -> float:
        a, b, c = self.prefill
        return max(0.0, a + b * length + c * length * length)

    def layer_s(self, active: float, context: int) -> float:
        """One layer's recompute time for ``active`` tokens over ``context`` keys."""
        a, b, c = self.layer
        return max(0.0, a + (b + c * context) * active)

    def active_for(self, seconds: float, context: int) -> float:
        """How many active tokens one layer computes in ``seconds`` (inverse of layer_s)."""
        a, b, c = self.layer
        slope = b + c * context
        return math.inf if slope <= 0 else max(0.0, (seconds - a) / slope)

    def with_tiers(self, tiers: dict[str, TierSpeed]) -> Profile:
        return Profile(self.model_fingerprint, self.device, self.dtype, self.prefill, self.layer,
                       {**self.tiers, **tiers}, dict(self.quality))

    def to_json(self) -> str:
        raw = asdict(self)
        raw["tiers"] = {n: {**asdict(t), "bytes_per_s": None if math.isinf(t.bytes_per_s) else t.bytes_per_s}
                        for n, t in self.tiers.items()}
        return json.dumps(raw, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        raw = json.loads(text)
        tiers = {n: TierSpeed(t["latency_s"], math.inf if t["bytes_per_s"] is None else t["bytes_per_s"],
                              t["immediate"]) for n, t in raw.pop("tiers", {}).items()}
        return cls(**raw, tiers=tiers)


def profile_path(fingerprint: str, device: torch.device | str, dtype: torch.dtype | str) -> Path:
    """Where the profile of this model/device/dtype lives (beside the model cache)."""
    dev = str(device).replace(":", "")
    dt = str(dtype).removeprefix("torch.")
    return cache_home() / "profiles" / f"{fingerprint[:32]}-{dev}-{dt}.json"


def load_profile(path: Path) -> Profile | None:
    """The stored profile, or None when absent or unreadable (it is then measured again)."""
    try:
        return Profile.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_profile(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)


# -- measuring -------------------------------------------------------------------------


def _median_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _syncer(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _within(values: Iterable[int], limit: int) -> list[int]:
    """``values`` clipped to ``limit``, at least two distinct ones (small test models)."""
    out = sorted({min(v, limit) for v in values} | ({limit // 2} if min(values) >= limit else set()))
    return [v for v in out if v > 0]


def _fit(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Non-negative least-squares coefficients of ys ≈ rows @ coef: a coefficient that a
    plain fit makes negative (timing noise) is dropped and the rest fitted again."""
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    keep = list(range(x.shape[1]))
    while keep:
        coef = torch.linalg.lstsq(x[:, keep], y).solution.squeeze(1)
        if bool((coef >= 0).all()):
            break
        keep.pop(int(coef.argmin()))
    out = [0.0] * x.shape[1]
    for i, c in zip(keep, coef.tolist() if keep else []):
        out[i] = c
    return tuple(out)


@torch.inference_mode()
def measure_prefill(model: Transformer, lengths: Sequence[int] = PREFILL_LENGTHS, repeats: int = 2,
                    tick: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """Fit of full-prefill seconds against prompt length (see the module docstring)."""
    rows, ys, sync = [], [], _syncer(model.device)
    vocab = model.cfg.vocab_size
    for n in _within(lengths, model.cfg.context_length):
        ids = torch.randint(0, vocab, (n,), device=model.device)
        ys.append(_median_s(lambda: model(ids, model.new_cache(n)), repeats, sync))
        rows.append((1.0, float(n), float(n * n)))
        tick()
    return _fit(rows, ys)  # type: ignore[return-value]


@torch.inference_mode()
def layer_recompute_s(model: Transformer, active: int, context: int, repeats: int = 3) -> float:
    """Median seconds of one layer computing ``active`` tokens, spread over ``context``
    positions as a selection leaves them, against that many keys (as fusion runs it)."""
    layer, dev = model.layers[min(1, len(model.layers) - 1)], model.device
    positions = torch.linspace(0, context - 1, active, device=dev).round().long().unique()  # (n,)
    cache = model.new_cache(context)
    cache.keys[0].normal_()
    cache.values[0].normal_()
    h = torch.randn(positions.shape[0], model.cfg.hidden_size, dtype=model.dtype, device=dev)  # (n, D)
    cos, sin = model.rope_tables(positions)

    def run() -> None:
        q, k, v = layer.project(h, cos, sin)
        cache.keys[0][:, positions] = k
        cache.values[0][:, positions] = v
        plan = plan_attention(positions, context, model.cfg.sliding_window, model.dtype,
                              heads_per_kv=model.cfg.heads_per_kv)
        layer.finish(h, attend_planned(q, cache.keys[0][:, :context], cache.values[0][:, :context], plan))

    return _median_s(run, repeats, _syncer(dev))


def measure_layer(model: Transformer, actives: Sequence[int] = LAYER_ACTIVE,
                  contexts: Sequence[int] = LAYER_CONTEXT,
                  tick: Callable[[], None] = lambda: None) -> tuple[float, float, float]:
    """Fit of one layer's recompute seconds against active tokens and context."""
    rows, ys = [], []
    for ctx in _within(contexts, model.cfg.context_length):
        for n in _within(actives, ctx):
            ys.append(layer_recompute_s(model, n, ctx))
            rows.append((1.0, float(n), float(n * ctx)))
            tick()
    return _fit(rows, ys)  # type: ignore[return-value]


def layer_bytes(cfg: ModelConfig, tokens: int, kv_dtype: str) -> int:
    """Stored bytes of one layer (K and V) of a chunk of ``tokens`` tokens (int8: with its
    per-token scales, ``codec.int8_scale_shape``)."""
    scale = codec.SCALE_DTYPE.itemsize if kv_dtype == "int8" else 0
    return 2 * cfg.num_kv_heads * tokens * (cfg.head_dim * codec.bytes_per_element(kv_dtype) + scale)


def synthetic_chunk(cfg: ModelConfig, tokens: int, kv_dtype: str) -> tuple[object, ChunkKV]:
    """A random chunk of the model's shape under a key of the profiling tenant."""
    ids = tuple(range(1, tokens + 1))
    shape = (cfg.num_kv_heads, tokens, cfg.head_dim)
    kv = [torch.randn(shape) for _ in range(2 * cfg.num_layers)]  # (H, T, D) each
    ctx = KeyContext("profile", "profile", "{}", kv_dtype, (), PROFILE_TENANT)
    return chunk_key(ids, ctx), ChunkKV(ids, 0, tuple(kv[: cfg.num_layers]), tuple(kv[cfg.num_layers :]))


def measure_tier(tier: Tier, cfg: ModelConfig, tokens: Iterable[int] = TIER_TOKENS, repeats: int = 3) -> TierSpeed:
    """Per-layer read latency and bandwidth of ``tier`` (its own storage dtype), from chunks
    of two sizes; a tier that refuses the test chunk is reported as unusable (bandwidth 1 B/s)."""
    if tier.immediate:
        return TierSpeed(immediate=True)
    rows, ys = [], []
    for n in tokens:
        key, chunk = synthetic_chunk(cfg, n, tier.kv_dtype)
        if not tier.put(key, chunk):
            return TierSpeed(0.0, 1.0)
        try:
            per_layer = _median_s(lambda: [tier.read_layer(key, i) for i in range(cfg.num_layers)], repeats,
                                  lambda: None) / cfg.num_layers
        finally:
            tier.delete(key)
        rows.append((1.0, float(layer_bytes(cfg, n, tier.kv_dtype))))
        ys.append(per_layer)
    latency, per_byte = _fit(rows, ys)
    return TierSpeed(max(0.0, latency), 1.0 / per_byte if per_byte > 0 else math.inf)


def measure_profile(model: Transformer, fingerprint: str, tiers: Sequence[Tier] = (),
                    progress: bool = True) -> Profile:
    """Measure everything a Profile holds (a few seconds), with a progress bar on stderr."""
    from tqdm import tqdm

    steps = len(PREFILL_LENGTHS) + len(LAYER_ACTIVE) * len(LAYER_CONTEXT) + len(tiers)
    with tqdm(total=steps, desc="kvblend profile", unit="step", disable=not progress) as bar:
        tick = lambda: bar.update(1)  # noqa: E731
        prefill = measure_prefill(model, PREFILL_LENGTHS, tick=tick)
        layer = measure_layer(model, LAYER_ACTIVE, LAYER_CONTEXT, tick=tick)
        speeds = {}
        for tier in tiers:
            speeds[tier.name] = measure_tier(tier, model.cfg, TIER_TOKENS)
            tick()
    return Profile(fingerprint, str(model.device), str(model.dtype).removeprefix("torch."), prefill, layer, speeds)
