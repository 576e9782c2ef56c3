import dataclasses
import json
from pathlib import Path

import pytest

from kvblend.eval.datasets import (
    MUSIQUE_INSTRUCTION,
    Example,
    load_dataset,
    load_jsonl,
    load_musique,
    musique_query,
    parse_synthetic_spec,
)
from kvblend.data import MUSIQUE_SAMPLE
from kvblend.eval.synthetic import SyntheticExample

SAMPLE = MUSIQUE_SAMPLE
SHARED_MUSIQUE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "musique_dev.json"


def _write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _write_lines(path: Path, records: list[object]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _musique_item(n_ctxs: int = 3) -> dict:
    ctxs = [{"title": f"T{i}", "text": f"text {i}"} for i in range(n_ctxs)]
    return {"question": "Who?", "answers": ["Ann"], "ctxs": ctxs}


def test_prompt_constants() -> None:
    assert musique_query("Where is X?") == (
        "Answer the question directly based on the given passages. Do NOT repeat the question. "
        "The answer should be within 5 words.\nQuestion: Where is X?\nAnswer:"
    )
    assert MUSIQUE_INSTRUCTION == (
        "You will be asked a question after reading several passages. Please directly answer the "
        "question based on the given passages. Do NOT repeat the question. The answer should be "
        "within 5 words."
    )


def test_example_is_frozen_and_coerces_to_tuples() -> None:
    ex = Example(question="q", documents=["a", "b"], answers=["x"], id="1")
    assert ex.documents == ("a", "b") and ex.answers == ("x",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.question = "other"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Example(question="q", documents="ab", answers=("x",), id="1")
    with pytest.raises(ValueError):
        Example(question="q", documents=("a", 3), answers=("x",), id="1")  # type: ignore[arg-type]


def test_load_musique_sample_formats_passages() -> None:
    raw = json.loads(SAMPLE.read_text(encoding="utf-8"))
    examples = load_musique(SAMPLE)
    assert len(examples) == 2
    first = examples[0]
    assert first.question == raw[0]["question"]
    assert first.question == "Where was the author of Hannibal and Scipio educated at?"
    assert first.answers == ("Exeter College",)
    assert len(first.documents) == 6
    ctx = raw[0]["ctxs"][1]
    assert first.documents[1] == f"{ctx['title']}\n\n{ctx['text']}\n\n"
    assert examples[1].id == "musique_sample-1"
    assert examples[1].answers == ("Charles County",)


def test_load_musique_n_docs_and_limit() -> None:
    examples = load_musique(SAMPLE, n_docs=3, limit=1)
    assert len(examples) == 1
    assert len(examples[0].documents) == 3
    assert load_musique(SAMPLE, limit=0) == []


@pytest.mark.skipif(not SHARED_MUSIQUE.exists(), reason="needs ../shared/data/musique_dev.json")
def test_load_shared_musique_dev() -> None:
    examples = load_musique(SHARED_MUSIQUE)
    assert len(examples) == 100
    assert all(len(ex.documents) == 6 and ex.answers for ex in examples)
    content = [(ex.question, ex.documents, ex.answers) for ex in examples[:2]]
    assert content == [(ex.question, ex.documents, ex.answers) for ex in load_musique(SAMPLE)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("[]", "empty"),
        ('{"question": "q"}', "expected a JSON list"),
        ("[{", "invalid JSON"),
        (json.dumps([{"question": "q", "answers": ["a"]}]), "example 0: missing key 'ctxs'"),
        (json.dumps([_musique_item(), {"answers": ["a"]}]), "example 1: missing key 'question'"),
        (json.dumps([_musique_item(2)]), "fewer than n_docs"),
        (json.dumps([{**_musique_item(), "answers": "Ann"}]), "'answers' must be a list"),
        (json.dumps([{**_musique_item(), "ctxs": [{"title": "t"}] * 3}]), "ctx 0: missing key 'text'"),
    ],
)
def test_load_musique_errors_name_file_and_example(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json") as info:
        load_musique(path, n_docs=3)
    assert message in str(info.value)


def test_load_jsonl(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "qa.jsonl",
        [
            {"documents": ["d1", "d2", "d3"], "question": "q1", "answers": ["a1", "alt"], "id": "x"},
            "",
            {"documents": ["e1"], "question": "q2", "answers": ["a2"]},
        ],
    )
    first, second = load_jsonl(path)
    assert first == Example(question="q1", documents=("d1", "d2", "d3"), answers=("a1", "alt"), id="x")
    assert second.id == "qa-1" and second.documents == ("e1",)
    assert len(load_jsonl(path, limit=1)) == 1
    assert load_jsonl(path, limit=1, n_docs=2)[0].documents == ("d1", "d2")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty file"),
        (["", "   "], "empty file"),
        ([{"documents": ["d"], "question": "q", "answers": ["a"]}, "{oops"], "bad.jsonl:2: invalid"),
        ([{"documents": ["d"], "answers": ["a"]}], "bad.jsonl:1: missing key 'question'"),
        (["", {"question": "q", "answers": ["a"]}], "bad.jsonl:2: missing key 'documents'"),
        ([{"documents": "d", "question": "q", "answers": ["a"]}], "'documents' must be a list"),
        ([{"documents": ["d", 1], "question": "q", "answers": ["a"]}], "list of strings"),
        ([{"documents": ["d"], "question": "q", "answers": []}], "non-empty list"),
        (["[1, 2]"], "expected a JSON object"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, lines: list, message: str) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError) as info:
        load_jsonl(path)
    assert message in str(info.value)


def test_load_dataset_dispatches_on_file_type(tmp_path: Path) -> None:
    musique = load_dataset(str(SAMPLE), n_docs=2, limit=None)
    assert len(musique) == 2 and len(musique[0].documents) == 2
    record = {"documents": ["d"], "question": "q", "answers": ["a"]}
    jsonl = load_dataset(str(_write_lines(tmp_path / "x.jsonl", [record, record])), limit=1)
    assert [ex.question for ex in jsonl] == ["q"]
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset(str(tmp_path / "x.csv"))


def test_load_dataset_synthetic_spec() -> None:
    examples = load_dataset("synthetic:n=3,docs=5,doc_tokens=64,seed=2")
    assert len(examples) == 3
    assert all(isinstance(ex, SyntheticExample) and len(ex.documents) == 5 for ex in examples)
    assert examples[0].id == "synthetic-2-0"
    assert len(load_dataset("synthetic", limit=4, doc_tokens=32)) == 4
    assert len(load_dataset("synthetic:n=3", limit=10)) == 3
    assert load_dataset("synthetic:n=2", n_docs=3, seed=None)[0].documents[0]


def test_parse_synthetic_spec() -> None:
    assert parse_synthetic_spec("synthetic") == {}
    assert parse_synthetic_spec("synthetic: n=20, docs=4 ,doc_tokens=256,seed=0") == {
        "n": 20,
        "n_docs": 4,
        "doc_tokens": 256,
        "seed": 0,
    }
    for bad in ("synthetic:x=1", "synthetic:n", "synthetic:n=abc", "synth:n=1"):
        with pytest.raises(ValueError):
            parse_synthetic_spec(bad)


def test_load_dataset_rejects_conflicting_options() -> None:
    with pytest.raises(ValueError, match="docs|n_docs"):
        load_dataset("synthetic:n=2,docs=4", n_docs=6)
    assert len(load_dataset("synthetic:n=2,docs=4", n_docs=4)) == 2
