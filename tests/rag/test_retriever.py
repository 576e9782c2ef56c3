"""Retrieval finds a planted passage in a synthetic corpus: dense (all-MiniLM-L6-v2), BM25, hybrid."""

from __future__ import annotations

import numpy as np
import pytest

from kvblend.errors import InvalidRequestError
from kvblend.rag.catalog import NewChunk
from kvblend.rag.retriever import Retriever, RetrieverConfig, rrf

TOPICS = ["river", "mountain", "market", "railway", "library", "harbour", "garden", "factory", "school", "bridge"]
VERBS = ["was built", "was repaired", "was visited", "was painted", "was sold", "was closed", "was opened"]
PLANTED = "The lighthouse keeper of Vormsi island is a woman named Theodora Quill, who has kept its lamp since 1987."
QUERY = "Who is the keeper of the lighthouse on Vormsi?"


def _corpus(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        words = [f"The {rng.choice(TOPICS)} of town {i} {rng.choice(VERBS)} in {1900 + int(rng.integers(0, 120))}."
                 for _ in range(3)]
        out.append(" ".join(words))
    out.insert(137, PLANTED)
    return out


def _fill(retriever: Retriever, texts: list[str], tenant: str = "default") -> list[str]:
    ids = [f"c{i:04d}" for i in range(len(texts))]
    retriever.index.upsert(tenant, ids, retriever.embed(texts))
    retriever.catalog.commit(tenant, [NewChunk(c, f"doc{i}.txt", 0, t, (1, 2, 3), False)
                                      for i, (c, t) in enumerate(zip(ids, texts))])
    return ids


@pytest.fixture(scope="module")
def planted(tmp_path_factory, minilm):
    r = Retriever(RetrieverConfig(tmp_path_factory.mktemp("planted")), embedder=minilm)
    _fill(r, _corpus(150))
    yield r
    r.close()


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_finds_the_planted_passage(planted, mode):
    hits = planted.search("default", QUERY, top_k=3, mode=mode)
    assert hits[0].text == PLANTED and hits[0].source == "doc137.txt"
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    assert len(hits) == (1 if mode == "bm25" else 3)  # BM25 returns only texts sharing a query term
    assert planted.search("other", QUERY, top_k=3, mode=mode) == []  # another tenant sees nothing


def test_only_committed_chunks_come_back_and_deletes_remove_them(tmp_path, hash_embedder):
    from kvblend.rag.catalog import DocumentRow

    r = Retriever(RetrieverConfig(tmp_path, mode="dense"), embedder=hash_embedder)
    texts = _corpus(40)
    ids = _fill(r, texts)
    planted_id, planted_doc = ids[texts.index(PLANTED)], f"doc{texts.index(PLANTED)}.txt"
    r.index.upsert("default", ["stray"], r.embed([PLANTED + " stray"]))  # vectors of a batch never committed
    assert all(h.chunk_id != "stray" for h in r.search("default", PLANTED, top_k=5))
    assert r.reconcile("default") == 1 and "stray" not in r.index.ids("default")
    r.catalog.commit("default", [], [DocumentRow(planted_doc, "x", (planted_id,), 3)])
    assert r.search("default", PLANTED, top_k=1)[0].chunk_id == planted_id
    assert r.delete_document("default", planted_doc) == 1
    assert all(h.chunk_id != planted_id for h in r.search("default", PLANTED, top_k=5))
    r.close()


def test_rrf_and_request_bounds(tmp_path, hash_embedder):
    assert [c for c, _ in rrf([["a", "b", "c"], ["c", "a"]])] == ["a", "c", "b"]
    r = Retriever(RetrieverConfig(tmp_path), embedder=hash_embedder)
    for bad in (dict(top_k=0), dict(top_k=1000), dict(mode="sparse")):
        with pytest.raises(InvalidRequestError):
            r.search("default", "q", **{"top_k": 3, **bad})
    with pytest.raises(InvalidRequestError):
        r.search("default", " ", top_k=3)
    assert r.search("default", "anything", top_k=3) == []  # empty index
    r.close()


@pytest.mark.parametrize("bad", [True, False, 2.5, 3.0, "3", None, 0, -1, 101])
def test_top_k_is_a_strict_positive_integer_with_a_bound(tmp_path, hash_embedder, bad):
    """``top_k=True`` searched for one chunk, and 2.5 failed deep inside with a TypeError:
    only an int in [1, MAX_TOP_K] is a top_k, and the error names the field."""
    r = Retriever(RetrieverConfig(tmp_path), embedder=hash_embedder)
    with pytest.raises(InvalidRequestError, match=r"top_k must be an integer in \[1, 100\]") as exc:
        r.search("default", "q", top_k=bad)
    assert exc.value.field == "top_k"
    r.close()
