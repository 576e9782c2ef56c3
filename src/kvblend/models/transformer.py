"""Our decoder-only transformer (Llama family, Qwen2), written as explicit per-layer steps.

Each layer exposes the steps a caller needs to run it on any subset of tokens, at any
positions, against any key/value set:

    q, k, v = layer.project(h, cos, sin)       # norm + q/k/v projection + RoPE
    a = attend(q, keys, values, mask)          # attention against explicit K/V
    h = layer.finish(h, a)                     # output projection + residual + MLP

The model never owns a request's KV cache: ``forward`` writes into a ``KVCache`` the
caller passes in. Only the logits the caller asks for are computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvblend import rope as rope_lib
from kvblend.errors import ContextLengthError
from kvblend.models.attention import attend, attend_planned, plan_attention
from kvblend.models.config import ModelConfig
from kvblend.models.kv_cache import KVCache


# Measured on SmolLM2 at 3072 tokens (2-core CPU): the MLP over blocks of 1024 rows took
# 0.92-0.96x the time of one (3072, 2I) pass; blocks of 512 gained nothing.
MLP_BLOCK_TOKENS = 1024


class Linear(nn.Module):
    """y = x W^T + b with uninitialised storage: weights always come from a checkpoint,
    so the random init of ``nn.Linear`` (seconds for a whole model) is skipped."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def plus(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x) as one GEMM that accumulates into a copy of the residual."""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)

    def add_into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += self(x), in place (out must be a tensor the caller owns)."""
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


class DecoderLayer(nn.Module):
    """One pre-norm block. q/k/v and gate/up projections are fused into single matmuls."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = Linear(d, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o = Linear(cfg.q_size, d, bias=cfg.o_bias)
        self.gate_up = Linear(d, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, d, bias=cfg.mlp_bias)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream h (T, D) -> post-RoPE q (Hq, T, d), k (Hkv, T, d), v (Hkv, T, d)."""
        c = self.cfg
        qkv = self.qkv(self.input_norm(h))  # (T, Hq*d + 2*Hkv*d)
        q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim).transpose(0, 1)  # (Hq, T, d)
        k = k.view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)  # (Hkv, T, d)
        v = v.view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)  # a view: callers copy it into the cache
        inter = c.rope.interleaved
        return rope_lib.apply_rope(q, cos, sin, inter), rope_lib.apply_rope(k, cos, sin, inter), v

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
        k = kv[:, : c.kv_size].view(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return rope_lib.apply_rope(k, cos, sin, c.rope.interleaved), v

    def project_known_kv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like ``project`` when only the tokens at ``kv_rows`` (indices into h) lack known
        K/V: q (Hq, T, d) for every token, k and v (Hkv, len(kv_rows), d) for those alone.
        Layer 0's K/V depend on nothing but the token and its position, so there the
        cached chunks' (re-rotated) K/V are the exact values and need no projection."""
        c = self.cfg
        x = self.input_norm(h)
        q = self._linear_rows(x, 0, c.q_size).view(-1, c.num_heads, c.head_dim).transpose(0, 1)
        k, v = self.project_kv(x[kv_rows], cos[kv_rows], sin[kv_rows], normed=True)
        return rope_lib.apply_rope(q, cos, sin, c.rope.interleaved), k, v

    def _linear_rows(self, x: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """x through output rows first..end-1 of the fused q|k|v projection."""
        bias = None if self.qkv.bias is None else self.qkv.bias[first:end]
        return F.linear(x, self.qkv.weight[first:end], bias)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection and MLP, each with its residual. h, attn: (T, D), (T, Hq*d).

        The MLP runs over blocks of ``MLP_BLOCK_TOKENS`` rows: its (T, 2I) intermediate
        then stays small enough to be reused from cache (rows are independent, so this is
        exact)."""
        h = self.o.plus(h, attn)
        for s in range(0, h.shape[0], MLP_BLOCK_TOKENS):
            self.add_mlp(h[s : s + MLP_BLOCK_TOKENS])
        return h

    def add_mlp(self, h: torch.Tensor) -> None:
        """h += SwiGLU MLP of the post-attention norm of h (T, D), in place."""
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)  # (T, I) views of a fresh tensor
        self.down.add_into(h, F.silu(gate, inplace=True).mul_(up))


class Transformer(nn.Module):
    """Weights and per-layer steps. Parameter layout: see ``kvblend.models.weights``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # used as a lookup table
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, D) residual stream."""
        return F.embedding(ids, self.embed_tokens.weight)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for these positions, computed once per forward and shared by all layers."""
        return rope_lib.cos_sin(self.cfg.rope, positions, self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(T, D) final-layer hidden states -> (T, V) logits (float32)."""
        return self.lm_head(self.norm(h)).float()

    def new_cache(self, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, logits_for: str = "last") -> torch.Tensor:
        """Append ``ids`` (T,) after the cache's current contents and run every layer.

        Positions continue from ``cache.length``. The cache is extended in place.
        ``logits_for``: "last" -> (1, V), "all" -> (T, V), "none" -> empty tensor.
        """
        start, n = cache.length, ids.shape[0]
        self._check_context(start + n)
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self.rope_tables(positions)
        plan = plan_attention(positions, start + n, self.cfg.sliding_window, self.dtype,
                              heads_per_kv=self.cfg.heads_per_kv)
        h = self.embed(ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = layer.project(h, cos, sin)
            keys, values = cache.write(i, start, k, v)
            if i == last and logits_for == "last" and n > 1 and self.sees_all(start + n):
                # Only the last token's output is read: its query sees every key.
                h = layer.finish(h[-1:], attend(q[:, -1:], keys, values))
            else:
                h = layer.finish(h, attend_planned(q, keys, values, plan))
        cache.length = start + n
        return self._select_logits(h, logits_for)

    def sees_all(self, n_keys: int) -> bool:
        """Whether the last of ``n_keys`` positions attends to every key (no sliding window cuts it)."""
        return self.cfg.sliding_window is None or n_keys <= self.cfg.sliding_window

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
