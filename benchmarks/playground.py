"""The playground's answer time with each decode-weights kind (issue 42), side by side.

    .venv/bin/python benchmarks/playground.py [--model smollm2-135m] [--questions 6] [--kinds fp32,auto]

One ``kvblend serve`` app per kind (the same model loaded with ``decode_weights`` fp32, the
reference, and ``auto``, int8 on the CPU), each on its own loopback port, both in this process.
For each dev question, on each server in turn, the requests the playground's "Run" sends:
its documents (the question's first 3 passages in the ``documents`` field) warmed with
1-token blends until none misses, then the blend and the full-prefill answers streamed with
``logprobs`` (top 20) and ``explain``, as playground.js asks. Answers are ``--tokens`` long
(``ignore_eos``, so that both kinds decode as many tokens: a quantized decode may end at EOS
elsewhere). Prints one JSON line per kind (median seconds of the blend answer, the full
answer and both, i.e. the answer time after the warm-up) and the ratios to the first kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvblend.engine import Engine  # noqa: E402
from kvblend.models.loader import load_model  # noqa: E402
from kvblend.models.registry import DEFAULT_MODEL  # noqa: E402
from kvblend.server import create_app  # noqa: E402
from kvblend.settings import Settings  # noqa: E402
from tests.server.helpers import uvicorn_thread  # noqa: E402

DATASET = ROOT.parent / "shared" / "data" / "musique_dev.json"
TOP_LOGPROBS = 20  # playground.js


def questions(n: int) -> list[tuple[str, list[str]]]:
    data = json.loads(DATASET.read_text())
    out = []
    for ex in data[:n]:
        docs = [c["text"] if isinstance(c, dict) else str(c) for c in ex["ctxs"][:3]]
        out.append((ex["question"], docs))
    return out


def streamed_s(url: str, body: dict) -> float:
    """Seconds until a streamed chat answer's last chunk."""
    t = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass
    return time.perf_counter() - t


def warm(url: str, body: dict) -> None:
    for _ in range(8):
        reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1,
                                                                "kvblend": {"method": "blend"}}, timeout=600).json()
        if not reply["kvblend"]["doc_misses"]:
            return
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--kinds", default="fp32,auto")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as home, contextlib.ExitStack() as servers:
        urls = {}
        for kind in kinds:
            loaded = load_model(args.model, decode_weights=kind)
            settings = Settings.load(model=args.model, state_dir=str(Path(home) / kind))
            urls[kind] = servers.enter_context(uvicorn_thread(create_app(Engine(loaded), settings)))
        for question, docs in questions(args.questions):
            body = {"model": args.model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                    "max_tokens": args.tokens, "ignore_eos": True, "documents": [{"text": d} for d in docs],
                    "logprobs": True, "top_logprobs": TOP_LOGPROBS}
            for kind in kinds:
                url = urls[kind]
                warm(url, body)
                blend = streamed_s(url, {**body, "kvblend": {"method": "blend", "explain": True}})
                full = streamed_s(url, {**body, "kvblend": {"method": "full"}})
                times[kind].append((blend, full))
    base = None
    for kind in kinds:
        blend = statistics.median(b for b, _ in times[kind])
        full = statistics.median(f for _, f in times[kind])
        total = statistics.median(b + f for b, f in times[kind])
        row = {"kind": kind, "questions": len(times[kind]), "tokens": args.tokens, "blend_answer_s": round(blend, 3),
               "full_answer_s": round(full, 3), "answer_time_s": round(total, 3)}
        if base is None:
            base = total
        else:
            row["answer_time_over_" + kinds[0]] = round(total / base, 3)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
