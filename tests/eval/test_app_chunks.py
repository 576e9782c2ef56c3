"""``kvblend eval --app-chunks``: passages cut as an app cuts them (issue 41)."""

from __future__ import annotations

import pytest

from kvblend.eval.datasets import app_chunks, check_layout, inline_context, layout_kind, parse_app_chunks, split_like_an_app

TEXT = " ".join(f"Sentence {i} says the lighthouse was built in {1800 + i}{'!' if i % 3 else '.'}" +
                (" It burned colza oil, was automated, and the keeper's cottage is now a museum." if i % 4 == 0 else "")
                for i in range(30))


@pytest.mark.parametrize("size,overlap", [(60, 0), (120, 60), (500, 100)])
def test_chunks_are_slices_of_the_text_within_the_size_and_overlap(size: int, overlap: int) -> None:
    chunks = split_like_an_app(TEXT, size, overlap)
    assert all(c in TEXT and len(c) <= size for c in chunks)
    at, covered = [], 0
    for c in chunks:  # in order, together covering every non-space character
        start = TEXT.index(c, at[-1] if at else 0)
        assert start <= covered + 1 or not TEXT[covered:start].strip()
        at.append(start)
        covered = max(covered, start + len(c))
    assert not TEXT[covered:].strip()
    if overlap:
        assert any(b < a + len(ca) for a, b, ca in zip(at, at[1:], chunks))  # some chunks overlap


def test_a_sentence_longer_than_a_chunk_is_cut_at_spaces() -> None:
    chunks = split_like_an_app("word " * 40, 32)
    assert len(chunks) > 1 and all(len(c) <= 32 and not c.startswith(" ") for c in chunks)


def test_layouts_and_app_chunk_specs() -> None:
    assert parse_app_chunks("1000:100") == (1000, 100) and parse_app_chunks("500") == (500, 0)
    assert app_chunks("inline:1000:100") == (1000, 100) and app_chunks("after") is None
    assert layout_kind("inline:1000:100") == "inline" and check_layout("before") == "before"
    for bad in ("inline:100:100", "after:10:1", "inline:x", "sideways"):
        with pytest.raises(ValueError):
            check_layout(bad)
    with pytest.raises(ValueError, match="CHARS"):
        parse_app_chunks("ten")
    assert inline_context(["a. b.", "c."], "Q?", (3, 0)) == "Context:\n\na.\n\nb.\n\nc.\n\nQ?"
