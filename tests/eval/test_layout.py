"""Question placement in the evaluation prompt: after the documents (the paper's prompt)
or before them, on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine
from kvblend.eval.baselines import BaselineConfig, answer_request, map_request, map_reduce, map_rerank
from kvblend.eval.datasets import (
    MUSIQUE_ANSWER_CUE, MUSIQUE_INSTRUCTION, Example, musique_prompt, musique_query,
)
from kvblend.eval.harness import EXAMPLES_FILE, RUN_FILE, EvalConfig, evaluate_examples
from kvblend.eval.runner import MethodSpec, example_request, parse_method
from tests.conftest import make_loaded

EXAMPLE = Example("where was the project approved ?",
                  ("the doctor led the project alpha in north paris .",
                   "project alpha was approved in the city of lisbon .",
                   "the company is headquartered in rome , west of the river ."),
                  ("lisbon",), "a")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(make_loaded(seed=1))


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _contains(seq, sub) -> bool:
    seq, sub = list(seq), list(sub)
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_after_is_the_papers_prompt_and_before_moves_the_question_ahead_of_the_documents(engine: Engine) -> None:
    assert musique_prompt("q ?") == (MUSIQUE_INSTRUCTION, musique_query("q ?"))
    system, query = musique_prompt("q ?", "before")
    assert system.endswith("\n\nQuestion: q ?") and query == MUSIQUE_ANSWER_CUE and "q ?" not in query
    with pytest.raises(ValueError, match="layout"):
        musique_prompt("q ?", "middle")

    spec = parse_method("blend:0.3")
    after = engine.layout(example_request(EXAMPLE, spec))
    before = engine.layout(example_request(EXAMPLE, spec, "before"))
    question = _ids(engine, "where was the project approved ?")
    assert after.ids != before.ids
    assert after.docs == before.docs  # the documents' own ids, hence their chunk keys, do not move
    assert _contains(after.suffix, question) and not _contains(after.prefix, question)
    assert _contains(before.prefix, question) and not _contains(before.suffix, question)
    assert engine.chunk_prefix(example_request(EXAMPLE, spec, "before"), before) == after.prefix[:1]


def test_blend_with_the_question_before_keeps_the_invariants_and_the_stored_chunks(engine: Engine) -> None:
    def request(method: str, ratio: float = 0.0):
        return example_request(EXAMPLE, MethodSpec(method, method, BlendConfig(ratio=ratio)), "before")

    engine.prepare(example_request(EXAMPLE, MethodSpec("b", "blend")))  # chunk KV stored under the "after" prompt
    engine.flush()
    full = engine.prepare(request("full")).logits
    blended = engine.prepare(request("blend", 1.0))
    assert all(d.hit for d in blended.stats.docs)  # the same chunks serve the other layout
    assert (blended.logits - full).abs().max().item() <= 1e-3
    reuse = engine.prepare(request("reuse")).logits
    assert (engine.prepare(request("blend", 0.0)).logits - reuse).abs().max().item() <= 1e-3
    assert (reuse - full).abs().max().item() > 1e-3  # the layout changes what reuse misses, not the invariants
    after_full = engine.prepare(example_request(EXAMPLE, MethodSpec("full", "full"))).logits
    assert (after_full - full).abs().max().item() > 1e-3  # the two layouts really are different prompts


def test_the_run_records_its_layout_and_refuses_to_mix_layouts(engine: Engine, tmp_path: Path) -> None:
    config = EvalConfig(("full", "reuse"), 3, 2, progress=False, layout="before")
    calls: list = []
    prepare = engine.prepare
    engine.prepare = lambda req, *a, **kw: calls.append(req) or prepare(req, *a, **kw)  # type: ignore[method-assign]
    try:
        evaluate_examples(engine, [EXAMPLE], tmp_path, config, {"dataset": "x"})
    finally:
        del engine.prepare
    system, query = musique_prompt(EXAMPLE.question, "before")
    scored = [r for r in calls if r.documents]
    assert scored and all((r.system, r.question) == (system, query) for r in scored)
    assert json.loads((tmp_path / RUN_FILE).read_text())["layout"] == "before"
    with pytest.raises(ValueError, match="layout: 'before' -> 'after'"):
        evaluate_examples(engine, [EXAMPLE], tmp_path, EvalConfig(("full", "reuse"), 3, 2, progress=False),
                          {"dataset": "x"})
    assert len((tmp_path / EXAMPLES_FILE).read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="layout"):
        EvalConfig(layout="middle")


def test_a_run_written_before_layouts_existed_resumes_only_as_after(engine: Engine, tmp_path: Path) -> None:
    config = EvalConfig(("full",), 3, 2, progress=False)
    evaluate_examples(engine, [EXAMPLE], tmp_path, config, {"dataset": "x"})
    run = json.loads((tmp_path / RUN_FILE).read_text())
    del run["layout"]
    (tmp_path / RUN_FILE).write_text(json.dumps(run))
    with pytest.raises(ValueError, match="layout: 'after' -> 'before'"):
        evaluate_examples(engine, [EXAMPLE], tmp_path, EvalConfig(("full", "reuse"), 3, 2, progress=False,
                                                                   layout="before"), {"dataset": "x"})
    assert evaluate_examples(engine, [EXAMPLE], tmp_path, EvalConfig(("full", "reuse"), 3, 2, progress=False),
                             {"dataset": "x"}).computed == 1


def test_baselines_place_the_question_as_the_reference_does(engine: Engine) -> None:
    config = BaselineConfig(map_tokens=3, max_tokens=3, kl_tokens=2, layout="before")
    assert EvalConfig(layout="before").baseline.layout == "before"
    question = _ids(engine, "where was the project approved ?")
    one = engine.layout(answer_request(EXAMPLE, EXAMPLE.documents[:1], "before"))
    assert _contains(one.prefix, question) and not _contains(one.suffix, question)
    mapped = engine.layout(map_request(EXAMPLE, 0, "before"))
    assert _contains(mapped.prefix, question) and not _contains(mapped.suffix, question)
    assert engine.layout(map_request(EXAMPLE, 0)).ids != mapped.ids
    rerank = map_rerank(engine, EXAMPLE, config)
    assert rerank.final.layout == engine.layout(answer_request(EXAMPLE, [EXAMPLE.documents[rerank.picked]], "before"))
    reduce = map_reduce(engine, EXAMPLE, config)
    assert _contains(reduce.final.layout.prefix, question) and not _contains(reduce.final.layout.suffix, question)


def test_eval_cli_takes_the_layout(tmp_path: Path, monkeypatch) -> None:
    import kvblend.cli

    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"documents": list(EXAMPLE.documents), "question": EXAMPLE.question,
                                "answers": list(EXAMPLE.answers), "id": EXAMPLE.id}))
    monkeypatch.setattr(kvblend.cli, "_load", lambda args: make_loaded(seed=1))
    argv = ["eval", "--dataset", str(data), "--methods", "reuse", "--out", str(tmp_path / "out"), "--max-tokens", "2",
            "--kl-tokens", "1", "--no-progress", "--layout", "before"]
    assert kvblend.cli.main(argv) == 0
    assert json.loads((tmp_path / "out" / RUN_FILE).read_text())["layout"] == "before"
    with pytest.raises(SystemExit):
        kvblend.cli.main([*argv[:-1], "middle"])


# ----- inline: the passages pasted into the message text and found by matching ---------------
def test_inline_pastes_the_passages_into_the_user_turn_and_matching_finds_each(engine: Engine) -> None:
    from kvblend.eval.runner import inline_request

    system, query = musique_prompt(EXAMPLE.question, "inline")
    shaped = inline_request(engine, EXAMPLE, MethodSpec("b", "blend"), system, query)
    user = shaped.request.messages[-1]["content"]
    assert all(p in user for p in EXAMPLE.documents) and user.endswith(query)
    assert [m.source for m in shaped.matches] == ["stored"] * 3
    assert [user[m.start : m.end] for m in shaped.matches] == list(EXAMPLE.documents)
    assert shaped.layout.docs == tuple(tuple(_ids(engine, d)) for d in EXAMPLE.documents)
    assert _contains(shaped.layout.prefix, _ids(engine, "Context:"))  # the text before them: computed
    assert _contains(shaped.layout.suffix, _ids(engine, query))
    assert engine.layout(shaped.request) is shaped.layout  # rendered once, carried


def test_eval_inline_layout_runs_every_method_with_every_passage_matched(engine: Engine, tmp_path: Path) -> None:
    examples = [EXAMPLE, Example("who led the project ?", EXAMPLE.documents[::-1], ("the doctor",), "b")]
    config = EvalConfig(("full", "blend:1.0", "blend:0.15"), 4, 2, progress=False, layout="inline")
    result = evaluate_examples(engine, examples, tmp_path, config, {"dataset": "tiny"})
    assert len(result.records) == 6
    assert all(r["match_rate"] == 1.0 for r in result.records)
    assert all(r["kl"] <= 1e-6 for r in result.records if r["method"] in ("full", "blend:1.0"))
    blended = [r for r in result.records if r["method"] == "blend:0.15"]
    assert all(r["sources"] == ["memory"] for r in blended)  # the matched passages' KV was reused
    assert json.loads((tmp_path / RUN_FILE).read_text())["layout"] == "inline"
