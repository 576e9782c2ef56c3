"""Evaluation runs: a dataset through a list of methods, scored against full prefill,
written to a directory that a rerun resumes.

    out/examples.jsonl   one line per example × method, written and flushed when done
    out/summary.json     per method: every metric averaged, plus n
    out/run.json         dataset, model, settings, machine, compute time
    out/report.md        tables, and the quality-vs-TTFT plot (quality_vs_ttft.png)

A rerun skips the example × method pairs already in examples.jsonl; a half-written last
line (a crash mid-write) is dropped; a rerun whose settings differ (`RESUME_KEYS`: the
dataset, the model, its dtype and device, the shift test's verdict, lengths, layout) is
refused, as is a second process on the same directory (``out/.lock``); a method spelt
another way (``blend:.15`` for ``blend:0.15``) reuses the records of its first spelling. Full prefill is always run: it is the reference every other method is scored
against (`kvblend.eval.runner`). An example a method cannot run (a prompt past the
context, ...) stops the run naming the example, or with ``skip_errors`` is recorded as an
``error`` record and left out of the means. A run stopped by an error or Ctrl-C still
writes the summary and report of what it finished (marked partial).

    kvblend eval --dataset PATH|synthetic:n=..,docs=..,doc_tokens=.. \\
        --methods full,prefix,reuse,blend:0.15,mapreduce,maprerank --out DIR [--layout after|before|inline]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvblend.blend.config import check_layers_fit
from kvblend.cliargs import add_model_args, load_from_args
from kvblend.engine import Engine, Request
from kvblend.errors import KvblendError
from kvblend.eval.baselines import BaselineConfig, score_baseline
from kvblend.eval.datasets import LAYOUTS, Example, check_layout, load_dataset, musique_prompt, parse_app_chunks
from kvblend.eval.report import Summary, machine_info, summarize, write_report
from kvblend.eval.runner import (
    BASELINES, MethodSpec, Reference, parse_method, reference, score_method, split_methods, warm_documents,
)
from kvblend.store.codec import STORAGE_DTYPES
from kvblend.store.config import StoreConfig, build_store

EXAMPLES_FILE = "examples.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"
DEFAULT_METHODS = ("full", "prefix", "reuse", "blend:0.15")
# must not change when a run resumes
RESUME_KEYS = ("dataset", "model", "dtype", "device", "shift", "n_docs", "store", "max_tokens", "kl_tokens",
               "map_tokens", "layout")
# what a run.json written before the key existed was computed with (`kvblend eval` stored KV in fp32 then)
RESUME_DEFAULTS = {"layout": "after", "store": "memory, KV fp32"}

Record = dict[str, Any]


@dataclass(frozen=True)
class EvalConfig:
    """Which methods to run and how long answers may be. ``methods`` are `parse_method`
    specs (``full`` is added first when missing); ``kl_tokens`` full-prefill answer
    tokens are teacher-forced for KL; ``map_tokens`` caps MapReduce's per-document notes;
    ``layout`` places the question ``after`` the documents (the paper's prompt) or
    ``before`` them (`datasets.musique_prompt`), or ``inline``: after them, with the
    passages pasted into the user message's text and found there by matching
    (`runner.inline_request`), for every method and the reference."""

    methods: tuple[str, ...] = DEFAULT_METHODS
    max_tokens: int = 32
    kl_tokens: int | None = None  # default_kl_tokens(max_tokens)
    map_tokens: int = 32
    progress: bool = True
    layout: str = "after"
    skip_errors: bool = False

    def __post_init__(self) -> None:
        check_layout(self.layout)
        object.__setattr__(self, "methods", tuple(self.methods))
        if not self.methods:
            raise ValueError("give at least one method")
        seen: dict[tuple[str, Any], str] = {}
        for spec in self.specs:  # compared as parsed: the same method spelt twice would run twice
            key = method_key(spec)
            if key in seen:
                raise ValueError(f"methods repeat: {seen[key]!r} and {spec.label!r} are the same method")
            seen[key] = spec.label
        lengths = BaselineConfig(self.map_tokens, self.max_tokens, self.kl_tokens)  # validates them
        object.__setattr__(self, "kl_tokens", lengths.kl_tokens)

    @property
    def specs(self) -> list[MethodSpec]:
        specs = [parse_method(m) for m in self.methods]
        return specs if any(s.label == "full" for s in specs) else [parse_method("full"), *specs]

    @property
    def baseline(self) -> BaselineConfig:
        return BaselineConfig(self.map_tokens, self.max_tokens, self.kl_tokens, self.layout)


def method_key(spec: MethodSpec) -> tuple[str, Any]:
    """What a method is, whatever its spelling (``blend:0.15`` and ``blend:.15`` are one)."""
    return spec.method, spec.blend


class EvalResult(NamedTuple):
    out_dir: Path
    records: list[Record]  # this run's examples × methods, in order
    summary: Summary
    computed: int  # pairs computed now (the others were read back from examples.jsonl)


# ----- the results file -------------------------------------------------------------
def read_records(path: Path) -> list[Record]:
    """Every complete line of a results file. A corrupt or half-written last line (a
    crash mid-write) is cut from the file so that appending can go on; a corrupt line
    elsewhere raises ValueError."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    records: list[Record] = []
    end = 0
    for i, line in enumerate(lines):
        try:
            if line.strip():
                records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: corrupt line in the results file") from None
            break
        end += len(line)
    _repair(path, data, end)
    return records


def _repair(path: Path, data: bytes, end: int) -> None:
    """Cut the file to its first ``end`` bytes and make it end with a newline."""
    newline = end > 0 and not data[:end].endswith(b"\n")
    if end == len(data) and not newline:
        return
    with path.open("r+b") as f:
        f.truncate(end)
        if newline:
            f.seek(end)
            f.write(b"\n")


def append_record(path: Path, record: Record) -> None:
    """Write one line and flush it to the OS at once."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


# ----- one example ------------------------------------------------------------------
def warm_prefix(engine: Engine, layout: str = "after") -> None:
    """Put the system prompt into the prefix cache (a server has it cached), so that the
    first example does not pay for it in some methods and not in others. With the question
    ``before`` the documents only the part ahead of the question is shared (radix tree)."""
    system, query = musique_prompt("warm-up", layout)
    engine.prepare(Request(documents=[], question=query, system=system, method="prefix"))


def score_spec(engine: Engine, ex: Example, spec: MethodSpec, ref: Reference, config: EvalConfig) -> Record:
    """One method on one example, scored against full prefill's ``ref``."""
    if spec.method in BASELINES:
        return score_baseline(engine, ex, spec.method, ref, config.baseline)
    return score_method(engine, ex, spec, ref, config.max_tokens, config.kl_tokens, config.layout)


def run_pending(engine: Engine, ex: Example, todo: Sequence[MethodSpec], config: EvalConfig,
                emit: Callable[[Record], None]) -> None:
    """Score the methods ``todo`` on ``ex``; ``emit`` gets each record as soon as it is done.
    An error a user can act on (the example's prompt past the context, ...) is raised as a
    ValueError naming the example, or with ``config.skip_errors`` emitted as an ``error``
    record for the method that raised it (for every method when full prefill's reference
    did)."""
    def failed(specs: Sequence[MethodSpec], exc: Exception) -> None:
        if not config.skip_errors:
            raise ValueError(f"example {ex.id!r}: {exc} (--skip-errors records it and goes on)") from exc
        for spec in specs:
            emit({"example_id": ex.id, "method": spec.label, "gold": list(ex.answers), "error": str(exc)})

    try:
        warm_documents(engine, ex, todo, config.layout)
        engine.flush()
        ref, full = reference(engine, ex, config.max_tokens, config.kl_tokens, config.layout)
    except (KvblendError, ValueError) as exc:  # no reference: no method can be scored
        return failed(todo, exc)
    for spec in todo:
        try:
            scores = full if spec.label == "full" else score_spec(engine, ex, spec, ref, config)
        except (KvblendError, ValueError) as exc:
            failed([spec], exc)
            continue
        emit({"example_id": ex.id, "method": spec.label, "gold": list(ex.answers), **scores})


def _check_ids(examples: Sequence[Example]) -> None:
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids must be unique to resume a run")


def _progress(total: int, done: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, file=sys.stderr, desc=desc, unit="run",
                dynamic_ncols=True)


# ----- a run ------------------------------------------------------------------------
class _Sink:
    """Appends each finished record to the results file and advances the progress bar."""

    def __init__(self, path: Path, done: dict[tuple[str, str], Record], bar: Any) -> None:
        self.path, self.done, self.bar, self.computed = path, done, bar, 0

    def __call__(self, record: Record) -> None:
        append_record(self.path, record)
        self.done[(record["example_id"], record["method"])] = record
        self.computed += 1
        self.bar.set_postfix_str(f"{record['example_id']} {record['method']}", refresh=False)
        self.bar.update()


def _read_results(out: Path) -> list[Record]:
    """The records of ``out``; a line that is JSON but no record is a ValueError naming it."""
    records = read_records(out / EXAMPLES_FILE)
    for i, r in enumerate(records, 1):
        if not (isinstance(r, dict) and isinstance(r.get("example_id"), str) and isinstance(r.get("method"), str)):
            raise ValueError(f"{out / EXAMPLES_FILE}: record {i} is not an evaluation record")
    return records


def _relabel(records: list[Record], specs: Sequence[MethodSpec]) -> list[Record]:
    """Records of a method asked for now under another spelling take its label (records are
    keyed by label: a resume with ``blend:.15`` reuses ``blend:0.15``'s results, in memory;
    the file keeps what it was written with)."""
    labels = {method_key(s): s.label for s in specs}
    for r in records:
        try:
            label = labels.get(method_key(parse_method(r["method"])))
        except ValueError:  # a method this version no longer parses: left as it is
            continue
        if label is not None:
            r["method"] = label
    return records


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold ``out`` for this process: two runs appending to one results file would
    interleave and compute every pair twice."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another kvblend eval is writing to {out}; wait for it or use another "
                             "output directory") from None
        yield  # the lock goes with the file's close


def _read_run(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def engine_meta(engine: Engine) -> dict[str, Any]:
    """What of the engine decides the numbers: its compute dtype, device and the shift
    test's verdict (``Engine.blend_config`` drops the shift where it does not help)."""
    verdict = engine.shift_verdict
    shift = "untested" if verdict is None else ("kept" if verdict.helps else "dropped")
    return {"model": engine.loaded.name, "dtype": str(engine.model.dtype).removeprefix("torch."),
            "device": str(engine.model.device), "shift": shift}


def _open_run(out: Path, examples: Sequence[Example], config: EvalConfig,
              meta: dict[str, Any]) -> tuple[dict[str, Any], dict[tuple[str, str], Record]]:
    """Settings of this run, and the records already done (checked to be compatible)."""
    out.mkdir(parents=True, exist_ok=True)
    _check_ids(examples)
    meta = {**meta, "max_tokens": config.max_tokens, "kl_tokens": config.kl_tokens, "map_tokens": config.map_tokens,
            "layout": config.layout}
    done = {(r["example_id"], r["method"]): r for r in _relabel(_read_results(out), config.specs)}
    before = _read_run(out) if done else {}
    if done and not before:
        raise ValueError(f"{out} holds results but no readable {RUN_FILE}: what they were computed with is "
                         "unknown; use another output directory")
    check_resumable(out, before, meta)
    meta["compute_s"] = before.get("compute_s", 0.0)  # summed over the invocations that added results
    (out / RUN_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta, done


def evaluate_examples(engine: Engine, examples: Sequence[Example], out_dir: str | Path,
                      config: EvalConfig = EvalConfig(), meta: dict[str, Any] | None = None) -> EvalResult:
    """Run every example × method not yet in ``out_dir/examples.jsonl``, then write the
    summary, run.json and the report. ``meta`` (dataset, model, ...) goes into run.json
    and the report; a rerun with other `RESUME_KEYS` settings, or a second process on the
    same ``out_dir``, raises ValueError."""
    check_methods(engine, config.specs, examples)
    with _exclusive(Path(out_dir)):
        return _evaluate_examples(engine, examples, Path(out_dir), config, meta)


def _evaluate_examples(engine: Engine, examples: Sequence[Example], out: Path, config: EvalConfig,
                       meta: dict[str, Any] | None) -> EvalResult:
    specs, start = config.specs, time.perf_counter()
    engine_keys = engine_meta(engine)
    if not any(s.method == "blend" and s.blend.shift for s in specs):
        engine_keys.pop("shift")  # no method here asks for the shift: its verdict changes none of them
    meta, done = _open_run(out, examples, config, {**(meta or {}), **engine_keys})
    pending = [(ex, [s for s in specs if _to_run(done.get((ex.id, s.label)))]) for ex in examples]
    total = len(examples) * len(specs)
    bar = _progress(total, total - sum(len(todo) for _, todo in pending), config.progress, out.name)
    sink = _Sink(out / EXAMPLES_FILE, done, bar)
    finished = False
    try:
        if any(todo for _, todo in pending):
            warm_prefix(engine, config.layout)
        for ex, todo in pending:
            if todo:
                run_pending(engine, ex, todo, config, sink)
        finished = True
    finally:  # an error or Ctrl-C: what is done is summarised, the time spent counted
        bar.close()
        if sink.computed:
            meta["compute_s"] += time.perf_counter() - start
        if not finished:
            ran = sum((ex.id, s.label) in done for ex in examples for s in specs)
            meta["partial"] = f"stopped after {ran} of {total} runs; rerun the same command to resume"
            print(f"kvblend eval: {meta['partial']} (results so far in {out}/)", file=sys.stderr)
            try:
                _finish(out, examples, specs, done, sink.computed, meta)
            except Exception as exc:  # noqa: BLE001 - the error that stopped the run is the one to see
                print(f"kvblend eval: the partial report could not be written: {exc}", file=sys.stderr)
    meta.pop("partial", None)
    return _finish(out, examples, specs, done, sink.computed, meta)


def dataset_meta(dataset: str, n_docs: int | None) -> dict[str, Any]:
    """The dataset as run.json records it: a file by its absolute path (so that a rerun
    from another folder, or by a relative path, resumes), a synthetic spec as given."""
    return {"dataset": _dataset_name(dataset), "n_docs": n_docs or "dataset default"}


def _dataset_name(dataset: Any) -> Any:
    if not isinstance(dataset, str) or dataset.startswith("synthetic:"):
        return dataset
    return str(Path(dataset).resolve())


def _to_run(record: Record | None) -> bool:
    """Whether a pair is (re)computed: not done yet, or its record is an error (its cause
    may be fixed; the new record, appended, replaces it)."""
    return record is None or "error" in record


def check_resumable(out: Path, before: dict[str, Any], meta: dict[str, Any]) -> None:
    """Refuse to add to results computed with other settings (`RESUME_KEYS`; a key an
    older run.json lacks counts as its `RESUME_DEFAULTS` value; dataset paths compared
    resolved)."""
    if before:
        before = {**RESUME_DEFAULTS, **before}

    def same(key: str) -> bool:
        if key == "dataset":
            return _dataset_name(before[key]) == _dataset_name(meta[key])
        if key == "kl_tokens" and isinstance(before.get("max_tokens"), int):  # what KL was taken over
            return min(before[key], before["max_tokens"]) == meta[key]
        return before[key] == meta[key]

    changed = [k for k in RESUME_KEYS if k in before and k in meta and not same(k)]
    if changed:
        diff = ", ".join(f"{k}: {before[k]!r} -> {meta[k]!r}" for k in changed)
        raise ValueError(f"{out} holds results computed with other settings ({diff}); use another output directory")


def check_methods(engine: Engine, specs: Sequence[MethodSpec], examples: Sequence[Example]) -> None:
    """Before any model work: every method can run on this model and on these examples
    (a check layer past the model, a baseline on an example without documents)."""
    layers = engine.model.cfg.num_layers
    for spec in specs:
        blend = spec.blend
        if spec.method == "blend":
            check_layers_fit(blend.check_layers, layers, f"method {spec.label!r}: check layers")
        if spec.method in BASELINES:
            empty = next((ex.id for ex in examples if not ex.documents), None)
            if empty is not None:
                raise ValueError(f"method {spec.label!r} needs documents; example {empty!r} has none")


def _finish(out: Path, examples: Sequence[Example], specs: Sequence[MethodSpec], done: dict, computed: int,
            meta: dict[str, Any]) -> EvalResult:
    records = [done[(ex.id, s.label)] for ex in examples for s in specs if (ex.id, s.label) in done]
    summary = summarize(records, [s.label for s in specs])
    others = len(done) - len(records)
    if others:  # a rerun with fewer examples or methods: say that the report is a subset
        meta = {**meta, "subset": f"this report covers {len(records)} of the {len(done)} results in {out}"}
        print(f"kvblend eval: note: {meta['subset']} (the examples and methods asked for)", file=sys.stderr)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    meta = {"title": "kvblend evaluation", **meta, "examples": len(examples),
            "methods": ", ".join(s.label for s in specs), "machine": _machine_line()}
    (out / RUN_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    write_report(out, summary, meta)
    return EvalResult(out, records, summary, computed)


def _machine_line() -> str:
    m = machine_info()
    return f"{m['nproc']} CPUs ({m['cpu']}), torch {m['torch']} with {m['torch_threads']} threads"


def evaluate(dataset: str, out_dir: str | Path, config: EvalConfig = EvalConfig(), model: str | None = None,
             limit: int | None = None, n_docs: int | None = None, engine: Engine | None = None) -> EvalResult:
    """Load ``dataset`` (`load_dataset` spec) and, unless ``engine`` is given, ``model``
    (default: the packaged default model); run `evaluate_examples`."""
    examples = load_dataset(dataset, limit=limit, n_docs=n_docs)
    own = engine is None
    if own:
        from kvblend.models import DEFAULT_MODEL, load_model

        engine = Engine(load_model(model or DEFAULT_MODEL))
    meta = dataset_meta(dataset, n_docs)
    try:
        return evaluate_examples(engine, examples, out_dir, config, meta)
    finally:
        if own:
            engine.close()


# ----- command line -----------------------------------------------------------------
def add_eval_commands(sub: Any) -> None:
    """Register ``kvblend eval`` on the CLI's subparsers."""
    p = sub.add_parser("eval", help="score methods against full prefill on a dataset; resumable")
    p.add_argument("--dataset", required=True, help="MuSiQue .json, .jsonl, or synthetic:n=..,docs=..,doc_tokens=..")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated: full, prefix, reuse, blend[:RATIOS[@LAYERS]][:SIGNAL|q|oracle]"
                        "[+budget][+sinksK][+shift][+vdev[W]], cacheblend[:RATIO], mapreduce, maprerank "
                        "(default: %(default)s)")
    p.add_argument("--out", required=True, help="output directory (rerun to resume)")
    p.add_argument("--limit", type=int, default=None, help="first N examples")
    p.add_argument("--docs", type=int, default=None, help="documents per example (MuSiQue default: 6)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kl-tokens", type=int, default=None,
                   help="full prefill's answer tokens teacher-forced for KL (default: 8, or --max-tokens if fewer)")
    p.add_argument("--map-tokens", type=int, default=32, help="MapReduce note length")
    p.add_argument("--layout", choices=LAYOUTS, default="after",
                   help="the question after the documents (the paper's prompt), before them, or after them "
                        "with the passages pasted into the message text as RAG frameworks do, found there by "
                        "matching (inline) (default: %(default)s)")
    p.add_argument("--app-chunks", metavar="CHARS[:OVERLAP]", default=None,
                   help="with --layout inline: cut each passage as an app cuts it (sentence ends, chunks of at "
                        "most CHARS characters overlapping by OVERLAP) before pasting; the whole passages are "
                        "what was stored, so matching reuses runs of them")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--skip-errors", action="store_true",
                   help="an example a method cannot run (a prompt past the context, ...) is recorded as an error "
                        "and the run goes on (default: the run stops, naming it)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="run +shift as asked on every model (default: dropped on a model whose test "
                        "found it does not help, as the server does)")
    p.add_argument("--kv-dtype", choices=sorted(STORAGE_DTYPES), default=None,
                   help="how the chunk KV is stored (memory tier) (default: store.kv_dtype, as the server)")
    add_model_args(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    layout = args.layout
    if args.app_chunks is not None:
        if layout != "inline":
            raise ValueError("--app-chunks cuts the passages pasted into the message: it needs --layout inline")
        layout = "inline:{}:{}".format(*parse_app_chunks(args.app_chunks))
    config = EvalConfig(tuple(split_methods(args.methods)), args.max_tokens, args.kl_tokens, args.map_tokens,
                        not args.no_progress, layout, args.skip_errors)
    if not args.out.strip():
        raise ValueError("--out needs a directory (an empty one would write into the current folder)")
    examples = load_dataset(args.dataset, limit=args.limit, n_docs=args.docs)  # before the model: fails at once
    store = eval_store(args.kv_dtype)
    engine = Engine(load_from_args(args), store=build_store(store), calibrate=not args.no_calibrate)
    start = time.perf_counter()
    meta = {**dataset_meta(args.dataset, args.docs), "store": f"memory, KV {store.kv_dtype}"}
    try:
        result = evaluate_examples(engine, examples, args.out, config, meta)
    finally:
        engine.close()
    _print_summary(result, time.perf_counter() - start)
    return 0


def eval_store(kv_dtype: str | None) -> StoreConfig:
    """The evaluation's chunk store: the memory tier alone (nothing read from or left on
    disk), KV stored in ``kv_dtype`` (None: the settings' ``store.kv_dtype``, what
    ``kvblend serve`` stores)."""
    from kvblend.settings import Settings

    return StoreConfig(tiers=("memory",), kv_dtype=kv_dtype or Settings.load().store.kv_dtype)


def _print_summary(result: EvalResult, elapsed: float) -> None:
    print(f"{result.computed} runs computed in {elapsed:.1f} s; results in {result.out_dir}/")
    print(f"{'method':22s} {'n':>3s} {'agree_f1':>8s} {'kl':>8s} {'gold_f1':>7s} {'ttft_s':>7s} failed")
    for label, s in result.summary.items():
        vals = [s.get(k) for k in ("agree_f1", "kl", "gold_f1", "ttft_s")]
        cells = ["       –" if v is None else f"{v:8.3f}" for v in vals]
        failed = f"{s['errors']} errors, {s['nonfinite']} non-finite" if s["errors"] or s["nonfinite"] else ""
        print(f"{label:22s} {s['n']:3d} {' '.join(cells)} {failed}")
