"""Chunkers' invariants: coverage, no overlap unless asked, token-exact boundaries, stable ids."""

from __future__ import annotations

import pytest

from kvblend.rag.chunking import ChunkerConfig, chunk_id, chunk_text, tokenize_with_offsets
from tests.conftest import make_tokenizer

TEXT = ("# Title\n\nthe city of paris is on a river . the project led by a doctor was approved .\n\n"
        "## Budget\nthe budget was approved in one year , the company headquartered in lisbon .\n"
        "```\n# not a heading\n```\n"
        "## Cities\nrome oslo madrid north south east west one two three four five six seven\n") * 4
DIALOGUE = "".join(f"alpha: hello world the model {i}\nbeta: blend reuse prefix cache token\n" for i in range(12))


@pytest.fixture(scope="module")
def smol_tok():
    from kvblend.models import load_model

    return load_model("smollm2-135m").tokenizer


def _doc_ids(tok, text):
    return tokenize_with_offsets(tok, text)[0]


@pytest.mark.parametrize("kind,size", [("tokens", 7), ("tokens", 512), ("markdown", 20), ("dialogue", 15)])
def test_chunks_cover_the_document_exactly(kind, size):
    tok = make_tokenizer()
    chunks = chunk_text(tok, TEXT + DIALOGUE, ChunkerConfig(kind, size), "tok")
    ids = _doc_ids(tok, TEXT + DIALOGUE)
    assert [t for c in chunks for t in c.token_ids] == ids
    assert all(0 < c.n_tokens <= size for c in chunks)
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]]
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))


def test_overlap_only_when_asked():
    tok = make_tokenizer()
    ids = _doc_ids(tok, TEXT)
    chunks = chunk_text(tok, TEXT, ChunkerConfig("tokens", 10, 3), "tok")
    for a, b in zip(chunks, chunks[1:]):
        assert b.start == a.end - 3
    for c in chunks:
        assert list(c.token_ids) == ids[c.start : c.end]
    assert chunks[-1].end == len(ids)


def test_markdown_cuts_at_headings_outside_code():
    tok = make_tokenizer()
    pad = " one two three four five six seven eight nine ten" * 2
    text = f"# one\nalpha beta{pad}\n## two\ngamma delta\n```\n# code\n```\n## three\nred green{pad}\n"
    ids, offsets = tokenize_with_offsets(tok, text)
    heads = [text.index("## two"), text.index("## three")]
    bounds = [next(i for i, o in enumerate(offsets) if o[0] >= h) for h in heads]
    sizes = [bounds[0], bounds[1] - bounds[0], len(ids) - bounds[1]]
    size = max(sizes)
    assert sizes[0] + sizes[1] > size and sizes[1] + sizes[2] > size  # no two sections fit one chunk
    chunks = chunk_text(tok, text, ChunkerConfig("markdown", size), "tok")
    assert [offsets[c.start][0] for c in chunks] == [0, *heads]
    assert len(chunk_text(tok, text, ChunkerConfig("markdown", len(ids)), "tok")) == 1  # small sections pack


def test_dialogue_packs_whole_turns():
    tok = make_tokenizer()
    chunks = chunk_text(tok, DIALOGUE, ChunkerConfig("dialogue", 16), "tok")
    turn = len(_doc_ids(tok, "alpha: hello world the model 1\n"))
    assert all(c.text.split()[0] in ("alpha", "beta") for c in chunks)  # every chunk starts at a turn
    assert max(c.n_tokens for c in chunks) <= 16 and min(c.n_tokens for c in chunks[:-1]) >= turn


def test_ids_are_stable_and_depend_on_content_and_params():
    tok = make_tokenizer()
    a = chunk_text(tok, TEXT, ChunkerConfig("tokens", 16), "tok")
    b = chunk_text(tok, TEXT, ChunkerConfig("tokens", 16), "tok")
    assert [c.chunk_id for c in a] == [c.chunk_id for c in b]
    assert a[0].chunk_id == chunk_id(a[0].token_ids, "tok", ChunkerConfig("tokens", 16))
    assert a[0].chunk_id != chunk_text(tok, TEXT, ChunkerConfig("tokens", 17), "tok")[0].chunk_id
    assert a[0].chunk_id != chunk_text(tok, TEXT, ChunkerConfig("tokens", 16), "other")[0].chunk_id
    changed = chunk_text(tok, TEXT.replace("lisbon", "rome", 1), ChunkerConfig("tokens", 16), "tok")
    assert a[0].chunk_id == changed[0].chunk_id and {c.chunk_id for c in a} != {c.chunk_id for c in changed}


def test_empty_text_gives_no_chunks_and_bad_config_is_refused():
    assert chunk_text(make_tokenizer(), "  \n", ChunkerConfig(), "tok") == []
    for kw in ({"kind": "words"}, {"size": 0}, {"size": 8, "overlap": 8}, {"overlap": -1}):
        with pytest.raises(ValueError):
            ChunkerConfig(**kw)


@pytest.mark.slow
def test_real_tokenizer_boundaries_are_token_exact_and_keep_characters(smol_tok):
    text = ("Émile went to Zürich 😀😀😀 on a train.\n\n## Next\n" * 30) + "Alice: hi\nBob: hello\n" * 20
    ids = _doc_ids(smol_tok, text)
    for cfg in (ChunkerConfig("tokens", 9), ChunkerConfig("markdown", 40), ChunkerConfig("dialogue", 30)):
        chunks = chunk_text(smol_tok, text, cfg, "smol")
        assert [t for c in chunks for t in c.token_ids] == ids
        assert "".join(c.text for c in chunks) == text  # no character split across chunks
