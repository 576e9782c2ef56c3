"""Our decoder-only transformer (Llama family, Qwen2, Gemma 3), written as explicit per-layer steps.

Each layer exposes the steps a caller needs to run it on any subset of tokens, at any
positions, against any key/value set:

    q, k, v = layer.project(h, cos, sin)       # norm + q/k/v projection + RoPE
    a = attend(q, keys, values, mask)          # attention against explicit K/V
    h = layer.finish(h, a)                     # output projection + residual + MLP

The model never owns a request's KV cache: ``forward`` writes into a ``KVCache`` the
caller passes in. Only the logits the caller asks for are computed.

Each layer carries its own RoPE config and sliding window (Gemma 3 alternates local
layers, θ 10k with a window, and global ones, θ 1e6): callers pass each layer the
cos/sin of ``layer.rope`` (``Transformer.layer_rope_tables``) and plan its attention
with ``layer.window``.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvblend import rope as rope_lib
from kvblend.errors import ContextLengthError
from kvblend.models.attention import (AttentionPlan, attend, attend_parts, attend_planned, first_visible,
                                      plan_attention)
from kvblend.models.config import ModelConfig
from kvblend.models.kv_cache import KVCache
from kvblend.models.packed import (PackedWeight, decode_pass, decoding, in_huge_pages, is_decoding,
                                   native_layer_ops, packed_bytes, resolve_decode_weights)


# Measured on SmolLM2 at 3072 tokens (2-core CPU): the MLP over blocks of 1024 rows took
# 0.92-0.96x the time of one (3072, 2I) pass; blocks of 512 gained nothing.
MLP_BLOCK_TOKENS = 1024


class LayerDone(int):
    """What ``Transformer.forward_steps`` yields after each layer: the tokens that layer just
    ran (an ``int``: step drivers count it as that many token-layers of work done in place),
    and ``inner``: whether the step was that layer alone (not the first layer, which also
    embeds and plans, nor the last, which also computes logits), so its time measures a
    layer's cost."""

    inner: bool

    def __new__(cls, tokens: int, inner: bool = False) -> LayerDone:
        done = super().__new__(cls, tokens)
        done.inner = inner
        return done


class Linear(nn.Module):
    """y = x W^T + b with uninitialised storage: weights always come from a checkpoint,
    so the random init of ``nn.Linear`` (seconds for a whole model) is skipped.

    ``packed``: the weight packed for decode passes (``models.packed``), read instead of
    ``weight`` inside ``decoding()``; None reads ``weight`` everywhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedWeight | None = None

    def _packed_now(self) -> PackedWeight | None:
        return self.packed if self.packed is not None and is_decoding() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_now()
        return packed(x) if packed is not None else F.linear(x, self.weight, self.bias)

    def plus(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x) as one GEMM that accumulates into a copy of the residual."""
        packed = self._packed_now()
        if packed is not None:
            return packed(x).add_(residual)
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += self(x), in place (out must be a tensor the caller owns)."""
        packed = self._packed_now()
        if packed is not None:
            out.add_(packed(x))
            return
        out.addmm_(x, self.weight.t())
        if self.bias is not None:
            out.add_(self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * w, with the mean taken from one norm kernel: 2 passes
        # over x instead of F.rms_norm's 4 on CPU (2.6 vs 5.6 ms at 3072 x 576).
        inv = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
        return torch.mul(x, inv.add_(self.eps).rsqrt_()).mul_(self.weight)


class DecodeRows:
    """The caches of one native decode step, ready for every layer: row r appends one token
    at ``starts[r]`` of ``caches[r]``. Made once per step, so that what does not change from
    layer to layer (room for the new slot, the rows' first visible slots per window) is not
    redone per layer. ``native``: every cache is a plain ``KVCache`` (a ``ForkedCache`` reads
    its prompt from its parent: the per-op path); ``copies``: the step attends over the
    caches' float16 copies (all of them keep copies, ``KVCache.half_copies``)."""

    def __init__(self, caches: Sequence[KVCache], starts: Sequence[int]) -> None:
        self.caches, self.starts = list(caches), list(starts)
        self.native = all(type(cache) is KVCache for cache in self.caches)
        self.copies = all(cache.half_copies for cache in self.caches)  # the kernel takes copies for all rows or none
        self._firsts: dict[int | None, list[int]] = {}
        if self.native:
            for cache, start in zip(self.caches, self.starts):
                cache.reserve(start + 1)

    def firsts(self, window: int | None) -> list[int]:
        """Each row's first visible slot under a sliding ``window`` (None: all)."""
        if window not in self._firsts:
            self._firsts[window] = [first_visible(s, window) for s in self.starts]
        return self._firsts[window]

    def layer(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                         list[torch.Tensor], list[int]]:
        """``layer``'s K and V buffers per row and, with copies, the float16 copies and the
        slots each already holds (``KVCache.decode_half``); empty lists without."""
        keys = [cache.keys[layer] for cache in self.caches]
        values = [cache.values[layer] for cache in self.caches]
        if not self.copies:
            return keys, values, [], [], []
        halves = [cache.decode_half(layer, start) for cache, start in zip(self.caches, self.starts)]
        return keys, values, [x[0] for x in halves], [x[1] for x in halves], [x[2] for x in halves]

    def written(self, layer: int) -> None:
        """``layer``'s step wrote every row's slot to its copy too."""
        if self.copies:
            for cache, start in zip(self.caches, self.starts):
                cache.half_synced[layer] = start + 1

    def stacked(self, layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                                            list[torch.Tensor], list[int]]:
        """``layer``'s lists for layers 0..layers-1 end to end (layer-major, as ``decode_layers``
        takes them)."""
        parts = [self.layer(i) for i in range(layers)]
        return tuple([x for part in parts for x in part[j]] for j in range(5))  # type: ignore[return-value]


class DecoderLayer(nn.Module):
    """One pre-norm block. q/k/v and gate/up projections are fused into single matmuls.

    ``post_norm`` is the MLP's input norm. Optional, by config flag: ``q_norm``/``k_norm``
    (per head, before RoPE) and ``attn_out_norm``/``mlp_out_norm`` (on each branch's
    output before its residual add: Gemma's sandwich norms)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = cfg.layer_rope(index)
        self.window = cfg.layer_window(index)
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = Linear(d, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, d, bias=cfg.o_bias)
        self.gate_up = Linear(d, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, d, bias=cfg.mlp_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        if cfg.sandwich_norm:
            self.attn_out_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.mlp_out_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_mult = _query_multiplier(cfg)

    def _queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected queries (T, Hq*d) -> normed, rotated and pre-scaled (Hq, T, d)."""
        c = self.cfg
        q = q.view(-1, c.num_heads, c.head_dim).transpose(0, 1)  # (Hq, T, d)
        q = rope_lib.apply_rope(self.q_norm(q) if c.qk_norm else q, cos, sin, self.rope.interleaved)
        return q if self.q_mult is None else q.mul_(self.q_mult)

    def _keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected keys (T, Hkv*d) -> normed and rotated (Hkv, T, d)."""
        c = self.cfg
        k = k.view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)  # (Hkv, T, d)
        return rope_lib.apply_rope(self.k_norm(k) if c.qk_norm else k, cos, sin, self.rope.interleaved)

    def native_step(self) -> bool:
        """Whether this pass runs the layer as ``models.packed.native_layer_ops``: a decode pass
        reading int8 weights with the native kernels built (the same arithmetic as the ops
        below, up to rounding: ``tests/models/test_packed.py`` holds them together)."""
        packed = self.qkv._packed_now()
        return packed is not None and packed.kind == "int8" and packed.fused and native_layer_ops() is not None

    def native_weights(self) -> list[torch.Tensor | None]:
        """This layer's weights in the order ``decode_layer`` takes them (``LayerWeight`` in
        ``csrc/packed_int8.cpp``), made once per packing."""
        qkv, o, gate_up, down = self.qkv.packed, self.o.packed, self.gate_up.packed, self.down.packed
        made = getattr(self, "_native_weights", None)
        if made is None or made[0] is not qkv:
            c = self.cfg
            weights = [self.input_norm.weight, qkv.q, qkv.scale, qkv.rowsum, qkv.bias,
                       self.q_norm.weight if c.qk_norm else None, self.k_norm.weight if c.qk_norm else None,
                       o.q, o.scale, o.rowsum, o.bias, self.attn_out_norm.weight if c.sandwich_norm else None,
                       self.post_norm.weight, gate_up.q, gate_up.scale, gate_up.rowsum, gate_up.bias,
                       down.q, down.scale, down.rowsum, down.bias, self.mlp_out_norm.weight if c.sandwich_norm else None,
                       qkv.tiles, o.tiles, gate_up.tiles, down.tiles]
            made = self._native_weights = (qkv, weights)
        return made[1]

    def decode_step(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                    start: int) -> torch.Tensor | None:
        """``decode_rows`` for one decode row h (1, D) at position ``start`` of ``cache``; None
        where that does not apply (more than one row, or as ``decode_rows``)."""
        return self.decode_rows(h, cos, sin, DecodeRows([cache], [start]), layer) if h.shape[0] == 1 else None

    def decode_rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: DecodeRows,
                    layer: int) -> torch.Tensor | None:
        """The whole layer for decode rows h (R, D), row r one token at position ``rows.starts[r]``
        of ``rows.caches[r]``, its K/V written there, in one native call (``decode_layer``: the
        projections and MLP over all rows, every row's attention over the float16 copies of
        its cache, ``KVCache.decode_half``, unless a cache turned them off); None where that
        does not apply (not a native step, or a forked cache among them): the caller then
        runs project, attention and finish."""
        if not rows.native or not self.native_step():
            return None
        c = self.cfg
        keys, values, k_halves, v_halves, held = rows.layer(layer)
        out = native_layer_ops().layer(
            h, self.native_weights(), cos, sin, keys, values, k_halves, v_halves, held, rows.starts,
            rows.firsts(self.window), c.num_heads, c.num_kv_heads, c.head_dim, *self.native_settings())
        rows.written(layer)
        return out

    def native_settings(self) -> tuple[bool, float, float, bool]:
        """The native decode step's per-layer settings after the shapes: interleaved RoPE,
        the norms' eps, the queries' multiplier and whether the MLP's activation is GELU."""
        return (self.rope.interleaved, self.input_norm.eps, 1.0 if self.q_mult is None else self.q_mult,
                self.cfg.hidden_act == "gelu_tanh")

    def _native_project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, project = self.cfg, native_layer_ops().project
        qkv = self.qkv.packed
        return project(h, self.input_norm.weight, self.input_norm.eps, qkv.q, qkv.scale, qkv.rowsum, qkv.tiles, qkv.bias,
                       cos, sin,
                       c.num_heads, c.num_kv_heads, c.head_dim, self.rope.interleaved,
                       self.q_norm.weight if c.qk_norm else None, self.k_norm.weight if c.qk_norm else None,
                       1.0 if self.q_mult is None else self.q_mult)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream h (T, D) -> post-RoPE q (Hq, T, d), k (Hkv, T, d), v (Hkv, T, d)."""
        c = self.cfg
        if self.native_step():  # q and k normed, rotated and scaled there
            qkv = self._native_project(h, cos, sin)
            q, k, v = (part.view(-1, n, c.head_dim).transpose(0, 1) for part, n in zip(
                qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1), (c.num_heads, c.num_kv_heads, c.num_kv_heads)))
            return q, k, v
        qkv = self.qkv(self.input_norm(h))  # (T, Hq*d + 2*Hkv*d)
        q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        v = v.view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)  # a view: callers copy it into the cache
        if c.qk_norm or self.q_mult is not None:
            return self._queries(q, cos, sin), self._keys(k, cos, sin), v
        # q and k rotated by one call over all their heads (a decode step's ops are its cost)
        heads = qkv[:, : c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim).transpose(0, 1)
        qk = rope_lib.apply_rope(heads, cos, sin, self.rope.interleaved)  # (Hq + Hkv, T, d)
        return qk[: c.num_heads], qk[c.num_heads :], v

    def project_kv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: bool = True, normed: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Only post-RoPE k (Hkv, T, d; None unless ``keys``) and v (Hkv, T, d) of h (T, D):
        what a check layer compares with the cache, without the queries' projection.
        ``normed``: h is already the input norm's output."""
        c = self.cfg
        first = c.q_size if keys else c.q_size + c.kv_size  # rows of the fused q|k|v weight
        kv = self._linear_rows(h if normed else self.input_norm(h), first, self.qkv.weight.shape[0])
        v = kv[:, -c.kv_size :].view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
        if not keys:
            return None, v
        return self._keys(kv[:, : c.kv_size], cos, sin), v

    def project_known_kv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like ``project`` when only the tokens at ``kv_rows`` (indices into h) lack known
        K/V: q (Hq, T, d) for every token, k and v (Hkv, len(kv_rows), d) for those alone.
        Layer 0's K/V depend on nothing but the token and its position, so there the
        cached chunks' (re-rotated) K/V are the exact values and need no projection."""
        c = self.cfg
        x = self.input_norm(h)
        q = self._queries(self._linear_rows(x, 0, c.q_size), cos, sin)
        k, v = self.project_kv(x[kv_rows], cos[kv_rows], sin[kv_rows], normed=True)
        return q, k, v

    def _linear_rows(self, x: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """x through output rows first..end-1 of the fused q|k|v projection."""
        bias = None if self.qkv.bias is None else self.qkv.bias[first:end]
        return F.linear(x, self.qkv.weight[first:end], bias)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection and MLP, each with its residual. h, attn: (T, D), (T, Hq*d).

        The MLP runs over blocks of ``MLP_BLOCK_TOKENS`` rows: its (T, 2I) intermediate
        then stays small enough to be reused from cache (rows are independent, so this is
        exact)."""
        if self.native_step():
            o, gate_up, down = self.o.packed, self.gate_up.packed, self.down.packed
            return native_layer_ops().finish(
                h, attn, o.q, o.scale, o.rowsum, o.tiles, o.bias,
                self.attn_out_norm.weight if self.cfg.sandwich_norm else None, self.post_norm.weight, self.post_norm.eps,
                gate_up.q, gate_up.scale, gate_up.rowsum, gate_up.tiles, gate_up.bias,
                down.q, down.scale, down.rowsum, down.tiles, down.bias,
                self.mlp_out_norm.weight if self.cfg.sandwich_norm else None,
                self.cfg.hidden_act == "gelu_tanh")
        h = self.o.plus(h, attn) if not self.cfg.sandwich_norm else h + self.attn_out_norm(self.o(attn))
        if h.shape[0] <= MLP_BLOCK_TOKENS:
            self.add_mlp(h)
            return h
        for s in range(0, h.shape[0], MLP_BLOCK_TOKENS):
            self.add_mlp(h[s : s + MLP_BLOCK_TOKENS])
        return h

    def add_mlp(self, h: torch.Tensor) -> None:
        """h += gated MLP (SwiGLU, or GELU-tanh for Gemma) of the MLP input norm of h (T, D), in place."""
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)  # (T, I) views of a fresh tensor
        if self.cfg.hidden_act == "gelu_tanh":
            act = F.gelu(gate, approximate="tanh").mul_(up)
        else:
            act = F.silu(gate, inplace=True).mul_(up)
        if self.cfg.sandwich_norm:
            h.add_(self.mlp_out_norm(self.down(act)))
        else:
            self.down.add_into(h, act)


def _query_multiplier(cfg: ModelConfig) -> float | None:
    """What queries are multiplied by so that SDPA's 1/sqrt(head_dim) becomes the config's
    ``query_scale`` (None when they agree, as for every model but some Gemmas)."""
    if cfg.query_scale is None:
        return None
    mult = cfg.query_scale * math.sqrt(cfg.head_dim)
    return None if abs(mult - 1.0) < 1e-12 else mult


class Transformer(nn.Module):
    """Weights and per-layer steps. Parameter layout: see ``kvblend.models.weights``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # used as a lookup table
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decode_weights = "fp32"

    def pack_decode_weights(self, kind: str) -> None:
        """Give every linear layer but the embedding (a lookup table) a copy of its weight
        packed as ``kind`` ("int8" or "fp16", ``models.packed``) for decode passes, or drop
        the copies ("fp32": decode reads the fp32 weights, the reference); "auto" and the
        device/dtype check follow ``resolve_decode_weights``."""
        kind = resolve_decode_weights(kind, self.device, self.dtype)
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.embed_tokens:
                module.packed = None if kind == "fp32" else PackedWeight(module.weight, module.bias, kind)
        if kind == "int8":  # a decode step reads all of them: in huge pages, fewer TLB misses
            in_huge_pages([m.packed for m in self.modules() if isinstance(m, Linear) and m.packed is not None])
        self.decode_weights = kind

    def decode_weight_bytes(self) -> int:
        """Bytes of weight one decode step reads (every linear layer but the embedding)."""
        return sum(packed_bytes(m.weight, self.decode_weights) for m in self.modules()
                   if isinstance(m, Linear) and m is not self.embed_tokens)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def decode_layers(self, h: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      rows: DecodeRows) -> torch.Tensor | None:
        """Every layer's ``decode_rows`` over decode rows h (R, D) in one native call
        (``decode_layers``: a step pays the Python and the arguments' conversion around a call
        once, not once a layer); the last layer's h, or None where not every layer runs its
        step natively with the same settings (the caller then goes layer by layer)."""
        weights = self._native_stack() if rows.native else None
        return None if weights is None else self._run_stack(weights, h, tables, rows)

    def _run_stack(self, weights: list[torch.Tensor | None], h: torch.Tensor,
                   tables: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: DecodeRows) -> torch.Tensor:
        """``decode_layers``' native call, its applicability checked (``weights``: ``_native_stack``'s)."""
        first, c = self.layers[0], self.cfg
        keys, values, k_halves, v_halves, held = rows.stacked(len(self.layers))
        out = native_layer_ops().layers(
            h, weights, [t[0] for t in tables], [t[1] for t in tables], keys, values, k_halves, v_halves, held,
            rows.starts, [f for layer in self.layers for f in rows.firsts(layer.window)], c.num_heads,
            c.num_kv_heads, c.head_dim, *first.native_settings())
        for i in range(len(self.layers)):
            rows.written(i)
        return out

    def _native_stack(self) -> list[torch.Tensor | None] | None:
        """Every layer's ``native_weights`` end to end (remade when a layer's packing changes),
        or None unless every layer steps natively with the first layer's settings."""
        if not all(layer.native_step() for layer in self.layers):
            return None
        lists = [layer.native_weights() for layer in self.layers]
        made = getattr(self, "_native_stack_made", None)
        if made is None or any(a is not b for a, b in zip(made[0], lists)):
            settings = self.layers[0].native_settings()
            uniform = all(layer.native_settings() == settings for layer in self.layers)
            made = self._native_stack_made = (lists, [w for ws in lists for w in ws] if uniform else None)
        return made[1]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, D) residual stream (times ``embed_scale``, rounded to the
        model's dtype as Gemma does)."""
        h = F.embedding(ids, self.embed_tokens.weight)  # (T, D)
        if self.cfg.embed_scale == 1.0:
            return h
        return h.mul_(torch.tensor(self.cfg.embed_scale, dtype=self.dtype).item())

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the model's (global) RoPE for these positions. With per-layer RoPE
        (Gemma 3) use ``layer_rope_tables``."""
        return rope_lib.cos_sin(self.cfg.rope, positions, self.dtype)

    def layer_rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin for these positions per layer, each distinct RoPE computed once: layers
        sharing a RoPE config share the same tuple object."""
        tables: dict[rope_lib.RopeConfig, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self.layers:
            if layer.rope not in tables:
                tables[layer.rope] = rope_lib.cos_sin(layer.rope, positions, self.dtype)
        return [tables[layer.rope] for layer in self.layers]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(T, D) final-layer hidden states -> (T, V) logits (float32), soft-capped when
        the config says so."""
        out = self.lm_head(self.norm(h)).float()  # (T, V)
        cap = self.cfg.final_logit_softcap
        return out if cap is None else out.div_(cap).tanh_().mul_(cap)

    def new_cache(self, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def forward(self, ids: torch.Tensor, cache: KVCache, logits_for: str = "last") -> torch.Tensor:
        """Append ``ids`` (T,) after the cache's current contents and run every layer.

        Positions continue from ``cache.length``. The cache is extended in place.
        ``logits_for``: "last" -> (1, V), "all" -> (T, V), "none" -> empty tensor.
        """
        stepped = self._decode_stacked(ids, cache, logits_for)
        if stepped is not None:
            return stepped
        steps = self.forward_steps(ids, cache, logits_for)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    @torch.inference_mode()
    def _decode_stacked(self, ids: torch.Tensor, cache: KVCache, logits_for: str) -> torch.Tensor | None:
        """A one-token forward (a decode pass) with every layer in one native call
        (``decode_layers``), as ``generation.batch.forward_batch`` runs a batched step; None
        where that does not apply (more tokens, or not every layer steps natively): the
        layer-by-layer ``forward_steps`` then runs it. ``forward_steps`` itself stays layer by
        layer: its owner may run other work between two layers."""
        if not decode_pass([ids.shape[0]]) or type(cache) is not KVCache:
            return None
        with decoding(True):
            weights = self._native_stack()  # checked first: the fp32 and CUDA paths pay nothing more
            if weights is None:
                return None
            start = cache.length
            self._check_context(start + 1)
            tables = self.layer_rope_tables(torch.arange(start, start + 1, device=self.device))
            h = self._run_stack(weights, self.embed(ids), tables, DecodeRows([cache], [start]))
            cache.length = start + 1
            return self._select_logits(h, logits_for)

    @torch.inference_mode()
    def forward_steps(self, ids: torch.Tensor, cache: KVCache,
                      logits_for: str = "last") -> Generator[LayerDone, None, torch.Tensor]:
        """``forward`` as a generator that yields ``LayerDone(T)`` after each layer and returns
        its logits, so that the model's owner can run other work (a decode step) between two
        layers of one large chunk. Layer i's keys and values are in the cache once it yields;
        ``cache.length`` moves only at the end, so nothing else may write this cache between.
        A one-token forward is a decode pass (``models.packed.decode_pass``): its layers read
        the packed decode weights, each layer inside its own ``decoding()`` so that the flag
        never stays set across a yield into the owner's other work."""
        start, n = cache.length, ids.shape[0]
        decode = decode_pass([n])
        self._check_context(start + n)
        positions = torch.arange(start, start + n, device=self.device)
        tables = self.layer_rope_tables(positions)
        plans: dict[int | None, AttentionPlan] = {}  # one per distinct window
        h = self.embed(ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            with decoding(decode):
                h = self._layer(i, layer, h, tables[i], cache, start, positions, plans, logits_for)
            if i < last:
                yield LayerDone(n, inner=i > 0)
        cache.length = start + n
        with decoding(decode):
            out = self._select_logits(h, logits_for)
        yield LayerDone(n)
        return out

    def _layer(self, i: int, layer: DecoderLayer, h: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor],
               cache: KVCache, start: int, positions: torch.Tensor, plans: dict[int | None, AttentionPlan],
               logits_for: str) -> torch.Tensor:
        """Layer i of ``forward_steps`` over h (T, D): its K/V written at ``start``; returns the next h."""
        n = positions.shape[0]
        stepped = layer.decode_step(h, *table, cache, i, start)
        if stepped is not None:
            return stepped
        q, k, v = layer.project(h, *table)
        parts = cache.write_parts(i, start, k, v)
        if len(parts) > 1:  # a forked cache (another choice's decode): its prompt is its parent's
            return layer.finish(h, attend_parts(q, parts, start, layer.window))
        keys, values = parts[0]
        if i == len(self.layers) - 1 and logits_for == "last" and n > 1 and self.sees_all(start + n):
            # Only the last token's output is read: its query sees every key.
            return layer.finish(h[-1:], attend(q[:, -1:], keys, values))
        if layer.window not in plans:
            plans[layer.window] = plan_attention(positions, start + n, layer.window, self.dtype,
                                                 heads_per_kv=self.cfg.heads_per_kv)
        return layer.finish(h, attend_planned(q, keys, values, plans[layer.window]))

    def sees_all(self, n_keys: int) -> bool:
        """Whether the last layer's query at position n_keys - 1 sees every key (no sliding
        window cuts it)."""
        window = self.layers[-1].window
        return window is None or n_keys <= window

    def _select_logits(self, h: torch.Tensor, which: str) -> torch.Tensor:
        if which == "last":
            return self.logits(h[-1:])
        if which == "all":
            return self.logits(h)
        return h.new_empty(0)

    def _check_context(self, length: int) -> None:
        limit = self.cfg.context_length
        if length > limit:
            raise ContextLengthError(f"{length} tokens exceed the model's context of {limit} tokens")
