"""Does the shift move the tokens it moves toward full prefill's K/V? Per layer, against a full prefill.

    PYTHONPATH=src .venv/bin/python benchmarks/shift_probe.py --model qwen2.5-coder-0.5b --ids 62,65 \
        [--method blend:0.15:q+budget+sinks4+shiftq] [--out runs/probe]

Runs one blend of each question with the shift spied on, then a full prefill of the same
prompt, and per layer, K (post-RoPE, where the cache holds it) and V apart, prints:

* ``moved``: Σ|full − stale|² over the tokens the shift moved (its error before) and
  Σ|full − stale − shift|² (after: what the shift really did to them);
* ``sample``: the same residual on the shift's sampled tokens (is the sample like the rest?),
  and Σ|fresh − full|² there (how far the blend's own recomputation is from full prefill's);
* ``loo``: the held-out estimate the test decides on (``ShiftCorrection.errors``);
* ``attn``: per KV head, the question rows' attention output error against full prefill's over
  the blend's cache with no shift, the shift, K alone and V alone (the blend's own queries);
* ``estimated``: the question test's held-out estimates of the same four (``+shiftq``'s
  ``_question_test``, run here as an observer: the shift stays as the per-document test left it).

The rows are JSON lines (also appended to ``OUT/probe.jsonl`` with ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvblend.blend.strategies as strategies
from kvblend.engine import Engine
from kvblend.eval.datasets import load_musique
from kvblend.eval.runner import example_request, parse_method, warm_documents
from kvblend.models import DEFAULT_MODEL, load_model

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


class Recorder:
    """Patches the strategies module to keep the plan and, per layer of the shift, the stale
    cache before it, the fresh K/V written, the rows it read (and their documents) and the
    cache after it; with ``watch``, the question rows' queries too. Also used by
    ``shift_estimators.py``."""

    def __init__(self) -> None:
        self.plan, self.layers, self.q = None, [], {}
        real_run, real_shift = strategies.run_strategy_steps, strategies.ShiftCorrection
        rec = self

        def run_strategy_steps(model, plan):
            rec.plan = plan
            return (yield from real_run(model, plan))

        class Spy(real_shift):
            def _question_test(self, *a, **kw):  # observe only: record its estimates, shift as the K/V test says
                real_shift._question_test(self, *a, **kw)
                hkv = a[3].shape[0]
                return torch.ones(hkv, dtype=torch.bool), torch.ones(hkv, dtype=torch.bool)

            def __call__(self, cache, layer, written, k, v, q=None):
                r = self._rows_for(written)
                if r is None:
                    return super().__call__(cache, layer, written, k, v, q)
                n = rec.plan.ids.shape[0]
                sk, sv = cache.keys[layer][:, :n].float().clone(), cache.values[layer][:, :n].float().clone()
                self.last_errors = None
                super().__call__(cache, layer, written, k, v, q)
                ak = cache.keys[layer][:, :n].float() - sk
                av = cache.values[layer][:, :n].float() - sv
                q_start = int(max(b for _, b in self.spans))
                rows_q = (written >= q_start).nonzero().squeeze(1)
                watched = rec.q.get(layer)  # None unless ``watch`` ran
                rec.layers.append({"layer": layer, "stale": (sk, sv), "applied": (ak, av),
                                   "q": None if watched is None else watched[:, rows_q].float().clone(),
                                   "q_pos": written[rows_q].clone(), "spans": [self.spans[j] for j in r.doc_ids],
                                   "doc_of_row": r.doc_of_row.clone(), "doc_of_moved": r.doc_of_moved.clone(),
                                   "written": written.clone(), "kv": (k.float().clone(), v.float().clone()),
                                   "sample_pos": r.pos.clone(), "fresh": (k[:, r.rows].float(), v[:, r.rows].float()),
                                   "estimated": None if self.last_errors is None else self.last_errors.tolist(),
                                   "moved": r.moved.clone(), "loo": (float(self.errors[-1][0].sum()),
                                                                    float(self.errors[-1][1].sum()))})

        strategies.run_strategy_steps, strategies.ShiftCorrection = run_strategy_steps, Spy

    def watch(self, model) -> None:
        """Keep each layer's last queries (fusion projects them just before the shift)."""
        for i, layer in enumerate(model.layers):
            def project(h, cos, sin, _real=layer.project, _i=i):
                q, k, v = _real(h, cos, sin)
                self.q[_i] = q
                return q, k, v
            layer.project = project

    def reset(self) -> None:
        self.plan, self.layers = None, []


def sq(x: torch.Tensor) -> float:
    return float(x.pow(2).sum())


def analyse(model, rec: Recorder) -> list[dict]:
    ids = rec.plan.ids
    n = ids.shape[0]
    full = model.new_cache(n)
    model(ids, full, logits_for="none")
    rows = []
    for L in rec.layers:
        layer, moved, sp = L["layer"], L["moved"], L["sample_pos"]
        row = {"layer": layer, "n_moved": int(moved.numel()), "n_sample": int(sp.numel()), "loo": L["loo"]}
        for j, name in enumerate(("k", "v")):
            stale, applied, fresh = L["stale"][j], L["applied"][j], L["fresh"][j]
            truth = (full.keys, full.values)[j][layer][:, : stale.shape[1]].float()
            e = truth - stale
            row[name] = {
                "moved_before": sq(e[:, moved]) / max(1, moved.numel()),
                "moved_after": sq(e[:, moved] - applied[:, moved]) / max(1, moved.numel()),
                "sample_true": sq(e[:, sp]) / max(1, sp.numel()),
                "sample_fresh_vs_full": sq(fresh - truth[:, sp]) / max(1, sp.numel()),
                "sample_est": sq(fresh - stale[:, sp]) / max(1, sp.numel()),
                "shift_norm": sq(applied[:, moved]) / max(1, moved.numel()),
            }
        row["attn"] = attention_errors(L, full, layer, n)
        row["estimated"] = L["estimated"]
        rows.append(row)
    return rows


def attention_errors(L: dict, full, layer: int, n: int) -> dict:
    """Σ|out − full's out|² over the question rows' attention output at this layer (their own
    queries, the blend's), over the cache with the shift, without it, and with K or V shifted alone."""
    from kvblend.models.attention import attend, causal_mask
    q, qp = L["q"], L["q_pos"]
    if q.numel() == 0:
        return {}
    fk, fv = full.keys[layer][:, :n].float(), full.values[layer][:, :n].float()
    w = L["written"]
    def cache(j, shifted):
        x = L["stale"][j] + (L["applied"][j] if shifted else 0)
        x = x.clone()
        x[:, w] = L["kv"][j]
        return x
    mask = causal_mask(qp, torch.arange(n))
    ref = attend(q, fk, fv, mask)
    out = {}
    choices = (("none", False, False), ("both", True, True), ("k_only", True, False), ("v_only", False, True))
    for name, ks, vs in choices:
        err = (attend(q, cache(0, ks), cache(1, vs), mask) - ref).pow(2)  # (Tq, Hq*d)
        out[name] = err.view(err.shape[0], fk.shape[0], -1).sum(dim=(0, 2)).tolist()  # per KV head
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dataset", default=str(DATA))
    ap.add_argument("--ids", required=True)
    ap.add_argument("--method", default="blend:0.15:q+budget+sinks4+shiftq",
                    help="the blend; with +shiftq the question test only observes (its estimates are "
                         "recorded, the shift is the default's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = [int(x) for x in args.ids.split(",")]
    rec = Recorder()
    engine = Engine(load_model(args.model))
    rec.watch(engine.model)
    examples = load_musique(args.dataset, n_docs=6, limit=max(ids) + 1)
    spec = parse_method(args.method)
    try:
        for i in ids:
            ex = examples[i]
            warm_documents(engine, ex, [spec])
            rec.reset()
            engine.prepare(example_request(ex, spec), 1)
            for row in analyse(engine.model, rec):
                line = json.dumps({"id": ex.id, "method": args.method, **row})
                print(line, flush=True)
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    with (Path(args.out) / "probe.jsonl").open("a") as f:
                        f.write(line + "\n")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
