"""How much of the moved tokens' true residual (full prefill - stale) would richer, still cheap
per-document estimates built from the shift's sampled tokens capture, against today's mean?

Derived from benchmarks/shift_probe.py (copied, trimmed: no attention part). Per question: one
blend (shift spied on: stale cache before the shift, fresh K/V of the sampled rows, rows), then a
full prefill of the same prompt. Per layer, K (pre-RoPE frame) and V apart, every estimator's
Σ|truth - estimate|² over the moved tokens, with the sample residual taken two ways:
  A = full - stale on the sampled tokens; B = the blend's own fresh - stale (what the engine has).

    cd /work/main && PYTHONPATH=src .venv/bin/python benchmarks/shift_estimators.py \
        --model smollm2-135m --ids 0 --out runs/shift_est/smol.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvblend import rope as rope_lib
from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import example_request, parse_method, warm_documents
from kvblend.models import DEFAULT_MODEL, load_model
from shift_probe import Recorder

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
ORACLES = False
BUCKETS = ((0, 8), (8, 32), (32, 128), (128, 10**9))


def unrot(x, cos, sin, pos, interleaved):
    """(H, T, d) post-RoPE at positions pos -> pre-RoPE."""
    return rope_lib.apply_rope(x, cos[pos].float(), -sin[pos].float(), interleaved)


def loo_means(R):
    """R (H, n, d) -> m_{-i} (H, n, d)."""
    n = R.shape[1]
    return (R.sum(1, keepdim=True) - R) / (n - 1)


def ridge_loo(X, Y, lams):
    """Pooled ridge Y ≈ X W (X, Y: (N, d) centred within docs). Pick λ by exact LOO; return W."""
    N, d = X.shape
    U, S, Vt = torch.linalg.svd(X, full_matrices=False)
    UtY = U.T @ Y
    best = None
    for lam in lams:
        lam = lam * float((S ** 2).mean())
        f = S ** 2 / (S ** 2 + lam)
        H_diag = (U ** 2 * f).sum(1)  # (N,)
        Yhat = U @ (f[:, None] * UtY)
        e = ((Y - Yhat) / (1 - H_diag).clamp_min(1e-6)[:, None]).pow(2).sum()
        if best is None or e < best[0]:
            best = (float(e), lam)
    lam = best[1]
    return Vt.T @ ((S / (S ** 2 + lam))[:, None] * UtY)


def estimates(R, os_, om, Ss, Sm, docs_s, docs_m, n_docs, pooled):
    """Per-doc estimators. R: (H, m, d) sample residuals; os_/om: sample/moved offsets (m,)/(o,);
    Ss/Sm: stale (pre-RoPE for K) of sample / moved (H, ·, d); docs_*: doc index per row.
    Returns {name: (H, o, d)} estimates for the moved tokens."""
    H, o, d = Sm.shape[0], Sm.shape[1], Sm.shape[2]
    out = {k: Sm.new_zeros(H, o, d) for k in ("mean", "knn2", "knn4", "interp", "logfit", "linfit",
                                              "scal_loo", "scalch_loo", "stale_knn4", "stale_slope_doc",
                                              "stale_scalar_doc")}
    if pooled:
        out["stale_slope_pool"] = Sm.new_zeros(H, o, d)
        out["stale_ridge_pool"] = Sm.new_zeros(H, o, d)
        out["logfit_ridge_pool"] = Sm.new_zeros(H, o, d)
    cen_x, cen_y, cen_y2 = [], [], []
    per_doc = []
    for j in range(n_docs):
        si, mi = (docs_s == j).nonzero().squeeze(1), (docs_m == j).nonzero().squeeze(1)
        if mi.numel() == 0:
            continue
        r, so, mo = R[:, si], os_[si].float(), om[mi].float()
        ss, sm = Ss[:, si], Sm[:, mi]
        n = si.numel()
        m = r.mean(1, keepdim=True)  # (H,1,d)
        out["mean"][:, mi] = m
        dist = (mo[:, None] - so[None, :]).abs()  # (o_j, n)
        for k in (2, 4):
            kk = min(k, n)
            idx = dist.topk(kk, dim=1, largest=False).indices  # (o_j, kk)
            out[f"knn{k}"][:, mi] = r[:, idx].mean(2)
        # linear interpolation between the bracketing samples (constant beyond the ends)
        order = so.argsort()
        so_s, r_s = so[order], r[:, order]
        hi = torch.searchsorted(so_s, mo).clamp(1, max(1, n - 1)) if n > 1 else torch.zeros_like(mo, dtype=torch.long)
        if n > 1:
            lo = hi - 1
            t = ((mo - so_s[lo]) / (so_s[hi] - so_s[lo])).clamp(0, 1)
            out["interp"][:, mi] = r_s[:, lo] * (1 - t)[None, :, None] + r_s[:, hi] * t[None, :, None]
        else:
            out["interp"][:, mi] = m
        for name, f_s, f_m in (("logfit", torch.log1p(so), torch.log1p(mo)), ("linfit", so, mo)):
            if n >= 3:
                fc = f_s - f_s.mean()
                b = (fc[None, :, None] * (r - m)).sum(1, keepdim=True) / fc.pow(2).sum()
                out[name][:, mi] = m + b * (f_m - f_s.mean())[None, :, None]
            else:
                out[name][:, mi] = m
        if n >= 2:
            ml = loo_means(r)
            a = (r * ml).sum((1, 2)) / ml.pow(2).sum((1, 2)).clamp_min(1e-30)  # (H,)
            out["scal_loo"][:, mi] = a.clamp(0, 1)[:, None, None] * m
            ac = (r * ml).sum(1, keepdim=True) / ml.pow(2).sum(1, keepdim=True).clamp_min(1e-30)
            out["scalch_loo"][:, mi] = ac.clamp(0, 1) * m
        # kNN in stale space (cosine, same head), k=4
        kk = min(4, n)
        cs = torch.nn.functional.normalize(sm, dim=-1) @ torch.nn.functional.normalize(ss, dim=-1).transpose(1, 2)
        idx = cs.topk(kk, dim=2).indices  # (H, o_j, kk)
        out["stale_knn4"][:, mi] = torch.stack([r[h][idx[h]].mean(1) for h in range(H)])
        # per-doc per-channel slope on the stale value (2 params/channel/doc)
        sc = ss - ss.mean(1, keepdim=True)
        if n >= 3:
            b = (sc * (r - m)).sum(1, keepdim=True) / sc.pow(2).sum(1, keepdim=True).clamp_min(1e-30)
            out["stale_slope_doc"][:, mi] = m + b * (sm - ss.mean(1, keepdim=True))
        else:
            out["stale_slope_doc"][:, mi] = m
        # one slope per head per doc (r - m ≈ β (s - s̄), β over all channels)
        beta = (sc * (r - m)).sum((1, 2)) / sc.pow(2).sum((1, 2)).clamp_min(1e-30) if n >= 3 else sc.new_zeros(H)
        out["stale_scalar_doc"][:, mi] = m + beta[:, None, None] * (sm - ss.mean(1, keepdim=True))
        cen_x.append(sc)
        cen_y.append(r - m)
        if n >= 3:  # what the per-doc log-offset fit leaves on the sample
            fs = torch.log1p(so)
            fc = fs - fs.mean()
            bl = (fc[None, :, None] * (r - m)).sum(1, keepdim=True) / fc.pow(2).sum()
            cen_y2.append(r - m - bl * fc[None, :, None])
        else:
            cen_y2.append(r - m)
        per_doc.append((mi, m, ss.mean(1, keepdim=True), sm))
    if pooled and cen_x:
        X, Y = torch.cat(cen_x, 1), torch.cat(cen_y, 1)  # (H, M, d)
        b = (X * Y).sum(1, keepdim=True) / X.pow(2).sum(1, keepdim=True).clamp_min(1e-30)  # (H,1,d)
        Ws = [ridge_loo(X[h], Y[h], (0.01, 0.1, 1.0, 10.0, 100.0)) for h in range(H)]
        Y2 = torch.cat(cen_y2, 1)
        W2 = [ridge_loo(X[h], Y2[h], (0.01, 0.1, 1.0, 10.0, 100.0)) for h in range(H)]
        for mi, m, sbar, sm in per_doc:
            out["stale_slope_pool"][:, mi] = m + b * (sm - sbar)
            out["stale_ridge_pool"][:, mi] = m + torch.stack([(sm[h] - sbar[h]) @ Ws[h] for h in range(H)])
            out["logfit_ridge_pool"][:, mi] = out["logfit"][:, mi] + torch.stack(
                [(sm[h] - sbar[h]) @ W2[h] for h in range(H)])
    return out


def analyse(model, rec: Recorder, question: str) -> list[dict]:
    ids = rec.plan.ids
    n = ids.shape[0]
    full = model.new_cache(n)
    model(ids, full, logits_for="none")
    tables = model.layer_rope_tables(torch.arange(n))
    inter = model.cfg.rope.interleaved
    rows = []
    for L in rec.layers:
        layer = L["layer"]
        cos, sin = tables[layer]
        spans = L["spans"]
        pos_s, pos_m = L["sample_pos"], L["moved"]
        ds, dm = L["doc_of_row"], L["doc_of_moved"]
        starts = torch.tensor([a for a, _ in spans])
        os_, om = pos_s - starts[ds], pos_m - starts[dm]
        n_docs = len(spans)
        # every document token (for the offset profile of the true residual)
        all_pos = torch.cat([torch.arange(a, b) for a, b in spans])
        all_off = torch.cat([torch.arange(0, b - a) for a, b in spans])
        moved_set = torch.zeros(n, dtype=torch.bool)
        moved_set[pos_m] = True
        row = {"id": question, "layer": layer, "n_moved": int(pos_m.numel()), "n_sample": int(pos_s.numel()),
               "sample_per_doc": torch.bincount(ds, minlength=n_docs).tolist(),
               "doc_len": [b - a for a, b in spans]}
        for j, name in enumerate(("k", "v")):
            stale = L["stale"][j]
            fullx = (full.keys, full.values)[j][layer][:, :n].float()
            fresh, applied = L["fresh"][j], L["applied"][j][:, pos_m]
            if name == "k":
                un = lambda x, p: unrot(x, cos, sin, p, inter)  # noqa: E731
            else:
                un = lambda x, p: x  # noqa: E731
            Sm, Ss = un(stale[:, pos_m], pos_m), un(stale[:, pos_s], pos_s)
            T = un(fullx[:, pos_m], pos_m) - Sm  # truth on moved (H,o,d)
            RA = un(fullx[:, pos_s], pos_s) - Ss
            RB = un(fresh, pos_s) - Ss
            A_m = un(applied, pos_m)
            res = {"none": float(T.pow(2).sum()), "engine": float((T - A_m).pow(2).sum())}
            # oracle constant per doc (best possible mean)
            orc = torch.zeros_like(T)
            for d in range(n_docs):
                mi = (dm == d).nonzero().squeeze(1)
                if mi.numel():
                    orc[:, mi] = T[:, mi].mean(1, keepdim=True)
            res["oracle_mean"] = float((T - orc).pow(2).sum())
            if ORACLES:  # ceilings of the stale-linear family: fitted on the moved tokens' truth itself
                o1, o2 = torch.zeros_like(T), torch.zeros_like(T)
                cx, cy = [], []
                for d in range(n_docs):
                    mi = (dm == d).nonzero().squeeze(1)
                    if mi.numel() < 3:
                        o1[:, mi], o2[:, mi] = orc[:, mi], orc[:, mi]
                        continue
                    t, sm = T[:, mi], Sm[:, mi]
                    sc, tc = sm - sm.mean(1, keepdim=True), t - t.mean(1, keepdim=True)
                    b = (sc * tc).sum(1, keepdim=True) / sc.pow(2).sum(1, keepdim=True).clamp_min(1e-30)
                    o1[:, mi] = t.mean(1, keepdim=True) + b * sc
                    cx.append((mi, sc)); cy.append(tc)
                X = torch.cat([c for _, c in cx], 1); Y = torch.cat(cy, 1)
                for h in range(X.shape[0]):
                    W = torch.linalg.lstsq(X[h], Y[h]).solution
                    for mi, sc in cx:
                        o2[h, mi] = orc[h, mi] + sc[h] @ W
                res["orc_stale_slope_doc"] = float((T - o1).pow(2).sum())
                res["orc_stale_linmap_pool"] = float((T - o2).pow(2).sum())
            for tag, R in (("A", RA), ("B", RB)):
                est = estimates(R, os_, om, Ss, Sm, ds, dm, n_docs, pooled=True)
                for k, E in est.items():
                    res[f"{k}_{tag}"] = float((T - E).pow(2).sum())
                    if k in ("mean", "knn4", "logfit", "scal_loo", "stale_ridge_pool", "interp"):
                        per_tok = (T - E).pow(2).sum((0, 2))
                        res[f"{k}_{tag}_bucket"] = [float(per_tok[(om >= lo) & (om < hi)].sum()) for lo, hi in BUCKETS]
            # truth on all doc tokens, by offset bucket
            Tall = (un(fullx[:, all_pos], all_pos) - un(stale[:, all_pos], all_pos)).pow(2).sum((0, 2))
            res["all_bucket_sum"] = [float(Tall[(all_off >= lo) & (all_off < hi)].sum()) for lo, hi in BUCKETS]
            per_tok = T.pow(2).sum((0, 2))
            res["none_bucket"] = [float(per_tok[(om >= lo) & (om < hi)].sum()) for lo, hi in BUCKETS]
            res["sample_true"] = float(RA.pow(2).sum())
            res["sampleB_minus_A"] = float((RB - RA).pow(2).sum())
            row[name] = res
        row["all_bucket_count"] = [int(((all_off >= lo) & (all_off < hi)).sum()) for lo, hi in BUCKETS]
        row["moved_bucket_count"] = [int(((om >= lo) & (om < hi)).sum()) for lo, hi in BUCKETS]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--method", default="blend:0.15:q+budget+sinks4+shift")
    ap.add_argument("--out", required=True)
    ap.add_argument("--oracles", action="store_true", help="also in-sample ceilings on the moved truth")
    args = ap.parse_args()
    global ORACLES
    ORACLES = args.oracles
    torch.set_num_threads(1)
    ids = [int(x) for x in args.ids.split(",")]
    rec = Recorder()
    engine = Engine(load_model(args.model), calibrate=False)
    examples = load_musique(DATA, n_docs=6, limit=max(ids) + 1)
    spec = parse_method(args.method)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        for i in ids:
            t0 = time.time()
            ex = examples[i]
            warm_documents(engine, ex, [spec])
            rec.reset()
            engine.prepare(example_request(ex, spec), 1)
            assert len({L["layer"] for L in rec.layers}) == len(rec.layers), "one shift call per layer expected"
            rows = analyse(engine.model, rec, ex.id)
            with open(args.out, "a") as f:
                for row in rows:
                    f.write(json.dumps({"model": args.model, "method": args.method, **row}) + "\n")
            print(f"{ex.id}: {len(rows)} layers, {time.time() - t0:.1f}s", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
