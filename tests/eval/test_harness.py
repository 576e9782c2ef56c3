"""The evaluation harness on the tiny random model: files, summary, resume, CLI, sweeps."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvblend.engine import Engine
from kvblend.eval.datasets import Example
from kvblend.eval.harness import EXAMPLES_FILE, EvalConfig, evaluate, evaluate_examples, read_records
from kvblend.eval.report import SUMMARY_KEYS
from kvblend.eval.runner import parse_method, split_methods
from kvblend.eval.sweeps import (
    RunSpec, StoreSpec, Sweep, SweepPoint, distinct_runs, method_sweep, ratio_points, run_sweeps, setting_sweep,
    store_run,
)
from tests.conftest import make_loaded

DOCS = ("the doctor led the project alpha in north paris .", "project alpha was approved in the city of lisbon .",
        "the company is headquartered in rome , west of the river .", "one two three blue green red .")
EXAMPLES = [Example("where was the project approved ?", DOCS[:3], ("lisbon",), "a"),
            Example("who led the project ?", DOCS[1:], ("the doctor",), "b")]
CONFIG = EvalConfig(methods=("full", "reuse", "blend:0.3"), max_tokens=4, kl_tokens=2, progress=False)


@pytest.fixture(scope="module")
def loaded():
    return make_loaded(seed=1)


@pytest.fixture
def engine(loaded) -> Engine:
    return Engine(loaded)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _count_prepares(engine: Engine) -> list[int]:
    calls = [0]
    prepare = engine.prepare

    def counted(*args, **kw):
        calls[0] += 1
        return prepare(*args, **kw)

    engine.prepare = counted  # type: ignore[method-assign]
    return calls


# ----- method grammar ---------------------------------------------------------------
def test_parse_method_grammar() -> None:
    assert parse_method("blend:0.15").blend.ratios == (0.15,)
    assert parse_method("blend:@2").blend.check_layers == (2,)  # the layer was dropped without a ratio
    single = parse_method("blend:0.2@2").blend
    assert (single.check_layers, single.ratios) == ((2,), (0.2,))
    prog = parse_method("blend:0.3,0.15@1,2:kv").blend
    assert (prog.check_layers, prog.schedule, prog.signal) == ((1, 2), (0.3, 0.15), "kv")
    assert parse_method("blend:0.5,0.2").blend.check_layers == (1, 2)
    assert parse_method("blend::k").blend.signal == "k"
    assert parse_method("maprerank").method == "maprerank"
    prompt = parse_method("blend:0.3:k+prompt")
    assert (prompt.label, prompt.blend.chunk_prefix, prompt.blend.signal) == ("blend:0.3:k+prompt", "prompt", "k")
    assert parse_method("reuse+prompt").blend.chunk_prefix == "prompt"
    for bad, message in [("blend:x", "ratios"), ("blend:0.1,0.3", "non-increasing"), ("blend:0.3,0.1@1,2,3", "schedule"),
                         ("blend:0.1:z", "signal"), ("nope", "unknown"), ("full:0.1", "only blend"),
                         ("full+prompt", "chunk prefix"), ("blend+middle", "chunk prefix")]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


def test_split_methods_keeps_schedules_whole() -> None:
    assert split_methods("full, prefix,blend:0.3,0.15@1,2:k,blend:0.15,mapreduce") == [
        "full", "prefix", "blend:0.3,0.15@1,2:k", "blend:0.15", "mapreduce"]


def test_config_validation() -> None:
    assert [s.label for s in EvalConfig(methods=("reuse",)).specs] == ["full", "reuse"]
    with pytest.raises(ValueError, match="repeat"):
        EvalConfig(methods=("reuse", "reuse"))
    with pytest.raises(ValueError, match="'blend:0.15' and 'blend:.15' are the same method"):
        EvalConfig(methods=("blend:0.15", "blend:.15"))  # ran twice under two labels
    with pytest.raises(ValueError, match="the same method"):
        EvalConfig(methods=("cacheblend:0.15", "blend:0.15@1:v"))
    assert len(EvalConfig(methods=("blend:0.15", "blend:0.3", "reuse", "reuse+prompt")).specs) == 5
    with pytest.raises(ValueError, match="max_tokens"):
        EvalConfig(max_tokens=0)
    with pytest.raises(ValueError, match="unknown"):
        EvalConfig(methods=("fast",))


# ----- a run ------------------------------------------------------------------------
def test_run_writes_records_summary_and_report(engine: Engine, tmp_path: Path) -> None:
    result = evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG, {"dataset": "tiny"})
    records = _lines(tmp_path / EXAMPLES_FILE)
    assert [(r["example_id"], r["method"]) for r in records] == [
        (e, m) for e in ("a", "b") for m in ("full", "reuse", "blend:0.3")]
    assert result.computed == 6 and result.records == records
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["full", "reuse", "blend:0.3"]
    for label, s in summary.items():
        assert s["n"] == 2 and set(SUMMARY_KEYS) <= set(s)
        mean_f1 = sum(r["agree_f1"] for r in records if r["method"] == label) / 2
        assert s["agree_f1"] == pytest.approx(mean_f1)
    assert summary["full"]["kl"] == 0.0 and summary["full"]["agree_f1"] == 1.0
    # the default blend counts both of its passes: with these few-token documents the question,
    # computed in each, weighs more than the documents, so only the order is asserted
    assert summary["reuse"]["recompute_frac"] < summary["blend:0.3"]["recompute_frac"]
    assert summary["full"]["recompute_frac"] == 1.0
    report = (tmp_path / "report.md").read_text()
    assert all(f"| {label} |" in report for label in summary)
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert images and all((tmp_path / image).stat().st_size > 1000 for image in images)
    assert json.loads((tmp_path / "run.json").read_text())["dataset"] == "tiny"


def test_rerun_skips_finished_pairs_and_adds_new_methods(engine: Engine, tmp_path: Path) -> None:
    evaluate_examples(engine, EXAMPLES, tmp_path, EvalConfig(("full", "reuse"), 4, 2, progress=False))
    compute_s = json.loads((tmp_path / "run.json").read_text())["compute_s"]
    calls = _count_prepares(engine)
    again = evaluate_examples(engine, EXAMPLES, tmp_path, EvalConfig(("full", "reuse"), 4, 2, progress=False))
    assert again.computed == 0 and calls[0] == 0
    assert json.loads((tmp_path / "run.json").read_text())["compute_s"] == compute_s > 0
    more = evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG)
    assert more.computed == 2  # blend:0.3 on each example; full is recomputed as the reference, not written
    pairs = [(r["example_id"], r["method"]) for r in _lines(tmp_path / EXAMPLES_FILE)]
    assert len(pairs) == len(set(pairs)) == 6
    assert more.summary["blend:0.3"]["n"] == 2


def test_a_resume_under_another_spelling_reuses_the_records(engine: Engine, tmp_path: Path) -> None:
    """Records are keyed by the method's label: ``blend:.3`` after ``blend:0.3`` recomputed
    every pair and reported the method twice over the results file."""
    evaluate_examples(engine, EXAMPLES, tmp_path, EvalConfig(("full", "blend:0.3"), 4, 2, progress=False))
    calls = _count_prepares(engine)
    again = evaluate_examples(engine, EXAMPLES, tmp_path, EvalConfig(("full", "blend:.3"), 4, 2, progress=False))
    assert again.computed == 0 and calls[0] == 0
    assert list(again.summary) == ["full", "blend:.3"] and again.summary["blend:.3"]["n"] == 2
    assert len(_lines(tmp_path / EXAMPLES_FILE)) == 4  # the file keeps what it was written with


def test_a_run_from_before_the_kl_bound_resumes(engine: Engine, tmp_path: Path) -> None:
    """A run.json written with kl_tokens 8 and max_tokens 3 took KL over 3 tokens: the
    new default (3) is the same setting, not another one."""
    evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, progress=False))
    run = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**run, "kl_tokens": 8}))
    assert evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, progress=False)).computed == 0


def test_a_second_run_on_the_same_folder_is_refused(engine: Engine, tmp_path: Path) -> None:
    """Two processes appending to one results file computed every pair twice, interleaved."""
    from kvblend.eval.harness import _exclusive

    with _exclusive(tmp_path):  # another process's run, as far as the lock can tell
        with pytest.raises(ValueError, match="another kvblend eval is writing to"):
            evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, 2, progress=False))
    assert not (tmp_path / EXAMPLES_FILE).exists()
    assert evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, 2, progress=False)).computed == 1


def test_kl_tokens_past_the_answer_are_refused_and_the_cli_default_follows_max_tokens(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """``--kl-tokens 8 --max-tokens 4`` took KL over 4 tokens, silently."""
    import kvblend.cli

    with pytest.raises(ValueError, match=r"kl_tokens \(8\) must be <= max_tokens \(4\)"):
        EvalConfig(("full",), max_tokens=4, kl_tokens=8)
    assert EvalConfig(("full",), max_tokens=4).kl_tokens == 4 and EvalConfig(("full",)).kl_tokens == 8
    assert EvalConfig(("full",), max_tokens=4).baseline.kl_tokens == 4
    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"documents": list(DOCS[:2]), "question": "q ?", "answers": ["a"], "id": "a"}))
    tiny = make_loaded(seed=1)
    monkeypatch.setattr(kvblend.cli, "_load", lambda args: tiny)
    argv = ["eval", "--dataset", str(data), "--methods", "reuse", "--out", str(tmp_path / "o"), "--no-progress"]
    assert kvblend.cli.main([*argv, "--max-tokens", "3"]) == 0  # --kl-tokens not given: 3, not 8
    assert json.loads((tmp_path / "o" / "run.json").read_text())["kl_tokens"] == 3
    assert kvblend.cli.main([*argv, "--max-tokens", "3", "--kl-tokens", "5"]) == 2


def test_half_written_last_line_is_dropped_and_recomputed(engine: Engine, tmp_path: Path) -> None:
    evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG)
    path = tmp_path / EXAMPLES_FILE
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a crash mid-write
    assert len(read_records(path)) == 5
    assert path.read_text() == "".join(lines[:-1])  # cut back to the last complete line
    path.write_text("".join(lines[:-1]) + lines[-1][:20] + "\n")  # a corrupt line, newline and all
    result = evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG)
    assert result.computed == 1
    assert [r["method"] for r in _lines(path)] == [json.loads(x)["method"] for x in lines]


def test_rerun_with_other_settings_is_refused(engine: Engine, tmp_path: Path) -> None:
    evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, 2, progress=False), {"dataset": "x"})
    with pytest.raises(ValueError, match="max_tokens: 3 -> 4"):
        evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 4, 2, progress=False), {"dataset": "x"})
    assert len(_lines(tmp_path / EXAMPLES_FILE)) == 1


def test_rerun_on_another_dtype_or_shift_verdict_is_refused(engine: Engine, tmp_path: Path) -> None:
    """A rerun with ``--dtype bfloat16`` (or ``--no-calibrate``) added its records to float32
    ones (or to ones where the shift test dropped the shift) under the same labels."""
    config = EvalConfig(("full", "blend:0.3"), 3, 2, progress=False)  # the default strategy: with the shift
    evaluate_examples(engine, EXAMPLES[:1], tmp_path, config, {"dataset": "x"})
    run = json.loads((tmp_path / "run.json").read_text())
    assert (run["dtype"], run["device"], run["shift"]) == ("float32", "cpu", "untested" if
                                                           engine.shift_verdict is None else run["shift"])
    for key, other in (("dtype", "bfloat16"), ("shift", "dropped")):
        (tmp_path / "run.json").write_text(json.dumps({**run, key: other}))
        with pytest.raises(ValueError, match=f"{key}: '{other}' -> "):
            evaluate_examples(engine, EXAMPLES, tmp_path, config, {"dataset": "x"})
    (tmp_path / "run.json").unlink()  # records whose settings are unknown are not added to
    with pytest.raises(ValueError, match="no readable run.json"):
        evaluate_examples(engine, EXAMPLES, tmp_path, config, {"dataset": "x"})
    assert len(_lines(tmp_path / EXAMPLES_FILE)) == 2


def test_a_dataset_file_resumes_by_any_path_to_it(engine: Engine, tmp_path: Path, monkeypatch) -> None:
    from kvblend.eval.harness import dataset_meta

    data = tmp_path / "d.jsonl"
    data.write_text("")
    config = EvalConfig(("full",), 3, 2, progress=False)
    evaluate_examples(engine, EXAMPLES[:1], tmp_path / "out", config, dataset_meta(str(data), None))
    assert "shift" not in json.loads((tmp_path / "out" / "run.json").read_text())  # no method here uses it
    monkeypatch.chdir(tmp_path)
    assert evaluate_examples(engine, EXAMPLES[:1], tmp_path / "out", config,
                             dataset_meta("d.jsonl", None)).computed == 0


def test_a_method_the_model_cannot_run_is_refused_before_any_work(engine: Engine, tmp_path: Path) -> None:
    calls = _count_prepares(engine)
    with pytest.raises(ValueError, match=r"check layers \[5\] must be below the model's 2 layers"):
        evaluate_examples(engine, EXAMPLES, tmp_path, EvalConfig(("full", "blend:0.2@5"), 3, 2, progress=False))
    bare = Example("q ?", (), ("x",), "bare")
    with pytest.raises(ValueError, match="'maprerank' needs documents; example 'bare' has none"):
        evaluate_examples(engine, [*EXAMPLES, bare], tmp_path, EvalConfig(("full", "maprerank"), 3, 2, progress=False))
    assert calls[0] == 0


HUGE = Example("what is it ?", ("word " * 400,), ("it",), "huge")  # past the tiny model's 256 positions


def test_an_example_that_fails_is_named_and_the_rest_is_summarised(engine: Engine, tmp_path: Path, capsys) -> None:
    config = EvalConfig(("full", "reuse"), 3, 2, progress=False)
    with pytest.raises(ValueError, match="example 'huge': .*context"):
        evaluate_examples(engine, [EXAMPLES[0], HUGE, EXAMPLES[1]], tmp_path, config)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reuse"]["n"] == 1  # example a, done before it
    assert "stopped after 2 of 6 runs" in json.loads((tmp_path / "run.json").read_text())["partial"]
    with pytest.raises(ValueError, match="example 'huge'"):  # other results in the folder are not this run's
        evaluate_examples(engine, [HUGE], tmp_path, EvalConfig(("full",), 3, 2, progress=False))
    assert "stopped after 0 of 1 runs" in json.loads((tmp_path / "run.json").read_text())["partial"]
    assert "rerun the same command to resume" in capsys.readouterr().err


def test_skip_errors_records_the_failure_and_goes_on(engine: Engine, tmp_path: Path) -> None:
    config = EvalConfig(("full", "reuse"), 3, 2, progress=False, skip_errors=True)
    result = evaluate_examples(engine, [EXAMPLES[0], HUGE, EXAMPLES[1]], tmp_path, config)
    errors = [r for r in _lines(tmp_path / EXAMPLES_FILE) if "error" in r]
    assert [(r["example_id"], r["method"]) for r in errors] == [("huge", "full"), ("huge", "reuse")]
    assert "context" in errors[0]["error"]
    s = result.summary["reuse"]
    assert (s["n"], s["errors"]) == (3, 1)
    assert s["kl"] == pytest.approx(sum(r["kl"] for r in result.records if r["method"] == "reuse" and "kl" in r) / 2)
    assert "partial" not in json.loads((tmp_path / "run.json").read_text())


def test_one_failing_method_does_not_fail_the_others_and_errors_are_retried(engine: Engine, tmp_path: Path,
                                                                              monkeypatch) -> None:
    import kvblend.eval.harness as harness

    score = harness.score_spec

    def reuse_breaks(engine, ex, spec, ref, config):
        if spec.label == "reuse":
            raise ValueError("reuse broke")
        return score(engine, ex, spec, ref, config)

    monkeypatch.setattr(harness, "score_spec", reuse_breaks)
    config = EvalConfig(("full", "reuse", "blend:0.3"), 3, 2, progress=False, skip_errors=True)
    result = evaluate_examples(engine, EXAMPLES[:1], tmp_path, config)
    assert [("error" in r, r["method"]) for r in result.records] == [(False, "full"), (True, "reuse"),
                                                                      (False, "blend:0.3")]
    monkeypatch.setattr(harness, "score_spec", score)  # the cause fixed: a rerun tries the error again
    again = evaluate_examples(engine, EXAMPLES[:1], tmp_path, config)
    assert again.computed == 1 and again.summary["reuse"]["errors"] == 0 and again.summary["reuse"]["n"] == 1


def test_an_interrupted_run_keeps_its_time_and_writes_a_partial_report(engine: Engine, tmp_path: Path,
                                                                        monkeypatch) -> None:
    import kvblend.eval.harness as harness

    score = harness.score_spec

    def interrupted(engine, ex, spec, ref, config):
        if ex.id == "b":
            raise KeyboardInterrupt
        return score(engine, ex, spec, ref, config)

    monkeypatch.setattr(harness, "score_spec", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["compute_s"] > 0 and "stopped after 4 of 6 runs" in run["partial"]  # a's 3 and b's full
    assert json.loads((tmp_path / "summary.json").read_text())["full"]["n"] == 2
    monkeypatch.setattr(harness, "score_spec", score)
    assert evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG).computed == 2


def test_a_smaller_rerun_says_its_report_is_a_subset(engine: Engine, tmp_path: Path, capsys) -> None:
    evaluate_examples(engine, EXAMPLES, tmp_path, CONFIG)
    evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 4, 2, progress=False))
    assert "covers 1 of the 6 results" in capsys.readouterr().err
    assert "covers 1 of the 6 results" in (tmp_path / "report.md").read_text()


def test_a_line_that_is_no_record_is_named(engine: Engine, tmp_path: Path) -> None:
    evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, 2, progress=False))
    with (tmp_path / EXAMPLES_FILE).open("a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(ValueError, match="record 2 is not an evaluation record"):
        evaluate_examples(engine, EXAMPLES[:1], tmp_path, EvalConfig(("full",), 3, 2, progress=False))


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / EXAMPLES_FILE
    path.write_text('{"example_id": "a", "method": "full"}\n{"example_id": "a", "method": "reuse"}')
    assert [r["method"] for r in read_records(path)] == ["full", "reuse"]
    assert path.read_text().endswith('"reuse"}\n')


def test_corrupt_line_before_the_end_raises(tmp_path: Path) -> None:
    path = tmp_path / EXAMPLES_FILE
    path.write_text('{"example_id": "a", "method": "full"}\n{"exa\n{"example_id": "b", "method": "full"}\n')
    with pytest.raises(ValueError, match=r"examples.jsonl:2"):
        read_records(path)


def test_duplicate_example_ids_are_refused(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        evaluate_examples(engine, [EXAMPLES[0], EXAMPLES[0]], tmp_path, CONFIG)


def test_evaluate_a_jsonl_file_through_the_cli(tmp_path: Path, monkeypatch, capsys) -> None:
    import kvblend.cli

    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps({"documents": list(e.documents), "question": e.question,
                                          "answers": list(e.answers), "id": e.id}) for e in EXAMPLES))
    three_layers = make_loaded(num_hidden_layers=3)  # the schedule checks layers 1 and 2
    monkeypatch.setattr(kvblend.cli, "_load", lambda args: three_layers)
    out = tmp_path / "out"
    argv = ["eval", "--dataset", str(data), "--methods", "full,blend:0.5,0.2@1,2,maprerank", "--out", str(out),
            "--limit", "1", "--docs", "2", "--max-tokens", "3", "--kl-tokens", "2", "--no-progress"]
    assert kvblend.cli.main(argv) == 0
    assert [r["method"] for r in _lines(out / EXAMPLES_FILE)] == ["full", "blend:0.5,0.2@1,2", "maprerank"]
    assert "3 runs computed" in capsys.readouterr().out
    assert kvblend.cli.main(argv) == 0 and "0 runs computed" in capsys.readouterr().out


def test_the_cli_checks_the_dataset_and_the_folder_before_loading_the_model(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    import kvblend.cli
    import kvblend.eval.harness as harness

    def no_model(args):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(harness, "load_from_args", no_model)
    monkeypatch.chdir(tmp_path)
    assert kvblend.cli.main(["eval", "--dataset", "missing.json", "--out", "o", "--no-progress"]) == 2
    assert "missing.json" in capsys.readouterr().err
    (tmp_path / "d.jsonl").write_text(json.dumps({"documents": ["a b c"], "question": "q", "answers": ["a"]}))
    assert kvblend.cli.main(["eval", "--dataset", "d.jsonl", "--out", "", "--no-progress"]) == 2
    assert "--out needs a directory" in capsys.readouterr().err and list(tmp_path.iterdir()) == [tmp_path / "d.jsonl"]


def test_evaluate_a_synthetic_spec(engine: Engine, tmp_path: Path) -> None:
    result = evaluate("synthetic:n=2,docs=2,doc_tokens=12", tmp_path, EvalConfig(("reuse",), 3, 2, progress=False),
                      engine=engine)
    assert result.summary["reuse"]["n"] == 2 and len(_lines(tmp_path / EXAMPLES_FILE)) == 4


# ----- sweeps -----------------------------------------------------------------------
def _tiers() -> list[str]:
    return ["memory", "disk"] + (["redis"] if shutil.which("redis-server") else [])


def test_sweeps_share_runs_and_use_the_store_they_name(loaded, tmp_path: Path) -> None:
    data = "synthetic:n=1,docs=2,doc_tokens=12"
    sens = RunSpec("sens", data, ("full", "reuse", "blend:0.3", "blend:0.3:k"))
    stores = {t: store_run(data, StoreSpec(t), ("reuse",), 1) for t in _tiers()}
    int8 = store_run(data, StoreSpec("memory", "int8"), ("reuse",), 1)
    sweeps = [method_sweep("ratio", "ratio", "ratio", sens, ratio_points([0.3])),
              method_sweep("signal", "signal", "signal", sens, [("v", "blend:0.3"), ("k", "blend:0.3:k")]),
              setting_sweep("tier", "tier", "tier", list(stores.items())),
              setting_sweep("dtype", "dtype", "KV dtype", [("fp32", stores["memory"]), ("int8", int8)])]
    assert [r.name for r in distinct_runs(sweeps)] == ["sens", *[f"store-{t}-fp32" for t in stores], "store-memory-int8"]
    results = run_sweeps(loaded, sweeps, tmp_path, EvalConfig(max_tokens=3, kl_tokens=2, progress=False))
    assert [(r["x"], r["series"]) for r in results[1].rows] == [("v", "blend"), ("k", "blend")]
    assert {(r["x"], r["series"]) for r in results[2].rows} == {(t, m) for t in stores for m in ("full", "reuse")}
    assert all(r.plot.exists() for r in results)
    assert set(json.loads((tmp_path / "sweeps.json").read_text())) == {"ratio", "signal", "tier", "dtype"}
    for tier in stores:
        reuse = _lines(tmp_path / "runs" / f"store-{tier}-fp32" / EXAMPLES_FILE)[1]
        assert reuse["method"] == "reuse" and reuse["sources"] == [tier]


def test_sweep_definitions_are_checked() -> None:
    run = RunSpec("r", "synthetic", ("full",))
    with pytest.raises(ValueError, match="not a method"):
        Sweep("s", "t", "x", (SweepPoint(1, run, "blend:0.1"),))
    other = RunSpec("r", "synthetic", ("reuse",))
    with pytest.raises(ValueError, match="two different runs"):
        distinct_runs([setting_sweep("a", "a", "x", [(1, run)]), setting_sweep("b", "b", "x", [(1, other)])])
    with pytest.raises(ValueError, match="tier"):
        StoreSpec("tape")


def test_strategy_sweep_lines_and_pareto_frontier(loaded, tmp_path: Path) -> None:
    from kvblend.eval.sweeps import pareto, strategy_sweep

    strategies = ["cacheblend:{r}", "blend:{r}:q+shift"]
    run = RunSpec("strat", "synthetic:n=1,docs=2,doc_tokens=12",
                  ("full", "reuse", "cacheblend:0.3", "cacheblend:0.5", "blend:0.3:q+shift", "blend:0.5:q+shift"))
    sweep = strategy_sweep(run, strategies, [0.3, 0.5])
    rows = run_sweeps(loaded, [sweep], tmp_path, EvalConfig(max_tokens=3, kl_tokens=2, progress=False))[0].rows
    assert [(r["x"], r["series"], r["method"]) for r in rows] == [
        (0.3, "cacheblend", "cacheblend:0.3"), (0.5, "cacheblend", "cacheblend:0.5"),
        (0.3, "blend:q+shift", "blend:0.3:q+shift"), (0.5, "blend:q+shift", "blend:0.5:q+shift")]
    summary = {"full": {"ttft_s": 2.0, "kl": 0.0}, "a": {"ttft_s": 1.0, "kl": 0.1},
               "b": {"ttft_s": 0.5, "kl": 0.2}, "c": {"ttft_s": 1.2, "kl": 0.1}, "d": {"ttft_s": 0.4, "kl": 0.3}}
    front = pareto(summary)
    assert [(r["method"], r["ttft_over_full"], r["frontier"]) for r in front] == [
        ("d", 0.2, True), ("b", 0.25, True), ("a", 0.5, True), ("c", 0.6, False)]


def test_the_storage_dtype_is_a_flag_recorded_in_run_json_and_a_resume_key(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    """``--kv-dtype`` (default: ``store.kv_dtype``, fp16) decides the reused KV, so a run
    records it and refuses to mix dtypes; a run.json written before the key was stored in
    fp32 and resumes only as such. The reuse KL differs with the dtype: the flag reaches the store."""
    import kvblend.cli

    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"documents": list(DOCS[:2]), "question": "q ?", "answers": ["a"], "id": "a"}))
    tiny = make_loaded(seed=1)
    monkeypatch.setattr(kvblend.cli, "_load", lambda args: tiny)
    argv = ["eval", "--dataset", str(data), "--methods", "reuse", "--max-tokens", "3", "--no-progress"]
    kl = {}
    for dtype in ("default", "fp32", "int8"):
        out = tmp_path / dtype
        flag = [] if dtype == "default" else ["--kv-dtype", dtype]
        assert kvblend.cli.main([*argv, "--out", str(out), *flag]) == 0
        expected = "fp16" if dtype == "default" else dtype
        assert json.loads((out / "run.json").read_text())["store"] == f"memory, KV {expected}"
        kl[expected] = next(r["kl"] for r in _lines(out / EXAMPLES_FILE) if r["method"] == "reuse")
    assert len(set(kl.values())) == 3
    monkeypatch.setenv("KVBLEND_STORE__KV_DTYPE", "int8")
    assert kvblend.cli.main([*argv, "--out", str(tmp_path / "int8")]) == 0  # the setting: the same run, resumed
    assert "0 runs computed" in capsys.readouterr().out
    assert kvblend.cli.main([*argv, "--out", str(tmp_path / "fp32"), "--kv-dtype", "fp16"]) == 2
    assert "store: 'memory, KV fp32' -> 'memory, KV fp16'" in capsys.readouterr().err
    run = tmp_path / "fp32" / "run.json"
    run.write_text(json.dumps({k: v for k, v in json.loads(run.read_text()).items() if k != "store"}))
    assert kvblend.cli.main([*argv, "--out", str(tmp_path / "fp32"), "--kv-dtype", "fp32"]) == 0  # older run.json
