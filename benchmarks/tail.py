"""Per-question KL of blend methods against full prefill, as ratios to plain reuse's: the tail.

    PYTHONPATH=src .venv/bin/python benchmarks/tail.py --out runs/tail/smol --start 0 --limit 40 \
        [--methods "reuse,blend:0.15:q+budget+sinks4+shift,..."] [--model qwen2.5-coder-0.5b] [--threads 1]
        [--only "0.5"]  # only the questions whose default ratio (an earlier run in --out) is >= 0.5
    PYTHONPATH=src .venv/bin/python benchmarks/tail.py --out runs/tail/smol --report [--start S --limit N]
    PYTHONPATH=src .venv/bin/python benchmarks/tail.py --out runs/tail/smol --report --limit 100 --folds 5 \
        [--choose "blend:0.15:q+budget+sinks4+shift,..."] [--quantiles none,0.9]

KL is `kvblend eval`'s (`eval.runner`): full prefill's greedy answer, stopped at a newline,
is teacher-forced for its first ``--kl-tokens`` tokens through each method's prepared
prompt, and KL(full || method) averaged over those positions; only the KL is computed
(no 32-token answer, no gold NLL), so a method costs its prepare and 8 forced tokens.
Full prefill's reference (answer ids and logits) is kept under ``OUT/refs`` and reused by
later runs. Each (question, method) is one JSON line in ``OUT/records.jsonl`` (a rerun
skips those done), with the request's blend risk (`RequestStats.risk`) when it has one and,
for a question-selected blend, how spread the question's attention over the documents is
(``cover15``: the share of its mass on the top 15 % of candidates; ``need``: the fraction of
candidates that holds each share, what ``+coverS`` would keep).

Each method runs once per question, without the engine's escalation (``engine.escalation``:
a blend whose risk is in the top of its tenant's recent ones of its kind recomputes at
twice its ratio, which depends on the requests before it); ``--report
--escalate Q`` applies that rule to the records instead: the risk method's questions whose
risk is above the Q quantile of the split's risks take the records of the same blend at
twice its ratio (run it too, e.g. ``blend:0.3:...`` beside ``blend:0.15:...``), exactly what
the engine serves then, with the shift or without (tests/engine/test_escalation.py).
``--risk moved`` ranks every question-selected blend by its moved risk instead, the shift's
too (what the engine does not do: measured, it ranked SmolLM2's tail no better).

``--report`` prints, per method, the per-question ratio KL / reuse's KL (mean of the KL
over questions divided by reuse's mean, median / p90 / max of per-question ratios, the
number of questions worse than reuse, the mean recomputed fraction), and the risk signal's AUC at separating questions
whose ratio is above 0.5 (`--risk-method`, default the engine's default blend).

``--report --folds K`` gives the figures to quote (issue #44): the questions cut into K
folds; per fold, the policy (a method of ``--choose``, with an escalation quantile of
``--quantiles``) with the lowest mean ratio on the other folds is scored on that fold alone,
and the held-out folds are pooled (mean, median, p90, max ratio, worse than reuse).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

import kvblend.blend.strategies as strategies
from kvblend.engine import Engine
from kvblend.engine.escalation import MIN_SAMPLES, top_quantile
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import (
    Reference, decode_answer, example_request, parse_method, teacher_force, warm_documents,
)
from kvblend.metrics import kl_divergence
from kvblend.models import DEFAULT_MODEL, load_model

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
DEFAULT = "blend:0.15:q+budget+sinks4+shift"
SIGNALS = ("risk", "pass_kl", "probe", "shift_left", "question_left", "question_left_max")


def load_ref(engine: Engine, ex, refs: Path, kl_tokens: int) -> Reference:
    """Full prefill's answer ids and logits along them, from ``refs`` or computed and kept there."""
    path = refs / f"{ex.id}.pt"
    if path.exists():
        d = torch.load(path)
        return Reference("", d["ids"], d["logits"])
    prepared = engine.prepare(example_request(ex, parse_method("full")), kl_tokens)
    _, ids = decode_answer(engine, prepared, kl_tokens)
    logits = teacher_force(engine, prepared, ids) if ids else prepared.logits[None]
    refs.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits.clone()}, path)
    return Reference("", ids, logits)


class Spy:
    """What a question-selected blend measured on the way, read for candidate risk signals:
    the question pass's logits (full reuse) and the shift's per-layer residuals."""

    def __init__(self) -> None:
        self.reuse_logits, self.shift, self.scores = None, None, None
        real_q, real_shift = strategies.question_scores_steps, strategies.ShiftCorrection
        spy = self

        def question_scores_steps(model, plan):
            scores, out = yield from real_q(model, plan)
            spy.reuse_logits = out.logits.clone()
            spy.scores = scores[strategies._candidate_mask(plan, plan.ids.shape[0], model.device)].clone()
            return scores, out

        class ShiftSpy(real_shift):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                spy.shift = self

        strategies.question_scores_steps, strategies.ShiftCorrection = question_scores_steps, ShiftSpy

    def reset(self) -> None:
        self.reuse_logits, self.shift, self.scores = None, None, None

    def signals(self, logits: torch.Tensor) -> dict:
        out = {}
        if self.scores is not None and self.scores.numel():  # how spread the question's attention mass is
            s = self.scores.float().clamp_min(0).sort(descending=True).values
            cum = s.cumsum(0) / s.sum()
            n = s.numel()
            out["cover15"] = float(cum[max(0, round(0.15 * n) - 1)])
            out["need"] = {str(share): (int((cum < share).sum()) + 1) / n for share in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)}
        if self.reuse_logits is not None:  # disagreement between the passes at the prompt's last token
            out["pass_kl"] = kl_divergence(logits, self.reuse_logits)
        if self.shift is not None and self.shift.errors:
            before = sum(float(b.sum()) for b, _, _ in self.shift.errors)
            after = sum(float(a.sum()) for _, a, _ in self.shift.errors)
            out["shift_left"] = after / before if before > 0 else None
            per_layer = [float(a.sum() / b.sum()) for b, a, _ in self.shift.errors if float(b.sum()) > 0]
            out["shift_left_layers"] = statistics.mean(per_layer) if per_layer else None
            out["shift_left_max"] = max(per_layer) if per_layer else None
        if self.shift is not None and self.shift.attn_errors:  # the question test's held-out estimates
            none = sum(float(a.sum()) for a, _ in self.shift.attn_errors)
            left = sum(float(b.sum()) for _, b in self.shift.attn_errors)
            out["question_left"] = left / none if none > 0 else None
            per_layer = [float(b.sum() / a.sum()) for a, b in self.shift.attn_errors if float(a.sum()) > 0]
            out["question_left_max"] = max(per_layer) if per_layer else None
        return out


def score(engine: Engine, ex, method: str, ref: Reference, spy: Spy | None = None,
          keep_logits: Path | None = None) -> dict:
    spec = parse_method(method)
    spec = replace(spec, blend=replace(spec.blend, escalate=None))  # once: ``--escalate`` applies the rule after
    if spy is not None:
        spy.reset()
    prepared = engine.prepare(example_request(ex, spec), len(ref.answer_ids) + 1)
    if keep_logits is not None:  # the next-token logits at the prompt's last token, for cross-method signals
        keep_logits.mkdir(parents=True, exist_ok=True)
        torch.save(prepared.logits.float().clone(), keep_logits / f"{ex.id}__{logits_name(method)}.pt")
    extra = spy.signals(prepared.logits) if spy is not None else {}
    forced = teacher_force(engine, prepared, ref.answer_ids) if ref.answer_ids else prepared.logits[None]
    s = prepared.stats
    probe = s.checks[0].mean_score if s.checks else None
    return {"id": ex.id, "method": method, "strategy": s.strategy, "kl": kl_divergence(ref.logits, forced),
            "risk": getattr(s, "risk", None), "recompute_frac": s.recompute_frac, "probe": probe, **extra}


def logits_name(method: str) -> str:
    """A method spelled as a file name."""
    return "".join(c if c.isalnum() or c in ".-_" else "_" for c in method)


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a random positive outscores a random negative (ties count half)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def auc_interval(scores: list[float], labels: list[bool], rounds: int = 1000, seed: int = 0) -> list[float] | None:
    """A 95 % bootstrap interval of ``auc`` (questions drawn with replacement; draws with no
    positive or no negative left out): with a handful of positives the AUC moves by tenths."""
    if not any(labels) or all(labels):
        return None
    gen, n, vals = torch.Generator().manual_seed(seed), len(scores), []
    for _ in range(rounds):
        pick = torch.randint(n, (n,), generator=gen).tolist()
        a = auc([scores[i] for i in pick], [labels[i] for i in pick])
        if a is not None:
            vals.append(a)
    vals.sort()
    return [round(vals[int(0.025 * (len(vals) - 1))], 3), round(vals[int(0.975 * (len(vals) - 1))], 3)]


def p90(ordered: list[float]) -> float:
    """The 0.9 quantile of ``ordered`` (sorted, not empty) as every figure here reads it: the
    element at round(0.9 x (n - 1))."""
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def with_risk(r: dict, kind: str = "engine") -> dict:
    """The record with ``risk`` as the engine defines it now, for records measured before it
    reported it so: with the shift, ``strategies.blend_risk`` (session 9), (1 - ratio) x
    ``shift_left`` (equal up to the rounding of the kept count: the engine's (1 - kept /
    candidates)); a question-selected blend without it, ``strategies.moved_risk`` (session
    15), exp(-``pass_kl``); else none. ``kind`` "moved": the moved risk for every
    question-selected blend, the shift's too (``--risk moved``)."""
    if kind == "moved":
        return {**r, "risk": strategies.risk_of_moved_kl(r["pass_kl"]) if r.get("pass_kl") is not None else None}
    if r.get("shift_left") is not None:
        return {**r, "risk": (1.0 - float(parse_method(r["method"].split("[")[0]).blend.ratio)) * r["shift_left"]}
    if r.get("pass_kl") is not None and r.get("strategy") and strategies.risk_kind(r["strategy"]) == "moved":
        return {**r, "risk": strategies.risk_of_moved_kl(r["pass_kl"])}
    return {**r, "risk": None}


def pooled(records: list[dict], ids: set[str] | None, methods: list[str]) -> None:
    """The risk's AUC over every request of ``methods`` (one per question and method) at
    separating those whose KL ratio to reuse is above 0.5, and its Spearman rank correlation
    with the ratio."""
    reuse = {r["id"]: r["kl"] for r in records if r["method"] == "reuse"}
    rows = [with_risk(r) for r in records if r["method"] in methods and r["id"] in reuse
            and (ids is None or r["id"] in ids) and with_risk(r)["risk"] is not None]
    ratios = [r["kl"] / max(reuse[r["id"]], 1e-12) for r in rows]
    risks = [r["risk"] for r in rows]
    print(json.dumps({"pooled": methods, "requests": len(rows), "above_0_5": sum(x > 0.5 for x in ratios),
                      "auc_risk": auc(risks, [x > 0.5 for x in ratios]), "spearman_risk_ratio": spearman(risks, ratios)}))


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (ties by average rank)."""
    if len(a) < 3:
        return None
    ra, rb = (torch.tensor(x, dtype=torch.float64) for x in (_ranks(a), _ranks(b)))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def report(records: list[dict], ids: set[str] | None, risk_method: str) -> None:
    by = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["method"], {})[r["id"]] = with_risk(r)
    reuse = by.get("reuse", {})
    for method, rows in by.items():
        common = [i for i in rows if i in reuse]
        if not common or method == "reuse":
            continue
        ratios = sorted(rows[i]["kl"] / max(reuse[i]["kl"], 1e-12) for i in common)
        mean_ratio = statistics.mean(rows[i]["kl"] for i in common) / statistics.mean(reuse[i]["kl"] for i in common)
        line = {"method": method, "n": len(common), "kl": round(statistics.mean(rows[i]["kl"] for i in common), 4),
                "mean_ratio": round(mean_ratio, 3), "median_ratio": round(statistics.median(ratios), 3),
                "p90_ratio": round(p90(ratios), 3), "max_ratio": round(ratios[-1], 3),
                "worse_than_reuse": sum(x > 1 for x in ratios), "above_0_5": sum(x > 0.5 for x in ratios),
                "recompute_frac": round(statistics.mean(rows[i]["recompute_frac"] for i in common), 3)}
        ratios_of = {i: rows[i]["kl"] / max(reuse[i]["kl"], 1e-12) for i in common}
        bad = [ratios_of[i] > 0.5 for i in common]
        for key in SIGNALS:  # over the questions whose record has the signal
            has = [j for j, i in enumerate(common) if rows[i].get(key) is not None]
            if has:
                sign = -1 if key == "pass_kl" else 1  # passes that agree: the blend moved little from reuse
                vals = [sign * rows[common[j]][key] for j in has]
                line[f"auc_{key}"] = auc(vals, [bad[j] for j in has])
                if key == "risk":
                    line["auc_risk_95"] = auc_interval(vals, [bad[j] for j in has])
                line[f"rho_{key}"] = spearman(vals, [ratios_of[common[j]] for j in has])
                line[f"n_{key}"] = len(has)
        print(json.dumps(line))


def doubled(method: str) -> str:
    """``blend:R:...`` at twice its ratio (at most 1): the blend an escalated request runs."""
    name, ratio, *rest = method.split(":")
    return ":".join([name, f"{min(1.0, 2 * float(ratio)):g}", *rest])


def escalation(records: list[dict], ids: set[str] | None, method: str, quantile: float, risk: str = "engine") -> None:
    """The engine's escalation applied to ``method``'s records: a question whose risk is
    above the ``quantile`` of the split's risks (``engine.escalation.top_quantile``; the
    split stands for the tenant's window) takes the record of ``doubled(method)``. Prints the
    report's figures for the blend as served (with the served risk's AUC at ratio > 0.5), how
    many escalated, and those without a record at twice the ratio (left out)."""
    by = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["id"], {})[r["method"]] = with_risk(r, risk)
    rows = {i: m for i, m in by.items() if "reuse" in m and method in m and m[method]["risk"] is not None}
    bar = top_quantile([m[method]["risk"] for m in rows.values()], quantile, MIN_SAMPLES)
    up = {i for i, m in rows.items() if bar is not None and m[method]["risk"] > bar}
    wide = doubled(method)
    missing = sorted(i for i in up if wide not in rows[i])
    served = {i: rows[i][wide if i in up else method] for i in rows if i not in missing}
    ratio_of = {i: served[i]["kl"] / max(rows[i]["reuse"]["kl"], 1e-12) for i in served}
    ratios = sorted(ratio_of.values())
    if not ratios:
        return
    risks = [served[i]["risk"] for i in served]  # the served request's risk: an escalated one's second recompute's
    mean_ratio = statistics.mean(r["kl"] for r in served.values()) / statistics.mean(rows[i]["reuse"]["kl"] for i in served)
    print(json.dumps({"escalated": method, "quantile": quantile, "threshold": bar, "n": len(ratios),
                      "n_escalated": len(up), "escalated_ids": sorted(up, key=lambda i: int(i.rsplit("-", 1)[-1])),
                      "missing": missing, "mean_ratio": round(mean_ratio, 3),
                      "median_ratio": round(statistics.median(ratios), 3),
                      "p90_ratio": round(p90(ratios), 3),
                      "max_ratio": round(ratios[-1], 3), "worse_than_reuse": sum(x > 1 for x in ratios),
                      "above_0_5": sum(x > 0.5 for x in ratios),
                      "auc_risk": auc(risks, [ratio_of[i] > 0.5 for i in served]),
                      "recompute_frac": round(statistics.mean(r["recompute_frac"] for r in served.values()), 3)}))


def converge(records: list[dict], ids: set[str] | None, methods: list[str], logits: Path) -> None:
    """How far a blend's answer still moved in its second half of recomputed tokens, as a
    risk: for a blend ``methods[0]`` and the same blend at half its ratio ``methods[1]``
    (kept logits, ``--keep-logits``), KL(blend || half) / KL(blend || reuse) at the prompt's
    last token -- the share of the answer's movement away from reuse's that the last half of
    the tokens made (near 0: converged; towards 1: still moving, so the tokens not
    recomputed likely move it further). Prints its AUC at separating the blend's questions
    whose KL ratio to reuse is above 0.5 (and above 0.25), its Spearman correlation with the
    ratio, and the same for the moved risk, exp(-KL(blend || reuse)), beside it."""
    blend, half = methods
    kl_of = {(r["id"], r["method"]): r["kl"] for r in records if ids is None or r["id"] in ids}
    rows = []
    for qid in sorted({i for i, m in kl_of if m == blend and (i, "reuse") in kl_of},
                      key=lambda i: int(i.rsplit("-", 1)[-1])):
        paths = [logits / f"{qid}__{logits_name(m)}.pt" for m in (blend, half, "reuse")]
        if not all(p.exists() for p in paths):
            continue
        lb, lh, lr = (torch.load(p) for p in paths)
        moved, late = kl_divergence(lb, lr), kl_divergence(lb, lh)
        ratio = kl_of[(qid, blend)] / max(kl_of[(qid, "reuse")], 1e-12)
        rows.append({"id": qid, "ratio": round(ratio, 3), "converge": late / max(moved, 1e-12),
                     "moved_risk": strategies.risk_of_moved_kl(moved), "late_kl": late, "moved_kl": moved})
    for r in rows:
        print(json.dumps(r))
    ratios = [r["ratio"] for r in rows]
    for key in ("converge", "moved_risk", "late_kl") if rows else ():
        vals = [r[key] for r in rows]
        print(json.dumps({"signal": key, "n": len(rows), "above_0_5": sum(x > 0.5 for x in ratios),
                          "auc_0_5": auc(vals, [x > 0.5 for x in ratios]),
                          "above_0_25": sum(x > 0.25 for x in ratios),
                          "auc_0_25": auc(vals, [x > 0.25 for x in ratios]), "rho": spearman(vals, ratios)}))


def first_token_bound(records: list[dict], ids: set[str] | None, methods: list[str], out: Path) -> None:
    """A ceiling for any risk read at the prompt's last token: the blend's true first-token
    ratio, KL(full || blend) / KL(full || reuse) of the next-token distributions there (full
    prefill's from ``OUT/refs``, the others kept with ``--keep-logits``), used as the risk.
    Prints its AUC at separating the questions whose ratio over the ``--kl-tokens`` answer
    tokens is above 0.5 (and 0.25), and its Spearman correlation with that ratio: what a
    signal that knew full prefill's next token exactly would score."""
    kl_of = {(r["id"], r["method"]): r["kl"] for r in records if ids is None or r["id"] in ids}
    for m in methods:
        first, ratios = [], []
        for qid in sorted(i for i, mm in kl_of if mm == m and (i, "reuse") in kl_of):
            paths = [out / "logits" / f"{qid}__{logits_name(x)}.pt" for x in (m, "reuse")]
            if not all(p.exists() for p in paths) or not (out / "refs" / f"{qid}.pt").exists():
                continue
            ref = torch.load(out / "refs" / f"{qid}.pt")["logits"][0]
            lb, lr = (torch.load(p) for p in paths)
            first.append(kl_divergence(ref, lb) / max(kl_divergence(ref, lr), 1e-12))
            ratios.append(kl_of[(qid, m)] / max(kl_of[(qid, "reuse")], 1e-12))
        print(json.dumps({"first_token_bound": m, "n": len(first), "above_0_5": sum(x > 0.5 for x in ratios),
                          "auc_0_5": auc(first, [x > 0.5 for x in ratios]), "above_0_25": sum(x > 0.25 for x in ratios),
                          "auc_0_25": auc(first, [x > 0.25 for x in ratios]), "rho": spearman(first, ratios)}))


def served_under(policy: tuple[str, float | None], rows: dict[str, dict],
                 window: dict[str, dict] | None = None) -> dict[str, dict]:
    """What each question of ``rows`` ({id: {method: record}}) is served under ``policy``
    (a blend method, and an escalation quantile or None): the escalation's threshold is the
    quantile of the risks of ``window``'s questions (default ``rows``), as of a tenant's
    recent requests; a question above it takes the record at twice the ratio. Questions
    lacking a record the policy needs are left out."""
    method, quantile = policy
    have = {i: m for i, m in rows.items() if "reuse" in m and method in m}
    if quantile is None:
        return {i: m[method] for i, m in have.items()}
    risks = [m[method]["risk"] for m in (window if window is not None else rows).values()
             if method in m and m[method].get("risk") is not None]
    bar = top_quantile(risks, quantile, MIN_SAMPLES)
    wide, out = doubled(method), {}
    for i, m in have.items():
        up = bar is not None and m[method].get("risk") is not None and m[method]["risk"] > bar
        if up and wide not in m:
            continue
        out[i] = m[wide] if up else m[method]
    return out


def policy_name(policy: tuple[str, float | None]) -> str:
    return policy[0] if policy[1] is None else f"{policy[0]} escalate@{policy[1]:g}"


def _meets(served: dict[str, dict], rows: dict[str, dict], p90_goal: float) -> bool:
    """Whether ``served`` ({id: record}) has a p90 KL ratio to reuse at most ``p90_goal`` and
    no question worse than reuse."""
    ratios = sorted(served[i]["kl"] / max(rows[i]["reuse"]["kl"], 1e-12) for i in served)
    if not ratios:
        return False
    return p90(ratios) <= p90_goal and ratios[-1] <= 1.0


def folds(records: list[dict], ids: set[str] | None, methods: list[str], quantiles: list[float | None],
          k: int, seed: int = 0, risk: str = "engine", p90_goal: float | None = None) -> dict:
    """Figures that generalise: the questions are cut into ``k`` folds (a seeded shuffle);
    for each fold the policy (a method of ``methods`` with an escalation quantile of
    ``quantiles``, None: none) with the lowest mean KL ratio to reuse on the other k-1 folds
    is chosen, and scored on the held-out fold only; the held-out questions of every fold are
    pooled. With ``p90_goal``, the policy chosen is instead the cheapest (lowest mean
    recompute fraction on the training folds) whose training p90 ratio is at most the goal
    with none worse than reuse (the lowest mean ratio when none meets it). A fixed default
    is a choice too: pass it alone to score it the same way. Prints
    and returns the pooled mean ratio (mean KL over mean reuse KL), the median, p90 and max
    of per-question ratios, the questions worse than reuse, the mean recompute fraction and
    the policy chosen per fold."""
    by: dict[str, dict] = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["id"], {})[r["method"]] = with_risk(r, risk)
    qids = sorted((i for i, m in by.items() if "reuse" in m), key=lambda i: int(i.rsplit("-", 1)[-1]))
    order = torch.randperm(len(qids), generator=torch.Generator().manual_seed(seed)).tolist()
    parts = [[qids[j] for j in order[f::k]] for f in range(k)]
    policies = [(m, q) for m in methods for q in quantiles]

    def mean_ratio(served: dict[str, dict], rows: dict[str, dict]) -> float:
        if not served:
            return float("inf")
        return statistics.mean(r["kl"] for r in served.values()) / statistics.mean(rows[i]["reuse"]["kl"] for i in served)

    held: dict[str, dict] = {}
    chosen = []
    for f, part in enumerate(parts):
        train = {i: by[i] for g, other in enumerate(parts) if g != f for i in other}
        best = min(policies, key=lambda p: mean_ratio(served_under(p, train), train))
        if p90_goal is not None:  # the cheapest policy meeting the goal on the training folds
            meets = [p for p in policies if _meets(served_under(p, train), train, p90_goal)]
            best = min(meets, key=lambda p: statistics.mean(r["recompute_frac"] for r in
                                                           served_under(p, train).values())) if meets else best
        chosen.append(policy_name(best))
        held.update(served_under(best, {i: by[i] for i in part}, window=train))  # the threshold from the past
    ratios = sorted(held[i]["kl"] / max(by[i]["reuse"]["kl"], 1e-12) for i in held)
    line = {"folds": k, "n": len(ratios), "chosen": chosen}
    if ratios:
        line.update({"mean_ratio": round(mean_ratio(held, by), 3), "median_ratio": round(statistics.median(ratios), 3),
                     "p90_ratio": round(p90(ratios), 3),
                     "max_ratio": round(ratios[-1], 3), "worse_than_reuse": sum(x > 1 for x in ratios),
                     "recompute_frac": round(statistics.mean(r["recompute_frac"] for r in held.values()), 3)})
    print(json.dumps(line))
    return line


def per_question(records: list[dict], ids: set[str] | None, methods: list[str]) -> None:
    by = {}
    for r in records:
        if ids is None or r["id"] in ids:
            by.setdefault(r["id"], {})[r["method"]] = r
    print("| question | reuse KL | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for qid, rows in sorted(by.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[-1])):
        if "reuse" not in rows:
            continue
        base = max(rows["reuse"]["kl"], 1e-12)
        cells = [f"{rows[m]['kl'] / base:.2f}" if m in rows else "" for m in methods]
        print(f"| {qid} | {rows['reuse']['kl']:.4f} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--out", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--methods", default=f"reuse,{DEFAULT}")
    ap.add_argument("--kl-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", type=float, default=None,
                    help="only questions whose default blend's ratio to reuse (earlier records) is >= this")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="run +shift as asked (default: the engine drops it where its model test says so)")
    ap.add_argument("--keep-logits", action="store_true",
                    help="save each request's next-token logits under OUT/logits (for --converge)")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--table", default=None, help="with --report: methods (comma-separated) for a per-question table")
    ap.add_argument("--risk-method", default=DEFAULT)
    ap.add_argument("--bound", default=None,
                    help="with --report: methods (comma-separated) whose first-token oracle risk to score (see first_token_bound)")
    ap.add_argument("--converge", default=None,
                    help="with --report: BLEND,HALF (the same blend at half the ratio, both run with --keep-logits)")
    ap.add_argument("--pool", default=None, help="with --report: methods whose requests the risk's AUC pools")
    ap.add_argument("--escalate", type=float, default=None,
                    help="with --report: the engine's escalation at this quantile, on --risk-method (see escalation)")
    ap.add_argument("--folds", type=int, default=None,
                    help="with --report: pooled held-out figures over K folds, choosing among --choose (see folds)")
    ap.add_argument("--choose", default=DEFAULT,
                    help="with --folds: the blend methods to choose among (comma-separated; default: the default alone)")
    ap.add_argument("--quantiles", default="none",
                    help="with --folds: escalation quantiles to choose among, 'none' for no escalation (e.g. none,0.9)")
    ap.add_argument("--p90-goal", type=float, default=None,
                    help="with --folds: choose the cheapest policy whose training p90 ratio meets this (see folds)")
    ap.add_argument("--risk", choices=("engine", "moved"), default="engine",
                    help="with --escalate / --folds: the engine's risk per blend kind, or the moved risk for every blend")
    args = ap.parse_args()
    out = Path(args.out)
    records_path = out / "records.jsonl"
    examples = load_musique(args.dataset, n_docs=6, limit=args.start + args.limit)[args.start :]
    ids = {ex.id for ex in examples}
    if args.report:
        records = read(records_path)
        report(records, ids, args.risk_method)
        if args.pool:
            pooled(records, ids, args.pool.split(","))
        if args.escalate is not None:
            escalation(records, ids, args.risk_method, args.escalate, args.risk)
        if args.folds:
            quantiles = [None if q == "none" else float(q) for q in args.quantiles.split(",")]
            folds(records, ids, args.choose.split(","), quantiles, args.folds, risk=args.risk, p90_goal=args.p90_goal)
        if args.table:
            per_question(records, ids, args.table.split(","))
        if args.converge:
            converge(records, ids, args.converge.split(","), out / "logits")
        if args.bound:
            first_token_bound(records, ids, args.bound.split(","), out)
        return
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    done = {(r["id"], r["method"]) for r in read(records_path)}
    if args.only is not None:
        earlier = {(r["id"], r["method"]): r["kl"] for r in read(records_path)}
        examples = [ex for ex in examples if (ex.id, "reuse") in earlier and (ex.id, DEFAULT) in earlier
                    and earlier[(ex.id, DEFAULT)] >= args.only * earlier[(ex.id, "reuse")]]
        print("questions:", [ex.id for ex in examples], flush=True)
    engine = Engine(load_model(args.model), calibrate=not args.no_calibrate)
    spy = Spy()
    out.mkdir(parents=True, exist_ok=True)
    try:
        for ex in examples:
            todo = [m for m in methods if (ex.id, m) not in done]
            if not todo:
                continue
            warm_documents(engine, ex, [parse_method(m) for m in todo])
            ref = load_ref(engine, ex, out / "refs", args.kl_tokens)
            for m in todo:
                row = score(engine, ex, m, ref, spy, out / "logits" if args.keep_logits else None)
                with records_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
