"""Running examples through methods and scoring them against full prefill.

Per example: full prefill gives the reference answer and next-token distributions;
every other method is prepared once and then (1) teacher-forced along full's first
answer tokens for KL, (2) rewound and teacher-forced along the gold answer for its
NLL, (3) rewound and decoded greedily for its own answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvblend.blend.config import BlendConfig
from kvblend.engine import Engine, Prepared, Request
from kvblend.eval.datasets import MUSIQUE_INSTRUCTION, Example, musique_query
from kvblend.eval.metrics import best_f1, first_line, first_token_agree, kl_divergence, mean_nll, token_f1
from kvblend.generation import SamplingParams, collect, stream_from


@dataclass(frozen=True)
class MethodSpec:
    """A labelled method: ``full``, ``prefix``, ``reuse`` or ``blend:RATIO[:SIGNAL]``."""

    label: str
    method: str
    blend: BlendConfig = field(default_factory=BlendConfig)


def parse_method(spec: str, base: BlendConfig | None = None) -> MethodSpec:
    """``blend:0.15`` / ``blend:0.15:k`` / ``full`` ... -> MethodSpec (errors name the spec)."""
    from dataclasses import replace

    base = base or BlendConfig()
    name, *rest = spec.split(":")
    if name != "blend":
        if rest:
            raise ValueError(f"method {spec!r}: only blend takes options")
        return MethodSpec(spec, name, base)
    try:
        ratio = float(rest[0]) if rest else base.ratio
    except ValueError as exc:
        raise ValueError(f"method {spec!r}: ratio must be a number") from exc
    signal = rest[1] if len(rest) > 1 else base.signal
    return MethodSpec(spec, "blend", replace(base, ratio=ratio, schedule=None, signal=signal))


def example_request(ex: Example, spec: MethodSpec, system: str = MUSIQUE_INSTRUCTION) -> Request:
    return Request(documents=ex.documents, question=musique_query(ex.question), system=system,
                   method=spec.method, blend=spec.blend)


@dataclass
class Reference:
    """Full prefill's outcome for one example."""

    answer: str
    answer_ids: list[int]
    logits: torch.Tensor  # (K, V) next-token logits along its first K answer tokens


def _teacher_force(engine: Engine, prepared: Prepared, ids: Sequence[int]) -> torch.Tensor:
    """(len(ids), V) logits predicting ``ids`` one by one from the prepared prompt; rewinds after."""
    n = prepared.cache.length
    rows = [prepared.logits[None]]
    if len(ids) > 1:
        tail = torch.tensor(list(ids[:-1]), dtype=torch.long, device=engine.model.device)
        rows.append(engine.model(tail, prepared.cache, logits_for="all"))
    prepared.cache.truncate(n)
    return torch.cat(rows)


def _decode(engine: Engine, prepared: Prepared, max_tokens: int) -> tuple[str, list[int]]:
    n = prepared.cache.length
    events = stream_from(engine.model, engine.tokenizer, prepared.cache, prepared.logits,
                         SamplingParams(max_tokens=max_tokens, stop=("\n",)), engine.loaded.eos_token_ids)
    done = collect(events, n)
    prepared.cache.truncate(n)
    return done.text, done.token_ids


def gold_nll(engine: Engine, prepared: Prepared, answers: Sequence[str]) -> float:
    """Mean per-token negative log-likelihood of the first gold answer."""
    ids = engine.tokenizer(" " + answers[0].strip(), add_special_tokens=False)["input_ids"] if answers else []
    if not ids:
        return float("nan")
    logp = torch.log_softmax(_teacher_force(engine, prepared, ids).double(), dim=-1)
    return mean_nll(logp[torch.arange(len(ids)), torch.tensor(ids)])


def reference(engine: Engine, ex: Example, max_tokens: int, kl_tokens: int) -> tuple[Reference, dict[str, Any]]:
    spec = MethodSpec("full", "full")
    t = time.perf_counter()
    prepared = engine.prepare(example_request(ex, spec), max_tokens)
    ttft = time.perf_counter() - t
    text, ids = _decode(engine, prepared, max_tokens)
    ref = Reference(first_line(text), ids, _teacher_force(engine, prepared, ids[:kl_tokens]) if ids else prepared.logits[None])
    return ref, _score(engine, prepared, ex, ref, text, ids, ttft, kl_tokens)


def _score(engine: Engine, prepared: Prepared, ex: Example, ref: Reference, text: str, ids: list[int],
           ttft: float, kl_tokens: int) -> dict[str, Any]:
    forced = _teacher_force(engine, prepared, ref.answer_ids[:kl_tokens]) if ref.answer_ids else prepared.logits[None]
    s = prepared.stats
    return {
        "answer": first_line(text), "gold_f1": best_f1(first_line(text), ex.answers),
        "agree_f1": token_f1(first_line(text), ref.answer), "first_token_agree": first_token_agree(ids, ref.answer_ids),
        "kl": kl_divergence(ref.logits, forced), "gold_nll": gold_nll(engine, prepared, ex.answers),
        "ttft_s": ttft, "lookup_s": s.lookup_s, "load_s": s.load_s, "prefill_s": s.prefill_s,
        "recompute_frac": s.recompute_frac, "prompt_tokens": s.prompt_tokens,
    }


def warm_documents(engine: Engine, ex: Example, specs: Sequence[MethodSpec]) -> None:
    """Store every document's chunk KV (for each chunk-prefix mode used) before timing."""
    for mode in {s.blend.chunk_prefix for s in specs if s.method in ("reuse", "blend")}:
        req = example_request(ex, MethodSpec("warm", "blend", BlendConfig(chunk_prefix=mode)))
        layout = engine.layout(req)
        engine.warm(list(layout.docs), engine.chunk_prefix(req, layout))


def run_example(engine: Engine, ex: Example, specs: Sequence[MethodSpec], max_tokens: int = 32,
                kl_tokens: int = 8) -> dict[str, dict[str, Any]]:
    """Scores of every method on one example, keyed by method label ("full" always included)."""
    warm_documents(engine, ex, specs)
    ref, full_scores = reference(engine, ex, max_tokens, kl_tokens)
    out = {"full": full_scores}
    for spec in specs:
        if spec.label == "full":
            continue
        t = time.perf_counter()
        prepared = engine.prepare(example_request(ex, spec), max_tokens)
        ttft = time.perf_counter() - t
        text, ids = _decode(engine, prepared, max_tokens)
        out[spec.label] = _score(engine, prepared, ex, ref, text, ids, ttft, kl_tokens)
    return out
