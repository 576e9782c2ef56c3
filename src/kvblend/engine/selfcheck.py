"""A per-model self-check, run once per model, dtype and kvblend build (issue #15).

CacheBlend is only as correct as its position recovery and fusion are for a given
model's structure. On a short built-in input (a document between a prefix and a
question, 24 tokens), four exact invariants are measured on the model itself:

* ``rerotation``: cached layer-0 keys moved to their place in the prompt equal the keys
  a full prefill computes there (layer 0's K depends only on token and position);
* ``rerotation-far``: the same for the document moved to the end of the longest prompt
  the model serves, computed on the document alone (scaled RoPE types and dynamic NTK
  differ most there; no long prefill is run);
* ``blend-ratio-1``: blend recomputing every document token gives full prefill's logits;
* ``ratio-0-reuse``: blend keeping no document token gives full reuse's logits.

Each compares the largest absolute difference with a tolerance relative to the
reference's scale, per compute dtype. A model that fails is refused for reuse, blend
and prefix-on-documents with a ``ModelCheckError`` naming the failed checks; full
prefill still works. Nothing here touches an engine's caches or store: it runs the
model's own functions (``compute_chunk_kv``, ``fuse``, the forward) on private caches.

Results are memoised in the process and, for a model loaded from files, stored as
JSON under ``$KVBLEND_HOME/selfcheck/`` keyed by the weights fingerprint, a digest of
the model config, the dtype, the device type and the kvblend build (its version and a
digest of its sources, so an edited checkout checks again).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import torch

import kvblend
from kvblend import rope as rope_lib
from kvblend.blend.chunks import compute_chunk_kv
from kvblend.blend.fusion import FusionPlan, PlacedChunk, fuse
from kvblend.errors import ModelCheckError
from kvblend.models.loader import LoadedModel, cache_home

CHECKS = ("rerotation", "rerotation-far", "blend-ratio-1", "ratio-0-reuse")
# Largest |difference| allowed, relative to max(1, the reference's largest |value|).
# Measured gaps: fp32 ~1e-6 relative (tiny models and SmolLM2); bf16 up to ~1.5e-2 (SmolLM2's
# blend-ratio-1), while a wrong rotation moves keys by ~1x their scale.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
REFUSED = ("reuse", "blend")  # and "prefix" when the request has documents
SPANS = ((6, 12, 6), (2, 4, 2))  # prefix, document, suffix: the first that fits the context
T = TypeVar("T")


@dataclass(frozen=True)
class CheckOutcome:
    """One invariant: the measured gap, the tolerance it was held to, and the verdict."""

    name: str
    gap: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.gap <= self.tolerance  # False for NaN


@dataclass(frozen=True)
class SelfCheckResult:
    """The self-check of one model and dtype; ``require`` refuses what it cannot serve."""

    model: str
    dtype: str
    outcomes: tuple[CheckOutcome, ...]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes)

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outcomes if not o.passed)

    def require(self, method: str, has_documents: bool) -> None:
        """Raise ``ModelCheckError`` if a method that reuses KV asks a model that failed."""
        if self.passed or not (method in REFUSED or (method == "prefix" and has_documents)):
            return
        detail = ", ".join(f"{o.name} (gap {o.gap:.3g} > {o.tolerance:.3g})" for o in self.outcomes if not o.passed)
        raise ModelCheckError(
            f"model {self.model} ({self.dtype}) failed kvblend's self-check: {detail}; method {method!r} "
            "would reuse KV it cannot place correctly. Use method 'full'.")

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype,
                           "outcomes": [asdict(o) for o in self.outcomes]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SelfCheckResult":
        raw = json.loads(text)
        return cls(raw["model"], raw["dtype"], tuple(CheckOutcome(**o) for o in raw["outcomes"]))


@lru_cache(maxsize=1)
def build_digest() -> str:
    """kvblend's version and a digest of its sources: what the checks' verdict depends on."""
    root = Path(kvblend.__file__).parent
    h = hashlib.sha256(kvblend.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def check_key(loaded: LoadedModel) -> str:
    """What a result is valid for: weights, config, dtype, device type and kvblend build."""
    model = loaded.model
    config = json.dumps(asdict(loaded.config), sort_keys=True, default=str)
    parts = (loaded.fingerprint, config, str(model.dtype), model.device.type, build_digest())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _spans(loaded: LoadedModel) -> tuple[int, int, int] | None:
    room = loaded.config.context_length - 1
    return next((s for s in SPANS if sum(s) <= room), None)


def _inputs(loaded: LoadedModel, spans: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """Deterministic token ids (n,), the document's ids and where it starts."""
    vocab, bos = loaded.config.vocab_size, loaded.config.bos_token_id
    g = torch.Generator().manual_seed(1515)
    ids = torch.randint(min(4, vocab - 1), vocab, (sum(spans),), generator=g)
    if bos is not None:
        ids[0] = bos
    doc = tuple(int(t) for t in ids[spans[0] : spans[0] + spans[1]])
    return ids.to(loaded.model.device), doc, spans[0]


def _gap(got: torch.Tensor, want: torch.Tensor, rel: float, name: str) -> CheckOutcome:
    scale = max(1.0, want.float().abs().max().item())
    return CheckOutcome(name, (got.float() - want.float()).abs().max().item(), rel * scale)


def _far_rerotation(loaded: LoadedModel, doc: tuple[int, ...], base: int, rel: float) -> CheckOutcome:
    """Layer-0 keys of ``doc`` made after ``base`` tokens, moved as fusion moves them to
    the end of a prompt of ``context_length - 1`` tokens, against keys made there."""
    model, n = loaded.model, len(doc)
    end = loaded.config.context_length - 1
    h = model.embed(torch.tensor(doc, dtype=torch.long, device=model.device))  # (n, D)

    def keys_at(start: int) -> torch.Tensor:  # (Hkv, n, d), in a sequence ending with the document
        cos, sin = model.layer_rope_tables(torch.arange(start, start + n, device=model.device))[0]
        return model.layers[0].project_kv(h, cos, sin)[0]

    made, cfg = keys_at(base), model.layers[0].rope  # the layer's own RoPE (Gemma 3: local)
    tables = rope_lib.reposition_tables(cfg, n, (base, base + n), (end - n, end), model.dtype, model.device)
    moved = made if tables is None else rope_lib.apply_rope(made, *tables, cfg.interleaved)
    return _gap(moved, keys_at(end - n), rel, "rerotation-far")


@torch.inference_mode()
def run_checks(loaded: LoadedModel) -> SelfCheckResult:
    """Measure the four checks on the built-in input (private caches only).

    Five passes over the model: the document's chunk KV (computed after the sink token,
    placed after the whole prefix), a full prefill, and fusion at ratio 1, ratio 0 and
    full reuse; plus two layer-0 projections of the document for ``rerotation-far``."""
    model, dtype = loaded.model, loaded.model.dtype
    spans = _spans(loaded)
    if spans is None or len(model.layers) < 2:
        return SelfCheckResult(loaded.name, str(dtype), ())  # nothing to blend in so small a model
    ids, doc, start = _inputs(loaded, spans)
    placed = [PlacedChunk(start, compute_chunk_kv(model, (int(ids[0]),), doc))]
    full_cache = model.new_cache(ids.shape[0])
    full = model(ids, full_cache)[0]  # (V,)

    def fused(ratio: float, reuse: bool = False):
        return fuse(model, FusionPlan(ids, placed, None, (1,), (ratio,), "v", select_from_start=reuse))

    ratio0, rel, slots = fused(0.0), TOLERANCE.get(dtype, 6e-2), slice(start, start + len(doc))
    return SelfCheckResult(loaded.name, str(dtype), (
        # layer 0 keeps the re-rotated cached keys of document tokens (they project only queries)
        _gap(ratio0.cache.keys[0][:, slots], full_cache.keys[0][:, slots], rel, "rerotation"),
        _far_rerotation(loaded, doc, 1, rel),
        _gap(fused(1.0).logits, full, rel, "blend-ratio-1"),
        _gap(ratio0.logits, fused(0.0, reuse=True).logits, rel, "ratio-0-reuse"),
    ))


_memo: dict[str, SelfCheckResult] = {}
_memo_lock = threading.Lock()


def stored_path(loaded: LoadedModel, key: str, folder: str = "selfcheck") -> Path | None:
    """Where a per-model result is kept (``$KVBLEND_HOME/<folder>/<key>.json``): only for a
    model loaded from files (its fingerprint is then a hash of its weights); a model built
    in memory is checked once per process."""
    if not (Path(loaded.folder) / "config.json").is_file():
        return None
    return cache_home() / folder / f"{key}.json"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path``: a concurrent reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def ensure_checked(loaded: LoadedModel) -> SelfCheckResult:
    """The model's self-check result: memoised, else read from disk, else run and stored."""
    key = check_key(loaded)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
        path = stored_path(loaded, key)
        result = read_stored(path, SelfCheckResult.from_json)
        if result is None:
            result = run_checks(loaded)
            if path is not None:
                write_atomic(path, result.to_json())
        _memo[key] = result
        return result


def read_stored(path: Path | None, parse: Callable[[str], T]) -> T | None:
    """``parse`` of the file at ``path``; None when there is none or it is unreadable (then
    the caller measures again)."""
    if path is None or not path.is_file():
        return None
    try:
        return parse(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget() -> None:
    """Drop the in-process memo (the stored files stay)."""
    with _memo_lock:
        _memo.clear()
