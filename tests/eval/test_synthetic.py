import itertools
import re

import pytest

from kvblend.eval import synthetic
from kvblend.eval.synthetic import MAX_DOCS, TOKENS_PER_WORD, SyntheticExample, generate_synthetic

MANY = generate_synthetic(150, n_docs=6, doc_tokens=96, seed=3)


def _docs_containing(ex: SyntheticExample, needle: str) -> set[int]:
    return {i for i, doc in enumerate(ex.documents) if needle in doc}


def _estimated_tokens(doc: str) -> float:
    return len(doc.split()) * TOKENS_PER_WORD


def test_sizes_and_types() -> None:
    examples = generate_synthetic(7, n_docs=5, doc_tokens=128, seed=0)
    assert len(examples) == 7
    assert len({ex.id for ex in examples}) == 7
    for ex in examples:
        assert isinstance(ex, SyntheticExample)
        assert len(ex.documents) == 5 and len(ex.answers) == 1
        assert all(doc.endswith("\n\n") for doc in ex.documents)
    assert generate_synthetic(0) == []


def test_deterministic_for_a_seed_and_prefix_stable() -> None:
    a = generate_synthetic(5, n_docs=4, doc_tokens=64, seed=11)
    assert a == generate_synthetic(5, n_docs=4, doc_tokens=64, seed=11)
    assert a[:3] == generate_synthetic(3, n_docs=4, doc_tokens=64, seed=11)
    other = generate_synthetic(5, n_docs=4, doc_tokens=64, seed=12)
    assert [ex.documents for ex in a] != [ex.documents for ex in other]


@pytest.mark.parametrize("ex", MANY, ids=lambda ex: ex.id)
def test_answer_needs_both_hop_documents(ex: SyntheticExample) -> None:
    first, second = ex.hop_indices
    answer = ex.answers[0]
    assert first != second
    assert _docs_containing(ex, answer) == {second}
    assert _docs_containing(ex, ex.bridge) == {first, second}
    assert _docs_containing(ex, ex.entity) == {first}
    assert not any(ex.entity in doc and answer in doc for doc in ex.documents)
    assert ex.entity in ex.question
    assert answer not in ex.question and ex.bridge not in ex.question


def test_distractors_hold_one_fact_of_another_chain() -> None:
    bridge_heads = (*synthetic.CODENAMES, *synthetic.COMPANY_HEADS, *synthetic.NOVEL_HEADS)
    for ex in MANY[:40]:
        distractors = [d for i, d in enumerate(ex.documents) if i not in ex.hop_indices]
        assert len(distractors) == 4
        for doc in distractors:
            assert not any(s in doc for s in (ex.entity, ex.bridge, ex.answers[0]))
            assert sum(head in doc for head in bridge_heads) == 1


def test_hop_positions_and_order_vary() -> None:
    pairs = [ex.hop_indices for ex in MANY]
    assert any(a < b for a, b in pairs) and any(a > b for a, b in pairs)
    assert {i for pair in pairs for i in pair} == set(range(6))
    first_sentence_has_fact = [ex.documents[ex.hop_indices[1]].startswith(ex.bridge) for ex in MANY]
    assert not all(first_sentence_has_fact)


def test_all_kinds_occur_and_answers_match_their_kind() -> None:
    kinds = {ex.kind for ex in MANY}
    assert kinds == {"project", "employer", "novel"}
    for ex in MANY:
        assert ex.answers[0].isdigit() == (ex.kind == "novel")


@pytest.mark.parametrize("doc_tokens", [64, 256, 512])
def test_document_lengths_honoured(doc_tokens: int) -> None:
    for ex in generate_synthetic(10, n_docs=4, doc_tokens=doc_tokens, seed=5):
        for doc in ex.documents:
            assert abs(_estimated_tokens(doc) - doc_tokens) <= 0.1 * doc_tokens + 10


def test_tiny_documents_are_just_the_fact() -> None:
    ex = generate_synthetic(1, n_docs=3, doc_tokens=1, seed=0)[0]
    assert all(doc.count(".") <= 2 and len(doc.split()) < 16 for doc in ex.documents)
    assert ex.answers[0] in ex.documents[ex.hop_indices[1]]


def test_maximum_document_count() -> None:
    ex = generate_synthetic(1, n_docs=MAX_DOCS, doc_tokens=16, seed=1)[0]
    assert len(ex.documents) == MAX_DOCS
    assert _docs_containing(ex, ex.answers[0]) == {ex.hop_indices[1]}


@pytest.mark.parametrize(
    "kwargs",
    [{"n": -1}, {"n": 1, "n_docs": 1}, {"n": 1, "n_docs": MAX_DOCS + 1}, {"n": 1, "doc_tokens": 0}],
)
def test_invalid_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        generate_synthetic(**kwargs)


def _name_pools() -> list[str]:
    return [
        *synthetic.FIRST_NAMES,
        *synthetic.LAST_NAMES,
        *synthetic.CODENAMES,
        *synthetic.COMPANY_HEADS,
        *synthetic.NOVEL_HEADS,
        *synthetic.CITIES,
    ]


def test_no_name_contains_another() -> None:
    names = _name_pools()
    assert len(names) == len(set(names))
    clashes = [(a, b) for a, b in itertools.permutations(names, 2) if a in b]
    assert clashes == []


def test_filler_vocabulary_is_disjoint_from_names() -> None:
    filler_text = " ".join(synthetic.FILLER_TEMPLATES) + " " + " ".join(
        w for words in synthetic.FILLER_WORDS.values() for w in words
    )
    filler_words = set(re.findall(r"[a-z]+", filler_text.lower()))
    name_words = {w.lower() for name in _name_pools() for w in name.split()}
    name_words |= {w.lower() for w in (*synthetic.COMPANY_SUFFIXES, *synthetic.NOVEL_NOUNS)}
    assert filler_words & name_words == set()
