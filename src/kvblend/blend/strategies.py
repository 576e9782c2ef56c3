"""Selection and correction strategies beyond the paper's, composed around ``fuse``.

* ``question`` (ProphetKV, FusionRAG): a first pass runs only the tokens without cached
  KV (the question / suffix) through every layer over the re-rotated reused cache — that
  is exactly full KV reuse — and scores each document token by the attention the tokens
  after the last document pay it, summed over heads, those query tokens and layers (each
  layer's weights sum to heads x queries, so layers weigh equally; prefix tokens, the
  attention sink among them, are not candidates and so are never ranked). The top tokens
  are then recomputed at every layer from layer 0 in a second pass, in the first pass's
  cache (its chunks are already re-rotated). No layer runs in full. A document that
  missed the store is computed once, in the question pass; the second pass blends those
  K/V like a chunk's (``FusionPlan.held``), or, for one before every stored chunk, keeps
  them as final (``FusionPlan.exact_upto``: that pass computed them exactly).
* ``question`` with ``vdev`` (a hybrid): the question pass's scores and CacheBlend's
  layer-1 V deviation, each turned into ranks within its document (scaled to [0, 1]), are
  averaged with weight ``vdev`` on the deviation (``hybrid_scores``). The deviation costs
  layer 0 over the document tokens and their layer-1 V projection, over the question
  pass's cache (``vdev_scores``). Budgets still split by question-attention mass.
* ``oracle`` (eval only): the KV of a full prefill is computed, and the tokens whose
  reused K/V deviate most from it, summed over layers, are recomputed: a ceiling for any
  selection of that size.
* ``deviation`` with ``budget``/``sinks``/``shift``: the paper's check-layer selection
  with the choice below swapped in (``FusionPlan.pick``) and the correction hooked in.

``choose`` turns scores into a kept set: the first ``sinks`` tokens of every document
first, then by score, globally or within per-document budgets (``allocate``).
``ShiftCorrection`` moves each document's non-recomputed K/V by the mean fresh - stale
residual of a uniform sample of its tokens (``shift_samples``, recomputed within the
budget), at every layer, before attention reads them; tested (``BlendConfig.shift_test``),
only where that mean lowers the residual of a sampled token held out of it, and with
``BlendConfig.shift_question`` per KV head only where it does not worsen the question rows'
held-out attention output. ``blend_risk``
turns what the shift measured into the request's risk (``RequestStats.risk``); a
question-selected blend without the shift takes ``moved_risk`` instead: how little the
recompute moved the answer from the question pass's (full reuse's).

Invariants (tests/engine/test_strategies.py): ratio 1 is a full prefill, ratio 0 without
``shift`` is full reuse, and a document at its own position stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch

from kvblend import rope as rope_lib
from kvblend.blend.config import BlendConfig
from kvblend.blend.fusion import FusionOutput, FusionPlan, _candidate_mask, fuse, fuse_steps
from kvblend.generation.chunked import run_steps
from kvblend.blend.select import SelectionDetail, SelectionStats, deviation, kept_count, select_tokens, selection_stats
from kvblend.errors import InvalidRequestError
from kvblend.metrics import kl_divergence
from kvblend.models.attention import attend_planned, causal_mask, plan_attention
from kvblend.models.kv_cache import KVCache
from kvblend.models.transformer import Transformer

Span = tuple[int, int]  # [start, end) of one placed document


def spans_of(plan: FusionPlan) -> list[Span]:
    return [(p.start, p.start + p.chunk.n_tokens) for p in plan.placed]


def allocate(total: int, sizes: Sequence[int], weights: Sequence[float], floor: float) -> list[int]:
    """Split ``total`` kept tokens among documents of ``sizes`` tokens.

    Each document first gets ``floor`` x its length-proportional share (rounded down, at
    most its size); the rest goes in proportion to ``weights`` (uniform where all are 0),
    largest remainder first, never past a document's size. The result sums to
    ``min(total, sum(sizes))``."""
    n_all = sum(sizes)
    total = max(0, min(total, n_all))
    if not sizes or total == 0:
        return [0] * len(sizes)
    out = [min(n, int(floor * total * n / n_all)) for n in sizes]
    left = total - sum(out)
    while left > 0:
        open_ = [i for i, n in enumerate(sizes) if out[i] < n]
        w = [max(float(weights[i]), 0.0) for i in open_]
        if sum(w) <= 0 or not all(map(math.isfinite, w)):
            w = [1.0] * len(open_)
        shares = [left * x / sum(w) for x in w]
        given = [min(int(s), sizes[i] - out[i]) for s, i in zip(shares, open_)]
        if sum(given) == 0:  # every share below one token: one to the largest remainder
            j = max(range(len(open_)), key=lambda m: (shares[m], -m))
            given[j] = 1
        for g, i in zip(given, open_):
            out[i] += g
        left -= sum(given)
    return out


def covering_count(scores: torch.Tensor, share: float) -> int:
    """The fewest of the candidates whose ``scores`` (T,) sum to at least ``share`` of all
    of theirs (negative scores count 0): 0 for share 0 or no mass, T for share 1."""
    s = scores.float().clamp_min(0).sort(descending=True).values
    total = float(s.sum())
    if share <= 0 or total <= 0:
        return 0
    below = s.cumsum(0) < share * total * (1 - 1e-6)  # (T,) prefixes still short of the share
    return min(int(below.sum()) + 1, s.numel())


def shift_samples(spans: Sequence[Span], n: int, keep: int, n_cand: int, stride: int,
                  device: torch.device) -> torch.Tensor:
    """(N,) bool: the uniform sample on which ``ShiftCorrection`` estimates each document's
    residual — every s-th token of each document from s // 2, s = max(``stride``,
    2 x ``n_cand`` / ``keep``), so that it takes at most about half of the ``keep`` tokens."""
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if keep <= 0:
        return mask
    s = max(stride, math.ceil(2 * n_cand / keep))
    for a, b in spans:
        mask[a + s // 2 : b : s] = True
    return mask


def choose(scores: torch.Tensor, positions: torch.Tensor, keep: int, spans: Sequence[Span], cfg: BlendConfig,
           mass: torch.Tensor | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (ascending) of the ``keep`` candidates to recompute.

    scores, positions: (T,) per candidate. The first ``cfg.sinks`` tokens of each document
    rank above everything, then the positions ``forced`` (N,) marks (the shift's sample);
    with ``cfg.budget`` each document keeps its ``allocate`` share
    by the mass of ``mass`` (T,; default the scores), else one global top-k. Ties keep the
    earlier token."""
    ranked = scores.float().clone()
    if forced is not None:
        ranked[forced[positions]] = torch.finfo(torch.float32).max
    doc = torch.full_like(positions, -1)
    for i, (a, b) in enumerate(spans):
        inside = (positions >= a) & (positions < b)
        doc[inside] = i
        if cfg.sinks:
            ranked[inside & (positions < a + cfg.sinks)] = float("inf")
    if not cfg.budget:
        return select_tokens(ranked, keep)
    groups = [(doc == i).nonzero().squeeze(1) for i in range(len(spans))]
    outside = (doc < 0).nonzero().squeeze(1)
    if outside.numel():
        groups.append(outside)
    weigh = scores if mass is None else mass
    masses = [float(weigh[g].float().clamp_min(0).sum()) for g in groups]
    budgets = allocate(keep, [int(g.numel()) for g in groups], masses, cfg.budget_floor)
    picked = [g[select_tokens(ranked[g], b)] for g, b in zip(groups, budgets)]
    return torch.cat(picked).sort().values if picked else select_tokens(ranked, 0)


class ShiftCorrection:
    """``FusionPlan.correct``: before fresh K/V of the written tokens replace the cache,
    every document's tokens that are not written are moved by the mean fresh - stale
    residual of its written ones (V as is, K un-rotated to the pre-RoPE frame, averaged,
    and rotated to each moved token's position). With ``samples`` only the written tokens it
    marks are averaged (a uniform sample: see ``shift_samples``). A document with no such
    token stays.

    All documents are corrected at once (a mean per document by ``index_add_``); which
    rows are written and moved is worked out once per ``written`` tensor (fusion passes
    the same one at every layer of a pass) and the RoPE rows once per table."""

    def __init__(self, spans: Sequence[Span], tables: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 interleaved: bool, samples: torch.Tensor | None = None, tested: bool = False,
                 question_from: int | None = None) -> None:
        self.spans, self.tables, self.interleaved = list(spans), list(tables), interleaved  # cos/sin per layer
        self.samples = samples  # (N,) bool: only these written tokens' residuals count (None: all)
        self.tested = tested  # shift a (document, KV head, K|V) only where its held-out test says it helps
        # the first position of the question rows: with it (and their queries), each KV head's K
        # and V shifts are also tested on what those rows read (``_question_test``)
        self.question_from = question_from
        self.max_elements = 1 << 24  # query rows x keys x KV heads per block of the question test
        # per layer where the question test ran: (Hkv,) its held-out error of the question rows'
        # attention output unshifted and with the chosen shift
        self.attn_errors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._written: torch.Tensor | None = None
        self._rows: _ShiftRows | None = None
        self._ropes: dict[int, tuple[torch.Tensor, ...]] = {}
        # per layer: (n_docs,) mean squared residual of a sampled token before and after the shift
        # (after: leave-one-out, as a token the mean was not estimated on), and which document each is
        self.errors: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []

    def _rows_for(self, written: torch.Tensor) -> _ShiftRows | None:
        if written is not self._written:
            self._written, self._rows, self._ropes = written, _shift_rows(self.spans, written, self.samples), {}
        return self._rows

    def __call__(self, cache: KVCache, layer: int, written: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor | None = None) -> None:
        """q: (Hq, W, d) post-RoPE queries of the ``written`` rows (the question test reads
        those at ``question_from`` and after; None: no question test)."""
        r = self._rows_for(written)
        if r is None:
            return
        keys, values = cache.keys[layer], cache.values[layer]
        table = self.tables[layer]  # the layer's own RoPE (Gemma 3: local or global)
        if id(table) not in self._ropes:
            cos, sin = table
            self._ropes[id(table)] = (cos[r.pos].float(), -sin[r.pos].float(), cos[r.moved].float(),
                                      sin[r.moved].float())
        cos_w, neg_sin_w, cos_m, sin_m = self._ropes[id(table)]
        hkv, d = keys.shape[0], keys.shape[2]
        dv = (v[:, r.rows] - values[:, r.pos]).float()  # (Hkv, m, d)
        dk = rope_lib.apply_rope((k[:, r.rows] - keys[:, r.pos]).float(), cos_w, neg_sin_w, self.interleaved)
        mean_v = dv.new_zeros(hkv, r.n_docs, d).index_add_(1, r.doc_of_row, dv).div_(r.counts)  # (Hkv, D, d)
        mean_k = dk.new_zeros(hkv, r.n_docs, d).index_add_(1, r.doc_of_row, dk).div_(r.counts)  # pre-RoPE
        mean_k, mean_v = self._test(r, dk, mean_k, dv, mean_v)
        if self.question_from is not None and q is not None:
            keep_k, keep_v = self._question_test(cache, layer, written, k, v, q, r, (dk, mean_k), (dv, mean_v))
            mean_k.mul_(keep_k[:, None, None])
            mean_v.mul_(keep_v[:, None, None])
        shift_k = rope_lib.apply_rope(mean_k[:, r.doc_of_moved], cos_m, sin_m, self.interleaved)  # (Hkv, o, d)
        keys.index_add_(1, r.moved, shift_k.to(keys.dtype))
        values.index_add_(1, r.moved, mean_v[:, r.doc_of_moved].to(values.dtype))


    def _test(self, r: _ShiftRows, dk: torch.Tensor, mean_k: torch.Tensor, dv: torch.Tensor,
              mean_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The means to shift by, each (Hkv, D, d): with ``tested``, zero where moving by the
        mean would not lower the squared residual of a sampled token left out of the mean
        (per document, KV head, K and V). Records the residual before and after (``errors``).

        Leaving token i out of an n-token mean m gives r_i - m_-i = n / (n - 1) (r_i - m), so
        the held-out error is (n / (n - 1))^2 x the within-document spread, against the
        spread plus n |m|^2 unshifted: a test on tokens the mean did not see, in closed form.
        A document with one sampled token cannot be tested, and is not shifted."""
        n = r.counts[:, 0]  # (D,)
        errs = []
        for delta, mean in ((dk, mean_k), (dv, mean_v)):
            total = delta.new_zeros(mean.shape[:2]).index_add_(1, r.doc_of_row, delta.pow(2).sum(-1))  # (Hkv, D)
            spread = (total - n * mean.pow(2).sum(-1)).clamp_min(0)
            held_out = spread * (n / (n - 1).clamp_min(1)).pow(2)
            helps = (held_out < total) & (n > 1)
            after = torch.where(helps, held_out, total) if self.tested else held_out
            errs.append((total.sum(0), after.sum(0)))
            if self.tested:
                mean.mul_(helps[..., None])
        self.errors.append(((errs[0][0] + errs[1][0]) / n, (errs[0][1] + errs[1][1]) / n, r.doc_ids))
        return mean_k, mean_v


    def _question_test(self, cache: KVCache, layer: int, written: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q: torch.Tensor, r: _ShiftRows, ks: tuple[torch.Tensor, torch.Tensor],
                       vs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Hkv,) bool each: whether K, and V, of each KV head are shifted at this layer, judged
        on the question rows' attention output (``BlendConfig.shift_question``, ``+shiftq``).

        The K/V error a mean removes is not what the answer reads: a document's K moved by one
        vector moves all its attention logits together, so the same mean that brings its keys
        nearer the fresh ones can shift attention mass between documents (Qwen2.5 musique_dev-62:
        the moved tokens' K error falls at every layer, the question's attention output error
        against full prefill's rises 2.4x at layer 9 head 1). So each head's four choices (no
        shift, K, V, both; the means as the per-document test left them) are scored on the
        question rows (queries at ``question_from`` and after, every query head sharing the KV
        head) by the squared difference of their attention output from the one where the
        sampled tokens have their fresh K/V. The sampled tokens stand in for their documents'
        moved tokens (those left out, each sampled token's logit raised by log(tokens it stands
        for)), and a sampled token is moved by the mean of its document's other sampled tokens
        (held out, as in ``_test``). Keys elsewhere keep their cached or fresh K/V. The shift
        (both) stays unless it scores worse than no shift; then the least of no shift, K alone
        and V alone (no shift on a tie). Sliding windows are not applied (every question row
        reads every document). Costs the question rows' attention over the tokens not moved,
        once per layer, in float32.

        ks, vs: (residuals (Hkv, m, d), means (Hkv, D, d)) of K (pre-RoPE) and V."""
        hkv = k.shape[0]
        rows_q = (written >= self.question_from).nonzero().squeeze(1)
        if rows_q.numel() == 0:  # nothing reads the documents here: the K/V test's shift stands
            every = torch.ones(hkv, dtype=torch.bool, device=k.device)
            return every, every
        n = self.tables[layer][0].shape[0]
        # the keys the question reads, the moved ones left out: the rest as cached, the written ones fresh
        static = torch.ones(n, dtype=torch.bool, device=k.device)
        static[written], static[r.moved] = False, False
        static_pos = static.nonzero().squeeze(1)
        key_pos = torch.cat((static_pos, written))  # (S + W,)
        keys = torch.cat((cache.keys[layer][:, static_pos], k), dim=1).float()  # (Hkv, S + W, d)
        values = torch.cat((cache.values[layer][:, static_pos], v), dim=1).float()
        stale_k, stale_v = cache.keys[layer][:, r.pos].float(), cache.values[layer][:, r.pos].float()  # (Hkv, m, d)
        cols = static_pos.numel() + r.rows  # (m,) the sampled tokens' columns
        d, hq = keys.shape[2], q.shape[0]
        qq = q[:, rows_q].float().reshape(hkv, hq // hkv * rows_q.numel(), d)  # (Hkv, R, d)
        pos_q = written[rows_q].repeat(hq // hkv)  # (R,) each row's position
        moved = torch.zeros(r.n_docs, device=k.device).index_add_(0, r.doc_of_moved,
                                                                 torch.ones_like(r.moved, dtype=torch.float32))
        weight = ((r.counts[:, 0] + moved) / r.counts[:, 0]).log()[r.doc_of_row]  # (m,)
        cnt = r.counts[r.doc_of_row]  # (m, 1)
        # the held-out shift of each sampled token: its document's (tested) mean without it
        loo = [(mean[:, r.doc_of_row] * cnt - res) / (cnt - 1).clamp_min(1)
               * (mean[:, r.doc_of_row] != 0).any(-1, keepdim=True) for res, mean in (ks, vs)]
        cos, sin = self.tables[layer]
        sampled_k = (stale_k, stale_k + rope_lib.apply_rope(loo[0], cos[r.pos].float(), sin[r.pos].float(),
                                                            self.interleaved))
        sampled_v = (stale_v, stale_v + loo[1])
        step = max(1, self.max_elements // (hkv * key_pos.numel()))
        errs = sum(_attention_errors(qq[:, i : i + step], pos_q[i : i + step], keys, values, key_pos, cols, weight,
                                     sampled_k, sampled_v) for i in range(0, qq.shape[1], step))
        self.last_errors = errs  # (4, Hkv): for probes
        # the shift stays unless it raises the error; then the least of no shift, K alone, V alone
        best = torch.where(errs[3] <= errs[0], 3, errs[:3].argmin(0))  # (Hkv,)
        self.attn_errors.append((errs[0], errs.gather(0, best[None])[0]))
        return (best == 1) | (best == 3), (best == 2) | (best == 3)


def _attention_errors(qq: torch.Tensor, pos_q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      key_pos: torch.Tensor, cols: torch.Tensor, weight: torch.Tensor,
                      sampled_k: tuple[torch.Tensor, torch.Tensor], sampled_v: tuple[torch.Tensor, torch.Tensor],
                      ) -> torch.Tensor:
    """(4, Hkv): for query rows qq (Hkv, R, d) at positions pos_q (R,), the squared error of
    their attention output over ``keys``/``values`` (Hkv, S, d, at positions ``key_pos`` (S,);
    the sampled tokens, columns ``cols`` (m,), fresh there, each of their logits + ``weight``
    (m,)) when the sampled tokens' K/V are instead (stale, stale) / (shifted K, stale V) /
    (stale K, shifted V) / (shifted, shifted): ``sampled_k``/``sampled_v`` = (stale, shifted),
    each (Hkv, m, d)."""
    d = keys.shape[2]
    scale = 1.0 / math.sqrt(d)
    logits = torch.bmm(qq, keys.transpose(1, 2)).mul_(scale)  # (Hkv, R, S)
    future = key_pos[None, :] > pos_q[:, None]  # (R, S)
    logits.masked_fill_(future, float("-inf"))
    logits[:, :, cols] += weight
    s_logits = [torch.bmm(qq, x.transpose(1, 2)).mul_(scale).add_(weight).masked_fill_(future[:, cols], float("-inf"))
                for x in sampled_k]  # (Hkv, R, m): stale, shifted
    top = torch.maximum(logits.amax(-1, keepdim=True), torch.maximum(*s_logits).amax(-1, keepdim=True))
    e_all = (logits - top).exp_()
    num, z = torch.bmm(e_all, values), e_all.sum(-1, keepdim=True)
    target = num / z  # (Hkv, R, d)
    e_fresh = e_all[:, :, cols]  # (Hkv, R, m): take the fresh sampled tokens out again for the rest
    rest_num, rest_z = num - torch.bmm(e_fresh, values[:, cols]), z - e_fresh.sum(-1, keepdim=True)
    errs = []
    for shift_k, shift_v in ((0, 0), (1, 0), (0, 1), (1, 1)):
        e_s = (s_logits[shift_k] - top).exp_()
        out = (rest_num + torch.bmm(e_s, sampled_v[shift_v])) / (rest_z + e_s.sum(-1, keepdim=True))
        errs.append((out - target).pow(2).sum(dim=(1, 2)))
    return torch.stack(errs)


class _ShiftRows(NamedTuple):
    rows: torch.Tensor  # (m,) indices into ``written`` of written tokens in corrected documents
    pos: torch.Tensor  # (m,) their positions
    doc_of_row: torch.Tensor  # (m,) their corrected document, 0..n_docs-1
    counts: torch.Tensor  # (n_docs, 1) written tokens per corrected document
    moved: torch.Tensor  # (o,) positions of the corrected documents' tokens not written
    doc_of_moved: torch.Tensor  # (o,)
    n_docs: int
    doc_ids: list[int]  # index into ``spans`` of each corrected document


def _shift_rows(spans: Sequence[Span], written: torch.Tensor, samples: torch.Tensor | None) -> _ShiftRows | None:
    """Which rows the shift reads and moves: documents with some but not all tokens
    written (and, with ``samples``, some sampled token written) move their tokens not
    written by the mean residual of their written sampled ones; None when there is none."""
    rows, docs, moved, doc_of_moved, counts, ids = [], [], [], [], [], []
    for j, (a, b) in enumerate(spans):
        inside = ((written >= a) & (written < b)).nonzero().squeeze(1)
        if inside.numel() == 0 or inside.numel() == b - a:
            continue
        others = torch.ones(b - a, dtype=torch.bool, device=written.device)
        others[written[inside] - a] = False
        others = others.nonzero().squeeze(1) + a
        if samples is not None:
            inside = inside[samples[written[inside]]]
            if inside.numel() == 0:
                continue
        i = len(counts)
        ids.append(j)
        rows.append(inside)
        docs.append(torch.full_like(inside, i))
        moved.append(others)
        doc_of_moved.append(torch.full_like(others, i))
        counts.append(inside.numel())
    if not counts:
        return None
    rows_t = torch.cat(rows)
    return _ShiftRows(rows_t, written[rows_t], torch.cat(docs),
                      torch.tensor(counts, dtype=torch.float32, device=written.device)[:, None],
                      torch.cat(moved), torch.cat(doc_of_moved), len(counts), ids)


class QuestionScores:
    """``FusionPlan.observe``: accumulates, per key position, the softmax attention weight
    that queries at ``first_row`` and after (the question / suffix) pay it, summed over
    heads, queries and layers.

    When every active query is such a query (the question pass), those weights are the
    layer's attention: it returns the attention output (weights @ V) for fusion to use
    instead of computing the same attention again. Query rows go in blocks of at most
    ``max_elements`` weights, so a long question never materialises heads x queries x N
    at once."""

    def __init__(self, n: int, first_row: int, windows: Sequence[int | None], device: torch.device,
                 max_elements: int = 1 << 24) -> None:
        self.total = torch.zeros(n, dtype=torch.float32, device=device)  # (N,)
        self.first_row, self.windows = first_row, list(windows)  # sliding window per layer
        self.max_elements = max_elements

    def __call__(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor | None:
        rows = (positions >= self.first_row).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        every_row = rows.numel() == positions.numel()
        if not every_row:
            q, positions = q[:, rows], positions[rows]
        (hq, t, d), n = q.shape, keys.shape[1]
        step = max(1, self.max_elements // (hq * n))
        parts = [self._block(layer, q[:, i : i + step], keys, values, positions[i : i + step], every_row)
                 for i in range(0, t, step)]
        if not every_row:
            return None
        return torch.cat(parts).to(q.dtype) if len(parts) > 1 else parts[0].to(q.dtype)  # (Tq, Hq*d)

    def _block(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, attend: bool) -> torch.Tensor | None:
        """Adds the weights of query rows q (Hq, Tb, d) at ``positions`` (ascending); their
        attention output (Tb, Hq*d) in float32 when ``attend``."""
        (hkv, n, d), (hq, t, _) = keys.shape, q.shape
        # the query heads sharing a KV head stacked along the rows: keys are never copied per head
        qq = q.float().reshape(hkv, hq // hkv * t, d)  # (Hkv, hpk*Tb, d)
        logits = torch.bmm(qq, keys.float().transpose(1, 2)).div_(math.sqrt(d))  # (Hkv, hpk*Tb, N)
        window = self.windows[layer]
        # keys up to the first query are seen by every query unless a window cuts them: mask the rest only
        start = int(positions[0]) + 1 if window is None or int(positions[-1]) < window else 0
        if start < n:
            allowed = causal_mask(positions, torch.arange(start, n, device=q.device), window)  # (Tb, N - start)
            logits[:, :, start:].masked_fill_(~allowed.repeat(hq // hkv, 1), float("-inf"))
        weights = logits.softmax(dim=-1)
        self.total[:n] += weights.sum(dim=(0, 1))
        if not attend:
            return None
        out = torch.bmm(weights, values.float())  # (Hkv, hpk*Tb, d)
        return out.view(hq, t, d).transpose(0, 1).reshape(t, hq * d)


def _base(plan: FusionPlan) -> FusionPlan:
    return replace(plan, strategy=None, recompute=None, pick=None, observe=None, correct=None, reuse_cache=None,
                   held=None, exact_upto=0)


def question_scores(model: Transformer, plan: FusionPlan) -> tuple[torch.Tensor, FusionOutput]:
    """``question_scores_steps`` run to its end here."""
    return run_steps(question_scores_steps(model, plan), model)


def question_scores_steps(model: Transformer, plan: FusionPlan) -> Generator[int, None, tuple[torch.Tensor, FusionOutput]]:
    """(N,) attention-mass scores from a reuse pass, and that pass's output (full reuse);
    a step generator. The scoring queries are the tokens after the last document (the
    question / suffix)."""
    n = plan.ids.shape[0]
    first_row = max((b for _, b in document_spans(plan)), default=n)
    scorer = QuestionScores(n, first_row, [layer.window for layer in model.layers], model.device)
    out = yield from fuse_steps(model, replace(_base(plan), select_from_start=True, observe=scorer))
    return scorer.total, out


def document_spans(plan: FusionPlan) -> list[Span]:
    """Every document's span: ``plan.doc_spans`` when the caller gave them, else the placed chunks'."""
    return list(plan.doc_spans) or spans_of(plan)


def missed_spans(plan: FusionPlan) -> list[Span]:
    """The spans of ``plan.doc_spans`` after the first placed chunk that have no placed chunk
    (documents that missed the store, or whose chunk failed to load): the question pass
    computes them over reused, approximate context. A missed document before every placed
    chunk is not one of them: it sees only exact K/V, so that pass computes it exactly."""
    placed = {p.start for p in plan.placed}
    first = _first_placed(plan)
    return [(a, b) for a, b in plan.doc_spans if b > a and a > first and a not in placed]


def _first_placed(plan: FusionPlan) -> int:
    """The first placed chunk's start (the prompt's length when none is placed): every
    position before it depends on exact K/V only."""
    return min((p.start for p in plan.placed), default=plan.ids.shape[0])


@torch.inference_mode()
def vdev_scores(model: Transformer, plan: FusionPlan, reused: KVCache) -> torch.Tensor:
    """(N,) CacheBlend's signal at layer 1 for every candidate document token (0 elsewhere):
    squared L2 between its fresh and cached layer-1 V, summed over heads and dims.

    ``reused`` is the question pass's cache (full reuse): its layer 0 holds the prefix, the
    re-rotated chunks and the other tokens' fresh K/V, which is exactly what layer 0 reads
    in ``fuse`` (layer 0's K/V depend on nothing but the token and its position), so the
    candidates' layer-1 inputs computed over it are those ``fuse`` compares at check layer
    1; its layer 1 holds the chunks' cached V. Only the candidates run, and only layer 0."""
    if len(model.layers) < 2:
        raise InvalidRequestError("the V-deviation hybrid needs a model with at least 2 layers")
    n = plan.ids.shape[0]
    pos = _candidate_mask(plan, n, model.device).nonzero().squeeze(1)  # (T,)
    out = torch.zeros(n, dtype=torch.float32, device=model.device)
    if pos.numel() == 0:
        return out
    first, second = model.layers[0], model.layers[1]
    tables = model.layer_rope_tables(pos)
    h = model.embed(plan.ids[pos])  # (T, D)
    q, _, _ = first.project_known_kv(h, *tables[0], pos.new_empty(0))  # queries only: K/V are the cache's
    keys, values = reused.view(0, n)
    attn = plan_attention(pos, n, first.window, model.dtype, heads_per_kv=model.cfg.heads_per_kv)
    h = first.finish(h, attend_planned(q, keys, values, attn))  # (T, D) layer-1 inputs
    _, v = second.project_kv(h, *tables[1], keys=False)  # (Hkv, T, d)
    out[pos] = deviation(None, v, None, reused.values[1][:, pos], "v")
    return out


def doc_ranks(scores: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """(T,) each candidate's rank among the candidates of its document (tokens outside
    every span rank among themselves), scaled to [0, 1]: 0 the lowest score, 1 the highest;
    tied scores share their mean rank, and a lone token (or an all-tied document) gets 0.5.
    scores, positions: (T,)."""
    out = torch.full(scores.shape, 0.5, dtype=torch.float32, device=scores.device)
    inside = torch.zeros_like(positions, dtype=torch.bool)
    groups = []
    for a, b in spans:
        g = (positions >= a) & (positions < b)
        inside |= g
        groups.append(g)
    groups.append(~inside)
    for g in groups:
        idx = g.nonzero().squeeze(1)
        m = idx.numel()
        if m < 2:
            continue
        s = scores[idx].float()
        ordered = s.sort().values
        below = torch.searchsorted(ordered, s)  # (m,) scores strictly lower
        upto = torch.searchsorted(ordered, s, right=True)  # (m,) scores lower or equal
        out[idx] = (below + upto - 1).float() / (2 * (m - 1))
    return out


def hybrid_scores(question: torch.Tensor, vdev: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                  weight: float) -> torch.Tensor:
    """(T,) ``(1 - weight)`` x the question score's within-document rank + ``weight`` x the
    V deviation's (`doc_ranks`). question, vdev, positions: (T,) per candidate."""
    return (1.0 - weight) * doc_ranks(question, positions, spans) + weight * doc_ranks(vdev, positions, spans)


def oracle_scores(model: Transformer, plan: FusionPlan) -> torch.Tensor:
    """(N,) squared distance between the reused (re-rotated) K/V and a full prefill's,
    summed over layers, heads and dims. Costs a full prefill and a reuse pass."""
    n = plan.ids.shape[0]
    full = model.new_cache(n)
    model(plan.ids, full, logits_for="none")
    reused = fuse(model, replace(_base(plan), select_from_start=True)).cache
    dev = torch.zeros(n, dtype=torch.float32, device=model.device)
    for layer in range(len(model.layers)):
        for a, b in ((full.keys, reused.keys), (full.values, reused.values)):
            dev += (a[layer][:, :n] - b[layer][:, :n]).float().pow(2).sum(dim=(0, 2))
    return dev


def fuse_planned(model: Transformer, plan: FusionPlan) -> FusionOutput:
    """Fuse by ``plan.strategy`` when it names one, else the paper's ``fuse``."""
    return run_steps(fuse_planned_steps(model, plan), model)


def fuse_planned_steps(model: Transformer, plan: FusionPlan) -> Generator[int, None, FusionOutput]:
    """``fuse_planned`` as a step generator (one step per layer of each pass)."""
    if plan.strategy is None:
        return (yield from fuse_steps(model, plan))
    return (yield from run_strategy_steps(model, plan))


def run_strategy(model: Transformer, plan: FusionPlan) -> FusionOutput:
    """``run_strategy_steps`` run to its end here."""
    return run_steps(run_strategy_steps(model, plan), model)


def run_strategy_steps(model: Transformer, plan: FusionPlan) -> Generator[int, None, FusionOutput]:
    """Fuse by ``plan.strategy`` (a BlendConfig); see the module docstring. A step generator.

    Question selection and missed documents: the question pass computes a document that
    has no placed chunk in full, over the reused context before it, so its K/V are at
    least as good as a chunk's. The second pass takes them from that pass's cache as
    candidates like the placed chunks' (``FusionPlan.held``: selected, budgeted and
    shifted as any document) instead of computing the document in full a second time.
    ``candidates`` and the selection's stats count the placed chunks' tokens only;
    ``recomputed`` counts both passes' tokens."""
    cfg: BlendConfig = plan.strategy
    n = plan.ids.shape[0]
    base = _base(plan)
    cached = _candidate_mask(plan, n, model.device)  # (N,) the placed chunks' tokens
    n_cached = int(cached.sum())
    held_spans = missed_spans(plan) if cfg.selection == "question" and n_cached else []
    held = _span_mask(held_spans, n, model.device) if held_spans else None
    is_cand = cached | held if held is not None else cached
    spans = sorted(spans_of(plan) + held_spans)
    n_cand = int(is_cand.sum())
    keep = kept_count(plan.ratios[-1], n_cand)
    samples, correct = None, None
    if cfg.shift:  # the sample is recomputed at every check (the smallest budget fits it): nested sets
        samples = shift_samples(spans, n, keep, n_cand, cfg.shift_stride, model.device) & is_cand
        question_from = max((b for _, b in document_spans(plan)), default=n) if cfg.shift_question else None
        correct = ShiftCorrection(spans, model.layer_rope_tables(torch.arange(n, device=model.device)),
                                  model.cfg.rope.interleaved, samples, cfg.shift_test, question_from)
    if cfg.selection == "deviation":
        pick = lambda d, pos, k: choose(d, pos, k, spans, cfg, forced=samples)  # noqa: E731
        out = yield from fuse_steps(model, replace(base, pick=pick, correct=correct))
        if correct is None or not out.checks:
            return out
        return out._replace(risk=blend_risk(correct, out.checks[-1].kept, n_cand))
    pos = is_cand.nonzero().squeeze(1)
    if n_cached == 0:  # nothing cached (every document missed): there is nothing to select
        return (yield from fuse_steps(model, replace(base, select_from_start=True)))
    if cfg.selection == "question":
        scores, reused = yield from question_scores_steps(model, plan)
        if keep == 0:  # no token kept, so no shift sample either: the question pass is the answer
            return reused
    else:
        scores, reused = oracle_scores(model, plan), None
    if cfg.cover and keep:  # at least the tokens holding cfg.cover of the score mass (the sample stays ratio's)
        keep = max(keep, covering_count(scores[pos], cfg.cover))
    ranked, mass = scores[pos], None
    if cfg.vdev:  # the hybrid: rank both signals within each document; budgets keep the attention mass
        ranked, mass = hybrid_scores(ranked, vdev_scores(model, plan, reused.cache)[pos], pos, spans, cfg.vdev), ranked
    chosen = choose(ranked, pos, keep, spans, cfg, mass, samples)  # (K,) into the candidates
    # the question pass's cache already holds every chunk re-rotated, the held documents
    # computed in context and the exact prompt before the first placed chunk (only the
    # question's rows are computed again in full): fill it in place
    again = reused.cache if cfg.selection == "question" else None
    exact = _first_placed(plan) if again is not None else 0  # the question pass computed it exactly

    def recompute_pass(chosen: torch.Tensor) -> Generator[int, None, tuple[FusionOutput, SelectionStats]]:
        kept = pos[chosen]
        recompute = torch.zeros(n, dtype=torch.bool, device=model.device)
        recompute[kept] = True
        probe = DeviationProbe(cached, min(1, len(model.layers) - 1), correct)
        out = yield from fuse_steps(model, replace(base, select_from_start=True, recompute=recompute, correct=probe,
                                                   reuse_cache=again, held=held, exact_upto=exact))
        return out, once_stats(probe, n_cached, kept[cached[kept]], spans_of(plan), (pos, ranked, chosen, samples))

    out, stats = yield from recompute_pass(chosen)
    work = [out.recomputed] if reused is None else [reused.recomputed, out.recomputed]
    escalated = None
    if correct is not None:
        risk = blend_risk(correct, int(chosen.numel()), n_cand)
        if escalated_keep(plan, cfg, risk, keep, n_cand, scores[pos]) is not None:
            # the shift moved every token left out: run the blend again whole at twice the
            # ratio (its own question pass, selection and shift), exactly that blend
            wide = cfg.twice()
            reused = out = again = None  # this blend's caches: not held while the second one runs
            again_out = yield from run_strategy_steps(
                model, replace(plan, strategy=wide, ratios=wide.ratios, escalate_at=None))
            work.append(again_out.recomputed)
            return again_out._replace(recomputed=[sum(layer) for layer in zip(*work)], escalated=risk)
    else:
        risk = moved_risk(reused.logits, out.logits) if reused is not None else None
        wider = escalated_keep(plan, cfg, risk, keep, n_cand, scores[pos])
        if wider is not None:  # the answer barely moved from reuse's: twice the tokens, the first ones among them
            escalated, chosen = risk, torch.cat([chosen, choose(ranked, pos, wider, spans, cfg, mass, samples)]).unique()
            out, stats = yield from recompute_pass(chosen)
            work.append(out.recomputed)
            risk = moved_risk(reused.logits, out.logits)
    out = out._replace(recomputed=[sum(layer) for layer in zip(*work)])  # every pass's work
    return out._replace(candidates=n_cached, checks=(stats,), risk=risk, escalated=escalated)


def escalated_keep(plan: FusionPlan, cfg: BlendConfig, risk: float | None, keep: int, n_cand: int,
                   scores: torch.Tensor) -> int | None:
    """How many candidates a blend recomputes again when its risk (``moved_risk``, or with
    the shift ``blend_risk``) is above ``plan.escalate_at`` (the engine's threshold for the
    request: ``engine.escalation``):
    as many as twice its ratio keeps (at most all; ``cover`` applies as to the first), never
    fewer than it kept. None: no second recompute (no threshold, no risk, below it, or every
    candidate already kept)."""
    if plan.escalate_at is None or risk is None or risk <= plan.escalate_at or keep >= n_cand:
        return None
    wider = kept_count(min(1.0, 2 * plan.ratios[-1]), n_cand)
    if cfg.cover:
        wider = max(wider, covering_count(scores, cfg.cover))
    return max(keep, wider)


def blend_risk(correct: ShiftCorrection, kept: int, candidates: int) -> float | None:
    """The share of reuse's KV error a blend left, as the shift's own sample measured it on
    tokens it recomputed (exact there): (1 - ``kept`` / ``candidates``), the tokens not
    recomputed, x the squared fresh - stale residual those keep after the shift (each
    sampled token held out of its document's mean) over the residual before it, summed over
    layers and corrected documents (each a mean per sampled token). 0: no error left; 1:
    reuse's. None when the shift measured nothing (no document had a sampled token). Costs
    nothing beyond the shift's own reductions."""
    if not correct.errors or candidates <= 0:
        return None
    before = sum(float(b.sum()) for b, _, _ in correct.errors)
    after = sum(float(a.sum()) for _, a, _ in correct.errors)
    return (1.0 - kept / candidates) * after / before if before > 0 else None


def moved_risk(reused_logits: torch.Tensor, blended_logits: torch.Tensor) -> float | None:
    """The risk of a question-selected blend without the shift: exp(-KL(blend || reuse)) of
    the next-token distributions at the prompt's last token, the question pass's (the
    prompt over reused K/V alone) against the blend's. 1: the recompute left the answer
    where plain reuse had it, so reuse's error is still there; towards 0 as it moves it.
    Without a shift the recomputed tokens' K/V are exact, so moving the answer is moving
    it towards full prefill's (a shift can move it the wrong way, and has ``blend_risk``).
    A ranking, not a calibrated share: a request whose reuse was already close to full
    prefill's has little to move and ranks risky too. Costs one softmax over the
    vocabulary. None when the KL is not finite (that request ends on its logits anyway)."""
    return risk_of_moved_kl(kl_divergence(blended_logits, reused_logits))


def risk_of_moved_kl(kl: float) -> float | None:
    """``moved_risk`` from the KL it measured (also read back from records that kept it)."""
    return min(1.0, math.exp(-kl)) if math.isfinite(kl) else None


def risk_kind(strategy: str | None) -> str:
    """Which estimate a blend's ``RequestStats.risk`` is, by its strategy: "shift"
    (``blend_risk``) when it names the shift, else "moved" (``moved_risk``). The two are on
    different scales (a blend's KV error left against how far its answer moved), so only
    risks of one kind are compared (the guard's windows, the histogram's label)."""
    return "shift" if strategy and "shift" in strategy else "moved"


def _span_mask(spans: Sequence[Span], n: int, device: torch.device) -> torch.Tensor:
    """(N,) bool over the spans' tokens, the last prompt token left out (it is always computed)."""
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    for a, b in spans:
        mask[a:b] = True
    mask[n - 1] = False
    return mask


class DeviationProbe:
    """A ``FusionPlan.correct`` hook that changes nothing: at ``layer`` it records CacheBlend's
    signal (squared L2 of fresh - stale V, summed over heads and dims) for the written
    tokens that had cached KV, so that a selection made once, before layer 0, reports a
    deviation as a check layer does: a stale or corrupted chunk shows there whatever the
    selection chose, which is what the guard's calibrated band watches. ``then``: the next
    hook (the shift), called after."""

    def __init__(self, candidates: torch.Tensor, layer: int, then: ShiftCorrection | None = None) -> None:
        self.candidates, self.layer, self.then = candidates, layer, then  # (N,) bool
        self.deviation: torch.Tensor | None = None  # (m,) per written candidate, at ``layer``

    def __call__(self, cache: KVCache, layer: int, written: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor | None = None) -> None:
        if layer == self.layer:
            rows = self.candidates[written]
            stale = cache.values[layer][:, written[rows]]
            self.deviation = (v[:, rows].float() - stale.float()).pow(2).sum(dim=(0, 2))
        if self.then is not None:
            self.then(cache, layer, written, k, v, q)


def once_stats(probe: DeviationProbe, n_candidates: int, kept: torch.Tensor, spans: Sequence[Span],
               ranked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
               ) -> SelectionStats:
    """The stats of a selection made once, before layer 0, as a check layer's: the probe's
    layer and the deviation of the kept tokens there; kept: positions. ``ranked``: the
    selection's (candidate positions, scores, chosen indices, forced mask), kept as its detail."""
    dev = probe.deviation if probe.deviation is not None else torch.zeros(0, device=kept.device)
    stats = selection_stats(probe.layer, dev, kept, spans)._replace(candidates=n_candidates)
    if ranked is None:
        return stats
    measured = kept if probe.deviation is not None else kept[:0]  # the probe saw the kept cached tokens
    return stats._replace(detail=SelectionDetail(*ranked[:3], measured, dev, ranked[3]))