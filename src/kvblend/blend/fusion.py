"""Fusing cached document KV into one prompt cache, with selective recompute (CacheBlend).

Layer by layer over the prompt positions not covered by the exact prefix cache:

* every document's cached KV is re-rotated to its new position and written in;
* before the first check layer every token runs; at layer 0 cached tokens project only
  their queries where the cache is lossless (layer 0's K/V equal the re-rotated cache's;
  KV stored in fp16 or int8 is projected again), and the layer's outputs are the real
  inputs of layer 1;
* at each check layer, fresh K/V of the still-active document tokens are compared with
  the cached ones and only the top fraction by deviation stays active (nested sets);
* active tokens' fresh K/V replace the cached ones; only active tokens run attention
  (exact causal mask over global positions) and the MLP;
* forced tokens (no cached KV, the question/suffix) are active at every layer.

Ratio 1 reproduces a full prefill; ratio 0 with no full layer is full KV reuse.
The chunks' tensors are only ever read (they may be borrowed from the store).

Each layer uses its own RoPE (position recovery rotates a layer's cached keys with that
layer's frequencies: Gemma 3's local and global layers differ) and its own sliding
window in the attention plan; both are built once per distinct config.

A chunk hands out one layer at a time, when fusion reaches it (``CachedKV.layer``), so a
loader can fetch layer i+1 while layer i is computed; a layer that cannot be had raises
:class:`LayerUnavailable` before any of that layer's work.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch

from kvblend import rope as rope_lib
from kvblend.blend.config import check_layers_fit
from kvblend.blend.select import SelectionDetail, SelectionStats, deviation, kept_count, select_tokens, selection_stats
from kvblend.generation.chunked import run_steps
from kvblend.models.kv_cache import KVCache
from kvblend.models.attention import AttentionPlan, attend, attend_planned, plan_attention
from kvblend.models.transformer import DecoderLayer, Transformer
from kvblend.store.chunk import ChunkKV


class CachedKV(Protocol):
    """A document's cached KV as fusion reads it: sizes up front, layers when reached.

    ``layer(i)`` gives (K, V) of layer i, each (heads, n_tokens, head_dim), post-RoPE at
    ``base_position``..., possibly blocking until loaded; None when it cannot be had.
    ``ChunkKV`` (all layers in memory) is one."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def base_position(self) -> int: ...

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...


@dataclass(frozen=True)
class SlicedKV:
    """Tokens ``[start, start + n)`` of another cached KV (a run of a stored chunk that a
    prompt holds without the rest): the same tensors, viewed, never copied. Its keys were
    rotated in the whole chunk's sequence (``made_length``, which dynamic NTK reads)."""

    inner: CachedKV
    start: int
    n: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.n < 0 or self.start + self.n > self.inner.n_tokens:
            raise ValueError(f"tokens [{self.start}, {self.start + self.n}) are outside a chunk of "
                             f"{self.inner.n_tokens}")

    @property
    def n_tokens(self) -> int:
        return self.n

    @property
    def base_position(self) -> int:
        return self.inner.base_position + self.start

    @property
    def made_length(self) -> int:
        return made_length(self.inner)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = self.inner.layer(layer)
        if kv is None:
            return None
        k, v = kv
        return k[:, self.start : self.start + self.n], v[:, self.start : self.start + self.n]


def made_length(chunk: CachedKV) -> int:
    """The length of the sequence ``chunk``'s keys were rotated in."""
    return getattr(chunk, "made_length", chunk.base_position + chunk.n_tokens)


def unsliced(chunk: CachedKV) -> CachedKV:
    """The cached KV a ``SlicedKV`` views (``chunk`` itself otherwise)."""
    return chunk.inner if isinstance(chunk, SlicedKV) else chunk


class LayerUnavailable(Exception):
    """Layer ``layer`` of the placed chunks at ``indices`` (into ``plan.placed``) could not be
    loaded; raised before that layer is computed, so the caller can fuse again without them."""

    def __init__(self, indices: tuple[int, ...], layer: int) -> None:
        super().__init__(f"layer {layer} of placed chunks {indices} could not be loaded")
        self.indices = indices
        self.layer = layer


@dataclass
class PlacedChunk:
    """A document's cached KV and where it sits in this prompt."""

    start: int
    chunk: ChunkKV | CachedKV


@dataclass
class FusionPlan:
    """Everything one fusion needs; built per request, never shared."""

    ids: torch.Tensor  # (N,) prompt token ids
    placed: list[PlacedChunk]
    prefix_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # exact KV of ids[:P0]
    check_layers: tuple[int, ...] = (1,)
    ratios: tuple[float, ...] = (0.15,)
    signal: str = "v"
    select_from_start: bool = False  # True: no full layer before the first check (full reuse)
    extra_capacity: int = 0
    # Strategy hooks (kvblend.blend.strategies; None: the paper's CacheBlend as above).
    strategy: Any = None  # a BlendConfig for strategies.fuse_planned (fuse() itself refuses it)
    recompute: torch.Tensor | None = None  # (N,) bool: cached tokens computed at every layer too
    pick: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None  # (scores, pos, k) -> idx
    # (layer, q, K, V, pos) -> None, or the layer's attention output (T, Hq*d) of every active row, used as is
    observe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
    # (cache, layer, written positions, their fresh K, V and queries) -> None
    correct: Callable[[KVCache, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    reuse_cache: KVCache | None = None  # already holds the prefix and re-rotated chunks: fill it in place
    # (N,) bool, with ``reuse_cache``: tokens of documents without a placed chunk whose K/V that
    # cache holds from an earlier pass; candidates like a placed chunk's tokens
    held: torch.Tensor | None = None
    doc_spans: tuple[tuple[int, int], ...] = ()  # every document's [start, end), placed or not
    # with ``reuse_cache``: positions below it hold their final K/V there (a first pass computed
    # the prompt before the first placed chunk exactly: nothing there reads reused K/V)
    exact_upto: int = 0
    # the placed chunks' K/V are what the model computes from their tokens (stored without
    # loss, e.g. fp32 for an fp32 model): layer 0 then projects only their queries; False
    # (fp16/int8 storage): layer 0 projects their K/V too, so ratio 1 stays a full prefill
    lossless: bool = True
    # a question-selected blend whose risk is above this recomputes at twice its ratio
    # (``strategies.escalated_keep``; the engine's per-request threshold)
    escalate_at: float | None = None


class FusionOutput(NamedTuple):
    cache: KVCache
    logits: torch.Tensor  # (V,) next-token logits after the prompt
    recomputed: list[int]  # tokens computed at each layer
    candidates: int  # document tokens that had cached KV
    checks: tuple[SelectionStats, ...] = ()  # per check layer; spans are ``plan.placed`` in order
    # a strategy's estimate of how much of reuse's error this blend left (``strategies.blend_risk``, ``moved_risk``)
    risk: float | None = None
    escalated: float | None = None  # the risk that sent the blend to twice its ratio (None: it was not)


def _prefix_len(plan: FusionPlan) -> int:
    return 0 if plan.prefix_kv is None else plan.prefix_kv[0][0].shape[1]


def _candidate_mask(plan: FusionPlan, n: int, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    for p in plan.placed:
        mask[p.start : p.start + p.chunk.n_tokens] = True
    if plan.held is not None:
        if plan.reuse_cache is None:
            raise ValueError("held tokens need the reuse_cache that holds their K/V")
        mask |= plan.held
    mask[n - 1] = False  # the last prompt token is always computed: it yields the logits
    return mask


def _write_prefix(cache: KVCache, plan: FusionPlan) -> None:
    if plan.prefix_kv is None:
        return
    for layer, (k, v) in enumerate(zip(*plan.prefix_kv)):
        cache.write(layer, 0, k, v)


Rotations = dict[rope_lib.RopeConfig, list[tuple[torch.Tensor, torch.Tensor] | None]]


def _rotations(model: Transformer, plan: FusionPlan) -> Rotations:
    """Per distinct layer RoPE, per placed chunk, the cos/sin moving its keys to their new
    start (None: already there). The shift is the same for every layer; the angles are
    not when layers use different RoPE bases, so each RoPE config gets its own tables.
    A chunk's keys were rotated in a sequence of ``base_position + n_tokens`` tokens, the
    prompt's in one of ``len(ids)``: dynamic NTK rotates those two with different
    frequencies, so the table then un-rotates and re-rotates token by token."""
    out: Rotations = {}
    for layer in model.layers:
        if layer.rope not in out:
            out[layer.rope] = [_rotation(model, plan, p, layer.rope) for p in plan.placed]
    return out


def _rotation(model: Transformer, plan: FusionPlan, p: PlacedChunk,
              rope: rope_lib.RopeConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    made = (p.chunk.base_position, made_length(p.chunk))
    return rope_lib.reposition_tables(rope, p.chunk.n_tokens, made, (p.start, plan.ids.shape[0]),
                                      model.dtype, model.device)


def _cached_layer(plan: FusionPlan, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) of ``layer`` for every placed chunk (the one synchronisation point per layer
    with a loader); LayerUnavailable naming the chunks that have none."""
    kvs = [p.chunk.layer(layer) for p in plan.placed]
    missing = tuple(i for i, kv in enumerate(kvs) if kv is None)
    if missing:
        raise LayerUnavailable(missing, layer)
    return kvs  # type: ignore[return-value]


def _write_cached_layer(model: Transformer, cache: KVCache, plan: FusionPlan, layer: int,
                        rotations: Rotations) -> None:
    """Re-rotated cached K/V of every placed chunk into this layer's slots."""
    dev, dt, rope = model.device, model.dtype, model.layers[layer].rope
    interleaved = rope.interleaved
    for p, rot, (k, v) in zip(plan.placed, rotations[rope], _cached_layer(plan, layer)):
        end = p.start + p.chunk.n_tokens
        k_slots, v_slots = cache.keys[layer][:, p.start : end], cache.values[layer][:, p.start : end]
        k = k.to(dev, dt)
        if rot is None:
            k_slots.copy_(k)
        else:
            rope_lib.apply_rope(k, *rot, interleaved, out=k_slots)  # rotated straight into the cache
        v_slots.copy_(v)


def _select(
    layer: DecoderLayer, h: torch.Tensor, active: torch.Tensor, is_cand: torch.Tensor,
    rope_tables: tuple[torch.Tensor, torch.Tensor], cache: KVCache, layer_idx: int, keep: int, signal: str,
    spans: list[tuple[int, int]],
    pick: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, SelectionStats]:
    """Indices into ``active`` that stay: all non-candidates plus the top-``keep`` candidates
    (or those ``pick`` chooses from the deviations), and what the check saw (per document ``spans``).

    Fresh K/V are projected for the candidates only, and K only when the signal uses it:
    queries are computed afterwards, for the tokens that stay."""
    cand_idx = is_cand.nonzero().squeeze(1)
    pos = active[cand_idx]
    use_k = signal != "v"
    cos, sin = rope_tables
    k, v = layer.project_kv(h[cand_idx], cos[pos], sin[pos], keys=use_k)
    cached_k = cache.keys[layer_idx][:, pos] if use_k else None
    dev = deviation(k, v, cached_k, cache.values[layer_idx][:, pos], signal)
    picked = (pick or (lambda d, _p, k: select_tokens(d, k)))(dev, pos, keep)  # (K,) into the candidates
    chosen = cand_idx[picked]
    stats = selection_stats(layer_idx, dev, active[chosen], spans)._replace(
        detail=SelectionDetail(pos, dev, picked, pos, dev))
    return torch.cat((chosen, (~is_cand).nonzero().squeeze(1))).sort().values, stats


def fuse(model: Transformer, plan: FusionPlan) -> FusionOutput:
    """``fuse_steps`` run to its end here."""
    return run_steps(fuse_steps(model, plan), model)


@torch.inference_mode()
def fuse_steps(model: Transformer, plan: FusionPlan) -> Generator[int, None, FusionOutput]:
    """Build the prompt's KV cache from the plan; returns it with the next-token logits.
    A step generator (``generation.chunked``): it yields the number of tokens it computed
    after each layer, so the model's owner can run other work between layers.

    Hooks (all None for the paper's algorithm; a plan with a ``strategy`` goes through
    ``strategies.fuse_planned``, which calls back here with the hooks set); ``recompute`` adds cached
    tokens to the always-computed set when ``select_from_start``; ``pick`` replaces the
    global top-k at a check layer; ``observe`` sees each layer's queries, keys and values (after
    this layer's writes) and may return that layer's attention output for the active rows, which
    is then not computed again;
    ``correct`` sees fresh K/V (and the same rows' queries) before they overwrite the cache. Raises LayerUnavailable
    when a placed chunk cannot hand out a layer (see ``fuse_or_drop``)."""
    if plan.strategy is not None:
        raise ValueError("a plan with a strategy runs through blend.strategies.fuse_planned")
    n, dev = plan.ids.shape[0], model.device
    check_layers_fit(plan.check_layers, len(model.layers))
    p0 = _prefix_len(plan) if plan.reuse_cache is None else max(_prefix_len(plan), plan.exact_upto)
    cache = plan.reuse_cache or model.new_cache(n + plan.extra_capacity)
    cache.forget_half()  # its slots are written directly below
    if plan.reuse_cache is None:
        _write_prefix(cache, plan)
    is_cand_all = _candidate_mask(plan, n, dev)
    n_cand = int(is_cand_all.sum())
    tables = model.layer_rope_tables(torch.arange(n, device=dev))  # per layer, shared by RoPE config
    active = torch.arange(p0, n, device=dev)
    h = model.embed(plan.ids[p0:])  # (M, D)
    if plan.select_from_start:
        forced = ~is_cand_all[active]
        if plan.recompute is not None:
            forced |= plan.recompute[active]
        keep = forced.nonzero().squeeze(1)
        active, h = active[keep], h[keep]
    checks = dict(zip(plan.check_layers, plan.ratios))
    recomputed, last, seen = [], len(model.layers) - 1, []
    spans = [(p.start, p.start + p.chunk.n_tokens) for p in plan.placed]
    # Per distinct window / RoPE table, rebuilt only when the active set changes.
    attn_plans: dict[int | None, AttentionPlan] = {}
    active_ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rotations = _rotations(model, plan)
    for layer_idx, layer in enumerate(model.layers):
        if layer_idx:
            yield recomputed[-1]  # one step per layer: the layer before is done
        if plan.reuse_cache is None:
            _write_cached_layer(model, cache, plan, layer_idx, rotations)
        if layer_idx in checks and not plan.select_from_start:
            keep, check = _select(layer, h, active, is_cand_all[active], tables[layer_idx], cache, layer_idx,
                                  kept_count(checks[layer_idx], n_cand), plan.signal, spans, plan.pick)
            seen.append(check)
            active, h = active[keep], h[keep]
            attn_plans, active_ropes = {}, {}
        active_rope = _active_rope(active_ropes, tables[layer_idx], active)
        recomputed.append(int(active.shape[0]))
        if layer_idx == 0 and n_cand and not plan.select_from_start and plan.lossless:
            fresh = (~is_cand_all[active]).nonzero().squeeze(1)  # tokens without cached KV
            q, k, v = layer.project_known_kv(h, *active_rope, fresh)
            written = active[fresh]
        else:
            q, k, v = layer.project(h, *active_rope)
            written = active
        if plan.correct is not None:
            plan.correct(cache, layer_idx, written, k, v, q if written is active else q[:, fresh])
        cache.keys[layer_idx][:, written] = k
        cache.values[layer_idx][:, written] = v
        keys, values = cache.view(layer_idx, n)
        attn = None if plan.observe is None else plan.observe(layer_idx, q, keys, values, active)  # (T, Hq*d)
        if layer_idx == last and model.sees_all(n):  # only the final token's output is read
            h = layer.finish(h[-1:], attend(q[:, -1:], keys, values) if attn is None else attn[-1:])
            continue
        if attn is None:
            if layer.window not in attn_plans:
                attn_plans[layer.window] = plan_attention(active, n, layer.window, model.dtype,
                                                          heads_per_kv=model.cfg.heads_per_kv)
            attn = attend_planned(q, keys, values, attn_plans[layer.window])
        h = layer.finish(h, attn)
    cache.length = n
    yield recomputed[-1]
    return FusionOutput(cache, model.logits(h[-1:])[0], recomputed, n_cand, tuple(seen))


def _active_rope(memo: dict[int, tuple[torch.Tensor, torch.Tensor]], table: tuple[torch.Tensor, torch.Tensor],
                 active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a layer's cos/sin table at the active positions, gathered once per
    table (layers sharing a RoPE share the table object) and active set."""
    if id(table) not in memo:
        memo[id(table)] = (table[0][active], table[1][active])
    return memo[id(table)]


def fuse_or_drop(model: Transformer, plan: FusionPlan,
                 run: Callable[[Transformer, FusionPlan], Generator[int, None, FusionOutput]] | None = None,
                 ) -> tuple[FusionOutput, list[PlacedChunk]]:
    """``fuse_or_drop_steps`` run to its end here."""
    return run_steps(fuse_or_drop_steps(model, plan, run or fuse_steps), model)


def fuse_or_drop_steps(model: Transformer, plan: FusionPlan,
                       run: Callable[[Transformer, FusionPlan], Generator[int, None, FusionOutput]],
                       ) -> Generator[int, None, tuple[FusionOutput, list[PlacedChunk]]]:
    """``run`` (``fuse_steps`` or ``strategies.fuse_planned_steps``), falling back to
    recomputing the documents whose cached layers cannot be had; a step generator.

    A chunk missing layer l is dropped from the plan and fusion starts again from layer 0:
    its tokens then run at every layer, exactly as if the document had missed the store.
    (Making them active only from layer l on would need their hidden states at layer l,
    which selective recompute never computed for tokens it left inactive; reusing the
    earlier layers as they were would also leave the other tokens' states built on the
    dropped chunk's KV.) Chunks that did load keep their layers, so the retry reads
    nothing again; it costs at most the l layers already computed. Returns the output and
    the dropped chunks."""
    dropped: list[PlacedChunk] = []
    while True:
        try:
            return (yield from run(model, plan)), dropped
        except LayerUnavailable as exc:
            gone = set(exc.indices)
            dropped += [p for i, p in enumerate(plan.placed) if i in gone]
            plan = replace(plan, placed=[p for i, p in enumerate(plan.placed) if i not in gone])
