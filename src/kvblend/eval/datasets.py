"""Evaluation datasets: one `Example` type, loaders for MuSiQue and JSONL, and a spec
string (`load_dataset`) that names either a file or the synthetic generator.

MuSiQue (Trivedi et al., TACL 2022, CC BY 4.0) is read in the retrieval-chunked form
used by the CacheBlend evaluation: a JSON list of
``{"question": str, "answers": [str], "ctxs": [{"title": str, "text": str}, ...]}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvblend.data import format_musique_passage
from kvblend.eval.example import Example
from kvblend.eval.synthetic import generate_synthetic

MUSIQUE_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer "
    "the question based on the given passages. Do NOT repeat the question. The answer "
    "should be within 5 words."
)

SYNTHETIC_KEYS = {
    "n": "n", "docs": "n_docs", "n_docs": "n_docs", "doc_tokens": "doc_tokens", "seed": "seed"
}
SYNTHETIC_DEFAULT_N = 100


def musique_query(question: str) -> str:
    """The query text that follows the passages in the CacheBlend MuSiQue prompt."""
    return (
        "Answer the question directly based on the given passages. Do NOT repeat the "
        "question. The answer should be within 5 words.\n"
        f"Question: {question}\nAnswer:"
    )


# Where the question sits: after the documents (the paper's prompt) or before them; "inline"
# is "after" with the passages pasted into the user message's text, as RAG frameworks do
# (found again there by matching: `runner.inline_request`).
LAYOUTS = ("after", "before", "inline")
MUSIQUE_INSTRUCTION_BEFORE = (
    "You will be asked a question and then read several passages. Please directly answer "
    "the question based on the given passages. Do NOT repeat the question. The answer "
    "should be within 5 words."
)
MUSIQUE_ANSWER_CUE = (
    "Answer the question directly based on the given passages. Do NOT repeat the "
    "question. The answer should be within 5 words.\nAnswer:"
)


def check_layout(layout: str) -> str:
    """``layout`` itself, or ValueError naming the choices (``inline:CHARS:OVERLAP`` is
    ``inline`` with the passages cut as an app cuts them: ``app_chunks``)."""
    if layout not in LAYOUTS:
        app_chunks(layout)
    return layout


def layout_kind(layout: str) -> str:
    """``after``, ``before`` or ``inline`` (also for ``inline:CHARS:OVERLAP``)."""
    check_layout(layout)
    return "inline" if layout.startswith("inline") else layout


def app_chunks(layout: str) -> tuple[int, int] | None:
    """(characters, overlap) of ``inline:CHARS:OVERLAP``; None for the other layouts."""
    if layout in LAYOUTS:
        return None
    kind, _, spec = layout.partition(":")
    try:
        size, overlap = (int(x) for x in spec.split(":"))
    except ValueError:
        size = overlap = -1
    if kind != "inline" or not 0 <= overlap < size:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} or inline:CHARS:OVERLAP with "
                         f"0 <= OVERLAP < CHARS, got {layout!r}")
    return size, overlap


def parse_app_chunks(spec: str) -> tuple[int, int]:
    """``CHARS[:OVERLAP]`` (``--app-chunks``) as (characters, overlap); overlap 0 by default."""
    size, _, overlap = spec.partition(":")
    try:
        parsed = int(size), int(overlap or 0)
    except ValueError:
        raise ValueError(f"app chunks are CHARS[:OVERLAP], got {spec!r}") from None
    return app_chunks(f"inline:{parsed[0]}:{parsed[1]}") or parsed


def question_after(layout: str) -> bool:
    """Whether ``layout`` puts the question after the documents (``after`` and ``inline``)."""
    return layout_kind(layout) != "before"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_like_an_app(text: str, size: int, overlap: int = 0) -> list[str]:
    """``text`` cut as RAG frameworks cut documents (LangChain's ``RecursiveCharacterTextSplitter``
    at sentence ends): sentences packed greedily into chunks of at most ``size`` characters,
    each chunk starting with the last sentences of the one before that fit in ``overlap``
    characters; a sentence longer than ``size`` is cut at spaces. Each chunk is a slice of
    ``text`` (its own characters, whitespace included)."""
    units: list[tuple[int, int]] = []
    start = 0
    for end in [m.start() for m in _SENTENCE_END.finditer(text)] + [len(text)]:
        while end - start > size:  # a sentence longer than a chunk: cut at its last space that fits
            cut = text.rfind(" ", start + 1, start + size)
            cut = start + size if cut <= start else cut
            units.append((start, cut))
            start = cut + (text[cut : cut + 1] == " ")
        if end > start:
            units.append((start, end))
        start = len(text) if end == len(text) else _SENTENCE_END.match(text, end).end()
    chunks, current = [], []
    for unit in units:
        if current and unit[1] - current[0][0] > size:
            chunks.append(text[current[0][0] : current[-1][1]])
            current = [u for u in current if current[-1][1] - u[0] <= overlap and unit[1] - u[0] <= size]
        current.append(unit)
    if current:
        chunks.append(text[current[0][0] : current[-1][1]])
    return chunks


def musique_prompt(question: str, layout: str = "after") -> tuple[str, str]:
    """(system prompt, text after the documents) of the MuSiQue prompt for ``question``.

    ``after`` is the CacheBlend prompt (`MUSIQUE_INSTRUCTION`, then the documents, then
    `musique_query`). ``before`` puts the question into the prompt prefix, ahead of the
    documents (`MUSIQUE_INSTRUCTION_BEFORE` + ``"\n\nQuestion: ..."``), and leaves after
    them only the answer cue (`MUSIQUE_ANSWER_CUE`), without repeating the question. The
    documents' own ids are the same either way, so their chunk KV (computed after the
    prompt's first token) and its keys do not depend on the layout."""
    if question_after(layout):
        return MUSIQUE_INSTRUCTION, musique_query(question)
    return f"{MUSIQUE_INSTRUCTION_BEFORE}\n\nQuestion: {question}", MUSIQUE_ANSWER_CUE


def inline_context(passages: Sequence[str], query: str, chunks: tuple[int, int] | None = None) -> str:
    """A user message with the passages pasted into its text the way RAG frameworks
    stuff a context ("Context:", the passages joined by blank lines, then the query);
    with ``chunks`` (characters, overlap) each passage is first cut as an app cuts it
    (``split_like_an_app``) and its chunks pasted in order, overlaps repeated."""
    if chunks is not None:
        passages = [c for p in passages for c in split_like_an_app(p, *chunks)]
    return "Context:\n\n" + "\n\n".join(passages) + "\n\n" + query


def _check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")


def _require(item: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
    if key not in item:
        raise ValueError(f"{where}: missing key {key!r}")
    if not isinstance(item[key], kind):
        raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {type(item[key]).__name__}")
    return item[key]


def _string_list(item: dict, key: str, where: str) -> tuple[str, ...]:
    values = _require(item, key, list, where)
    if not values or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{where}: {key!r} must be a non-empty list of strings")
    return tuple(values)


def _read_json_list(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of examples, got {type(data).__name__}")
    if not data:
        raise ValueError(f"{path}: the list of examples is empty")
    return data


def _musique_passages(item: dict, n_docs: int, where: str) -> tuple[str, ...]:
    ctxs = _require(item, "ctxs", list, where)
    if len(ctxs) < n_docs:
        raise ValueError(f"{where}: has {len(ctxs)} ctxs, fewer than n_docs={n_docs}")
    passages = []
    for j, ctx in enumerate(ctxs[:n_docs]):
        at = f"{where}, ctx {j}"
        title, text = _require(ctx, "title", str, at), _require(ctx, "text", str, at)
        passages.append(format_musique_passage(title, text))
    return tuple(passages)


def _musique_example(item: Any, index: int, n_docs: int, path: Path) -> Example:
    where = f"{path}: example {index}"
    return Example(
        question=_require(item, "question", str, where),
        documents=_musique_passages(item, n_docs, where),
        answers=_string_list(item, "answers", where),
        id=str(item.get("id", f"{path.stem}-{index}")),
    )


def load_musique(path: str | Path, n_docs: int = 6, limit: int | None = None) -> list[Example]:
    """Load MuSiQue-format examples, keeping the first ``n_docs`` passages of each.

    Each passage becomes ``f"{title}\\n\\n{text}\\n\\n"``. Examples without an ``id``
    are named ``{file stem}-{index}``. Raises ValueError naming the file and the
    example on malformed input, and when an example has fewer than ``n_docs`` passages.
    """
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    _check_limit(limit)
    path = Path(path)
    items = _read_json_list(path)[:limit]
    return [_musique_example(item, i, n_docs, path) for i, item in enumerate(items)]


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None


def _jsonl_example(record: Any, index: int, n_docs: int | None, where: str, stem: str) -> Example:
    documents = _require(record, "documents", list, where)
    if not all(isinstance(d, str) for d in documents):
        raise ValueError(f"{where}: 'documents' must be a list of strings")
    if n_docs is not None and len(documents) < n_docs:
        raise ValueError(f"{where}: has {len(documents)} documents, fewer than n_docs={n_docs}")
    return Example(
        question=_require(record, "question", str, where),
        documents=tuple(documents[:n_docs]),
        answers=_string_list(record, "answers", where),
        id=str(record.get("id", f"{stem}-{index}")),
    )


def load_jsonl(path: str | Path, limit: int | None = None, n_docs: int | None = None) -> list[Example]:
    """Load one example per line: ``{"documents": [...], "question": ..., "answers": [...]}``.

    ``id`` is optional (default ``{file stem}-{index}``); blank lines are skipped;
    ``n_docs`` keeps only the first documents (all when None). Raises ValueError
    naming ``file:line`` on malformed input and for a file without examples.
    """
    if n_docs is not None and n_docs < 1:
        raise ValueError(f"n_docs must be >= 1 or None, got {n_docs}")
    _check_limit(limit)
    path = Path(path)
    examples: list[Example] = []
    for lineno, record in _jsonl_records(path):
        if limit is not None and len(examples) >= limit:
            break
        examples.append(_jsonl_example(record, len(examples), n_docs, f"{path}:{lineno}", path.stem))
    if not examples and limit != 0:
        raise ValueError(f"{path}: empty file")
    return examples


def parse_synthetic_spec(spec: str) -> dict[str, int]:
    """``"synthetic:n=20,docs=4"`` -> ``{"n": 20, "n_docs": 4}`` (generator keyword names)."""
    name, _, options = spec.partition(":")
    if name != "synthetic":
        raise ValueError(f"not a synthetic dataset spec: {spec!r}")
    params: dict[str, int] = {}
    for option in filter(None, (o.strip() for o in options.split(","))):
        key, eq, value = (s.strip() for s in option.partition("="))
        if key not in SYNTHETIC_KEYS or not eq:
            allowed = ", ".join(sorted(SYNTHETIC_KEYS))
            raise ValueError(f"{spec!r}: bad option {option!r}; expected key=value, key in {allowed}")
        try:
            params[SYNTHETIC_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {key} must be an integer, got {value!r}") from None
    return params


def _merge_options(spec: str, from_spec: dict[str, int], kw: dict[str, Any]) -> dict[str, Any]:
    merged = dict(from_spec)
    for key, value in kw.items():
        if key in merged and merged[key] != value:
            raise ValueError(f"{spec!r} sets {key}={merged[key]} but the caller passed {key}={value}")
        merged[key] = value
    return merged


def _load_synthetic(spec: str, kw: dict[str, Any]) -> list[Example]:
    options = _merge_options(spec, parse_synthetic_spec(spec), kw)
    limit = options.pop("limit", None)
    _check_limit(limit)
    n = options.pop("n", SYNTHETIC_DEFAULT_N)
    return generate_synthetic(n if limit is None else min(n, limit), **options)


def load_dataset(spec: str, **kw: Any) -> list[Example]:
    """Load examples named by ``spec``.

    - ``"synthetic"`` or ``"synthetic:n=20,docs=4,doc_tokens=256,seed=0"``: generated
      two-hop questions (`kvblend.eval.synthetic`); ``n`` defaults to 100.
    - a path ending in ``.json``: a MuSiQue-format list (`load_musique`).
    - a path ending in ``.jsonl``: one example per line (`load_jsonl`).

    Keywords (``n_docs``, ``limit``, and for synthetic ``n``, ``doc_tokens``,
    ``seed``) go to the loader; a keyword that is None counts as not given, and one
    that contradicts the spec string raises ValueError.
    """
    kw = {k: v for k, v in kw.items() if v is not None}
    if spec == "synthetic" or spec.startswith("synthetic:"):
        return _load_synthetic(spec, kw)
    suffix = Path(spec).suffix.lower()
    if suffix == ".json":
        return load_musique(spec, **kw)
    if suffix == ".jsonl":
        return load_jsonl(spec, **kw)
    raise ValueError(
        f"unknown dataset {spec!r}: expected a .json or .jsonl file or 'synthetic[:key=value,...]'"
    )

