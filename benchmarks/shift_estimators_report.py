"""Summarise benchmarks/shift_estimators.py output: error / none's, summed over layers and questions, and the
per-layer range (per-layer fraction pooled over questions).

    python3 benchmarks/shift_estimators_report.py runs/shift_est/smol.jsonl
"""
import json
import sys
from collections import defaultdict

rows = [json.loads(line) for p in sys.argv[1:] for line in open(p)]
qs = sorted({r["id"] for r in rows})
print(f"{len(qs)} questions: {', '.join(qs)}; {len({r['layer'] for r in rows})} layers")
spd = [c for r in rows if r["layer"] == 0 for c in r["sample_per_doc"]]
dl = [c for r in rows if r["layer"] == 0 for c in r["doc_len"]]
mv = [r["n_moved"] for r in rows if r["layer"] == 0]
print(f"sample per doc: min {min(spd)} median {sorted(spd)[len(spd)//2]} max {max(spd)}; "
      f"doc len min {min(dl)} median {sorted(dl)[len(dl)//2]} max {max(dl)}; moved per question {mv}")

for kind in ("k", "v"):
    per_layer = defaultdict(lambda: defaultdict(float))
    tot = defaultdict(float)
    for r in rows:
        for key, val in r[kind].items():
            if isinstance(val, float):
                per_layer[r["layer"]][key] += val
                tot[key] += val
    per_layer = {l: d for l, d in per_layer.items() if d["none"] > 1e-6 * tot["none"]}  # layer 0: no residual
    names = [k for k in tot if k not in ("none", "sample_true", "sampleB_minus_A") and not k.startswith("orc_")]
    print(f"\n[{kind.upper()}] none total {tot['none']:.4g}; sample |B-A|^2 / sample |A|^2 = "
          f"{tot['sampleB_minus_A'] / tot['sample_true']:.3f}")
    print(f"{'estimator':22s} {'A: frac':>8s} {'A layer range':>15s}   {'B: frac':>8s} {'B layer range':>15s}")
    base = sorted({n[:-2] for n in names if n.endswith(("_A", "_B"))}, key=lambda b: tot[b + "_B"])
    for name in [x for x in ("engine", "oracle_mean", "orc_stale_slope_doc", "orc_stale_linmap_pool") if x in tot]:
        fr = [per_layer[l][name] / per_layer[l]["none"] for l in per_layer]
        print(f"{name:22s} {tot[name] / tot['none']:8.3f} {min(fr):7.3f}-{max(fr):.3f}")
    for b in base:
        cells = []
        for tag in ("A", "B"):
            fr = [per_layer[l][f"{b}_{tag}"] / per_layer[l]["none"] for l in per_layer]
            cells.append(f"{tot[f'{b}_{tag}'] / tot['none']:8.3f} {min(fr):7.3f}-{max(fr):.3f}")
        print(f"{b:22s} {cells[0]}   {cells[1]}")
    # layers where mean_B worse than none
    worse = [l for l in sorted(per_layer) if per_layer[l]["mean_B"] > per_layer[l]["none"]]
    print(f"layers where mean_B > none: {worse}")
    # per-layer-thirds
    Ls = sorted(per_layer)
    th = [Ls[: len(Ls) // 3], Ls[len(Ls) // 3: 2 * len(Ls) // 3], Ls[2 * len(Ls) // 3:]]
    for b in ("mean_B", "knn4_B", "logfit_B", "scal_loo_B", "stale_ridge_pool_B", "oracle_mean", "mean_A"):
        print(f"  thirds {b:20s} " + " ".join(
            f"{sum(per_layer[l][b] for l in t) / sum(per_layer[l]['none'] for l in t):.3f}" for t in th))
    # offset buckets
    cnt_all = [sum(r["all_bucket_count"][i] for r in rows) for i in range(4)]
    cnt_mv = [sum(r["moved_bucket_count"][i] for r in rows) for i in range(4)]
    allb = [sum(r[kind]["all_bucket_sum"][i] for r in rows) for i in range(4)]
    noneb = [sum(r[kind]["none_bucket"][i] for r in rows) for i in range(4)]
    print("  offset buckets 0-7 / 8-31 / 32-127 / 128+ (sums over layers, mean per token-layer)")
    print("   all doc tokens mean |r|^2: " + " ".join(f"{a / c:.3g}" for a, c in zip(allb, cnt_all)) +
          f"   (token-layers {cnt_all})")
    print("   moved tokens   mean |r|^2: " + " ".join(f"{a / max(c, 1):.3g}" for a, c in zip(noneb, cnt_mv)) +
          f"   (token-layers {cnt_mv}); share of none's error " + " ".join(f"{a / sum(noneb):.3f}" for a in noneb))
    for b in ("mean_B", "knn4_B", "interp_B", "logfit_B", "scal_loo_B", "stale_ridge_pool_B", "mean_A", "logfit_A"):
        bb = [sum(r[kind][b + "_bucket"][i] for r in rows) for i in range(4)]
        print(f"   {b:20s} frac by bucket: " + " ".join(f"{x / max(y, 1e-30):.3f}" for x, y in zip(bb, noneb)))
