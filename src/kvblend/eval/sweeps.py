"""Sensitivity sweeps after the CacheBlend paper's figures: recompute ratio, number of
documents, document length, check layers / schedule, deviation signal, storage tier and
KV storage dtype.

A sweep is a list of points, each read from one *run* (`RunSpec`: a dataset, methods
and a store, evaluated by `harness.evaluate_examples` into ``out/runs/<name>/``, hence
resumable). Runs are shared: the ratio, schedule and signal sweeps can all read one run
whose methods are the union of their points, so full prefill (the reference) is
computed once per example. A point either follows one method label of its run
(method sweeps) or every method of its run (setting sweeps, one line per method).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvblend.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import EvalConfig, EvalResult, evaluate_examples
from kvblend.eval.report import COLUMNS, Column, markdown_table, plot_lines
from kvblend.models.loader import LoadedModel
from kvblend.store.config import TIER_NAMES, StoreConfig, build_store

SWEEP_COLUMNS = tuple(c for c in COLUMNS if c.key not in ("n", "speedup", "rouge_l", "gold_nll"))


@dataclass(frozen=True)
class StoreSpec:
    """Where chunk KV lives during a run: one tier and the KV storage dtype."""

    tier: str = "memory"
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.tier not in TIER_NAMES:
            raise ValueError(f"tier must be one of {TIER_NAMES}, got {self.tier!r}")
        StoreConfig(kv_dtype=self.kv_dtype)  # validates the dtype


@dataclass(frozen=True)
class RunSpec:
    """One evaluation run: ``dataset`` (a `load_dataset` spec) with ``n_docs``/``limit``,
    ``methods`` (`parse_method` specs), and the chunk store. ``name`` is its directory."""

    name: str
    dataset: str
    methods: tuple[str, ...]
    n_docs: int | None = None
    limit: int | None = None
    store: StoreSpec = field(default_factory=StoreSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.name or "/" in self.name:
            raise ValueError(f"run name must be a non-empty directory name, got {self.name!r}")


class SweepPoint(NamedTuple):
    x: float | str
    run: RunSpec
    method: str | None = None  # one label of the run, or None: every method is a line
    series: str | None = None  # the line of a method point (default: the sweep's series)


@dataclass(frozen=True)
class Sweep:
    """``points`` over ``x_label``; ``metrics`` are plotted, one panel each."""

    name: str
    title: str
    x_label: str
    points: tuple[SweepPoint, ...]
    metrics: tuple[str, ...] = ("agree_f1", "kl")
    series: str = "blend"  # the line name of method points

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(self.points))
        for p in self.points:
            if p.method is not None and p.method not in p.run.methods:
                raise ValueError(f"sweep {self.name!r}: {p.method!r} is not a method of run {p.run.name!r}")


# ----- builders ---------------------------------------------------------------------
def method_sweep(name: str, title: str, x_label: str, run: RunSpec, points: Sequence[tuple[float | str, str]],
                 metrics: Sequence[str] = ("agree_f1", "kl")) -> Sweep:
    """Points that each follow one method label of ``run``: ``(x, label)`` pairs."""
    return Sweep(name, title, x_label, tuple(SweepPoint(x, run, label) for x, label in points), tuple(metrics))


def ratio_points(ratios: Sequence[float]) -> list[tuple[float, str]]:
    """(ratio, ``blend:ratio``) for the recompute-ratio sweep."""
    return [(r, f"blend:{r:g}") for r in ratios]


def strategy_labels(strategy: str, ratios: Sequence[float]) -> list[tuple[float, str]]:
    """(ratio, label) for a strategy template: ``{r}`` stands for the ratio
    (``blend:{r}:q+shift``, ``cacheblend:{r}``)."""
    return [(r, strategy.format(r=f"{r:g}")) for r in ratios]


def strategy_sweep(run: RunSpec, strategies: Sequence[str], ratios: Sequence[float],
                   metrics: Sequence[str] = ("kl", "agree_f1", "first_token_agree")) -> Sweep:
    """Selection strategies x recompute ratios on one run: one line per strategy template."""
    points = tuple(SweepPoint(r, run, label, strategy.replace(":{r}", ""))
                   for strategy in strategies for r, label in strategy_labels(strategy, ratios))
    return Sweep("strategies", "Selection strategies vs recompute ratio", "recompute ratio", points, tuple(metrics))


def pareto(summary: dict[str, dict[str, Any]], cost: str = "ttft_over_full", quality: str = "kl",
           reference: str = "full") -> list[dict[str, Any]]:
    """Every method but ``reference`` with its TTFT over the reference's (mean over mean)
    and ``frontier``: no other method is at most as slow and at most as far (KL) with one
    strictly better. Sorted by cost."""
    ref = summary[reference]["ttft_s"]
    rows = [{"method": label, **s, cost: s["ttft_s"] / ref} for label, s in summary.items()
            if label != reference and s.get("ttft_s") is not None and s.get(quality) is not None]
    for r in rows:
        r["frontier"] = not any(o[cost] <= r[cost] and o[quality] <= r[quality]
                                and (o[cost] < r[cost] or o[quality] < r[quality]) for o in rows)
    return sorted(rows, key=lambda r: r[cost])


def setting_sweep(name: str, title: str, x_label: str, runs: Sequence[tuple[float | str, RunSpec]],
                  metrics: Sequence[str] = ("ttft_s", "agree_f1")) -> Sweep:
    """Points that each are a whole run (one line per method)."""
    return Sweep(name, title, x_label, tuple(SweepPoint(x, run) for x, run in runs), tuple(metrics))


def docs_runs(dataset: str, counts: Sequence[int], methods: Sequence[str], limit: int) -> list[tuple[int, RunSpec]]:
    """One run per number of documents of ``dataset``."""
    return [(n, RunSpec(f"docs-{n}", dataset, tuple(methods), n_docs=n, limit=limit)) for n in counts]


def length_runs(lengths: Sequence[int], n_docs: int, n: int, methods: Sequence[str]) -> list[tuple[int, RunSpec]]:
    """One run per synthetic document length (tokens, estimated by the generator)."""
    return [(t, RunSpec(f"length-{t}", f"synthetic:n={n},docs={n_docs},doc_tokens={t}", tuple(methods)))
            for t in lengths]


def store_run(dataset: str, store: StoreSpec, methods: Sequence[str], limit: int,
              n_docs: int | None = None) -> RunSpec:
    """A run on ``store``, named ``store-TIER-DTYPE`` so that tier and dtype sweeps share runs."""
    return RunSpec(f"store-{store.tier}-{store.kv_dtype}", dataset, tuple(methods), n_docs, limit, store)


# ----- running ----------------------------------------------------------------------
@contextmanager
def open_store(spec: StoreSpec, workdir: Path | None = None) -> Iterator[Any]:
    """A fresh chunk store of ``spec`` (disk: a temporary directory; redis: a private
    local ``redis-server``, `kvblend.store.localredis`), closed on exit."""
    if spec.tier == "redis":
        from kvblend.store.localredis import LocalRedis

        with LocalRedis() as server:
            yield build_store(StoreConfig(tiers=("redis",), redis_url=server.url, redis_timeout_s=60.0,
                                          kv_dtype=spec.kv_dtype))
    elif spec.tier == "disk":
        with tempfile.TemporaryDirectory(prefix="kvblend-sweep-", dir=workdir) as d:
            yield build_store(StoreConfig(tiers=("disk",), disk_dir=d, kv_dtype=spec.kv_dtype))
    else:
        yield build_store(StoreConfig(tiers=("memory",), kv_dtype=spec.kv_dtype))


def run_spec(loaded: LoadedModel, run: RunSpec, out_dir: Path, config: EvalConfig) -> EvalResult:
    """Evaluate ``run`` into ``out_dir`` with a fresh engine (own store and prefix cache)."""
    examples = load_dataset(run.dataset, n_docs=run.n_docs, limit=run.limit)
    config = replace(config, methods=run.methods)  # the run's methods, the rest (layout too) as given
    meta = {"title": f"run {run.name}", "dataset": run.dataset, "model": loaded.name,
            "n_docs": run.n_docs or "dataset default", "store": f"{run.store.tier}, KV {run.store.kv_dtype}"}
    with open_store(run.store, out_dir.parent) as store:
        engine = Engine(loaded, store=store)
        try:
            return evaluate_examples(engine, examples, out_dir, config, meta)
        finally:
            engine.close()


def distinct_runs(sweeps: Sequence[Sweep]) -> list[RunSpec]:
    """The runs the sweeps read, each once, in first-use order; one name, one spec."""
    runs: dict[str, RunSpec] = {}
    for sweep in sweeps:
        for p in sweep.points:
            if runs.setdefault(p.run.name, p.run) != p.run:
                raise ValueError(f"two different runs are named {p.run.name!r}")
    return list(runs.values())


def sweep_rows(sweep: Sweep, summaries: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per point and line: ``x``, ``series``, ``method`` and the averaged metrics."""
    rows = []
    for p in sweep.points:
        summary = summaries[p.run.name]
        for label in [p.method] if p.method else list(summary):
            series = (p.series or sweep.series) if p.method else label
            rows.append({"x": p.x, "series": series, "method": label, **summary[label]})
    return rows


class SweepResult(NamedTuple):
    sweep: Sweep
    rows: list[dict[str, Any]]
    plot: Path


def run_sweeps(loaded: LoadedModel, sweeps: Sequence[Sweep], out_dir: str | Path,
               config: EvalConfig = EvalConfig()) -> list[SweepResult]:
    """Evaluate every run the sweeps need (``out/runs/<name>``, resumable), then write
    ``out/sweeps.json`` and one plot per sweep (``out/sweep_<name>.png``)."""
    out = Path(out_dir)
    summaries = {run.name: run_spec(loaded, run, out / "runs" / run.name, config).summary
                 for run in distinct_runs(sweeps)}
    results = []
    for sweep in sweeps:
        rows = sweep_rows(sweep, summaries)
        plot = plot_lines(rows, sweep.x_label, sweep.metrics, out / f"sweep_{sweep.name}.png", sweep.title)
        results.append(SweepResult(sweep, rows, plot))
    dump = {r.sweep.name: r.rows for r in results}
    (out / "sweeps.json").write_text(json.dumps(dump, indent=2) + "\n", encoding="utf-8")
    return results


def sweep_table(result: SweepResult, columns: Sequence[Column] = SWEEP_COLUMNS) -> str:
    """A Markdown table of a sweep: x, method, then the metric columns."""
    rows = [{**r, "point": f"{r['x']} · {r['method']}"} for r in result.rows]
    return markdown_table(rows, columns, Column("point", result.sweep.x_label, "{}"))
