"""Matching cost: stored documents found in 8k-token prompts, with 100 000 stored.

One tenant's index holds ``--documents`` synthetic passages (40-160 words drawn from the
default model's vocabulary, so text has about English's characters per token);
each request is a RAG prompt of ``--tokens`` tokens (counted with the default model's
tokenizer): a system message, then a user message with ``--planted`` stored passages
pasted between filler paragraphs that are stored nowhere, and a question. Times
``DocumentIndex.match`` alone (the character matching; tokenization and rendering are not
in it) over ``--requests`` requests after a warm-up, checks that every planted passage was
found where it was put, and ends with one JSON line (``match_p95_ms``, ``stored_documents``;
also the thread's CPU time per match, which waits on a loaded machine do not inflate).

    .venv/bin/python benchmarks/matching.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvblend.engine.matching import DocumentIndex, IndexedText
from kvblend.models import DEFAULT_MODEL
from kvblend.models.loader import load_tokenizer
from kvblend.models.registry import resolve_packaged

TENANT = "bench"


def vocabulary(tokenizer) -> list[str]:
    """The tokenizer's whole lowercase words (byte-level BPE marks a leading space "Ġ"):
    text of them has about the characters per token of English prose."""
    words = [t[1:] for t in tokenizer.get_vocab() if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower()]
    return sorted(w for w in words if len(w) > 1)


def paragraph(rng: random.Random, words: list[str], lo: int, hi: int) -> str:
    body = " ".join(rng.choices(words, k=rng.randint(lo, hi)))
    return body[0].upper() + body[1:] + "."


def build_index(rng: random.Random, words: list[str], n: int) -> tuple[DocumentIndex, list[str]]:
    """An index with ``n`` stored passages for one tenant (a bound that holds them all)."""
    texts = [paragraph(rng, words, 40, 160) for _ in range(n)]
    index = DocumentIndex(max_bytes=1 << 40)
    batch = 10_000
    for i in range(0, n, batch):
        index.add(TENANT, [IndexedText(t, tuple(range(len(t) // 4)), f"c{i + j}", f"d{i + j}")
                           for j, t in enumerate(texts[i : i + batch])])
    return index, texts


def prompt(rng: random.Random, words: list[str], stored: list[str], planted: int, chars: int) -> tuple[str, list[str]]:
    """A user message of about ``chars`` characters holding ``planted`` stored passages."""
    picked = rng.sample(stored, planted)
    parts, size = [], sum(map(len, picked))
    fillers = []
    while size < chars:
        fillers.append(paragraph(rng, words, 30, 120))
        size += len(fillers[-1]) + 2
    items = picked + fillers
    rng.shuffle(items)
    parts = ["Answer using the context:", *items, "Question: what does the context say?"]
    return "\n\n".join(parts), picked


def chars_per_token(tokenizer, words: list[str], rng: random.Random) -> float:
    sample = "\n\n".join(paragraph(rng, words, 40, 160) for _ in range(50))
    return len(sample) / len(tokenizer(sample, add_special_tokens=False)["input_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length in the default model's tokens")
    ap.add_argument("--planted", type=int, default=10, help="stored passages per prompt")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(resolve_packaged(DEFAULT_MODEL))
    words = vocabulary(tokenizer)
    ratio = chars_per_token(tokenizer, words, rng)
    t = time.perf_counter()
    index, stored = build_index(rng, words, args.documents)
    build_s = time.perf_counter() - t
    system = "You are a helpful assistant. Answer from the context only."
    times, cpu = [], []
    for i in range(args.requests + 10):
        user, picked = prompt(rng, words, stored, args.planted, int(args.tokens * ratio))
        t, c = time.perf_counter(), time.thread_time()
        found = index.match(TENANT, [system, user])
        elapsed, used = time.perf_counter() - t, time.thread_time() - c
        assert sorted(user[m.start : m.end] for m in found) == sorted(picked), "a planted passage was missed"
        if i >= 10:  # warm-up
            times.append(elapsed * 1e3)
            cpu.append(used * 1e3)
    q, qc = statistics.quantiles(times, n=100), statistics.quantiles(cpu, n=100)
    out = {"match_p50_ms": round(q[49], 3), "match_p95_ms": round(q[94], 3), "match_max_ms": round(max(times), 3),
           "match_cpu_p50_ms": round(qc[49], 3), "match_cpu_p95_ms": round(qc[94], 3),
           "stored_documents": args.documents, "prompt_tokens": args.tokens, "prompt_chars": len(user),
           "planted": args.planted, "requests": args.requests, "index_bytes": index.nbytes,
           "index_build_s": round(build_s, 2)}
    print(f"{args.documents} stored passages ({index.nbytes / 2**20:.0f} MiB indexed, built in {build_s:.1f} s); "
          f"{args.tokens}-token prompts ({len(user)} chars), {args.planted} passages each: "
          f"match p50 {out['match_p50_ms']} ms, p95 {out['match_p95_ms']} ms (CPU time of the thread: "
          f"p50 {out['match_cpu_p50_ms']} ms, p95 {out['match_cpu_p95_ms']} ms; wall includes time the OS ran others)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
