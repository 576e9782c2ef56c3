"""The paper's two multi-call RAG baselines (CacheBlend, EuroSys '25, §7.1, after
LangChain's chains), built on the engine with ``method="full"`` requests (no KV reuse):

- **MapReduce**: one call per document (that document alone) writes what it says about
  the question; a second call answers the question from those per-document notes.
- **MapRerank**: one call per document answers the question from that document alone;
  the answer with the highest *confidence* wins, where confidence is the mean token
  log-probability of that answer under the model (the log-probabilities of the tokens
  as they were decoded, stop token included), not a score the model writes out.

TTFT is the time until the first token of the final answer: every map call (prefill
and decode, since the final step needs their outputs) plus, for MapReduce, the prefill
of the final call. Quality is scored as for the engine methods (`runner.score_prepared`)
on the prompt the final answer is decoded from: the final call's prompt for MapReduce,
the winning document's prompt for MapRerank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvblend.engine import Engine, Prepared, Request
from kvblend.eval.datasets import Example, check_layout, musique_prompt, question_after
from kvblend.eval.runner import Reference, decode_answer, score_prepared
from kvblend.generation import SamplingParams
from kvblend.generation.decode import slot_steps
from kvblend.generation.slot import DecodeSlot

MAP_INSTRUCTION = (
    "You will read one passage and a question. Write one short sentence with the facts "
    "from the passage that help answer the question. If the passage does not help, write "
    "'Nothing relevant.'"
)
STOP = ("\n",)


MAP_CUE = "Relevant facts from the passage:"


def map_query(question: str) -> str:
    """The user turn of a MapReduce map call (the passage precedes it)."""
    return f"Question: {question}\n{MAP_CUE}"


def map_prompt(question: str, layout: str = "after") -> tuple[str, str]:
    """(system prompt, text after the passage) of a map call: the question after the
    passage (`map_query`), or ``before`` it in the system prompt with only the cue after."""
    if question_after(layout):
        return MAP_INSTRUCTION, map_query(question)
    return f"{MAP_INSTRUCTION}\n\nQuestion: {question}", MAP_CUE


def format_note(index: int, text: str) -> str:
    """One map output as it enters the MapReduce final prompt."""
    return f"Notes from passage {index + 1}: {text.strip()}\n\n"


def default_kl_tokens(max_tokens: int) -> int:
    """Full prefill's answer tokens KL is taken along when not given: 8, or fewer when the
    answer is shorter (`BaselineConfig`, `kvblend eval`'s `EvalConfig`)."""
    return min(8, max_tokens)


@dataclass(frozen=True)
class BaselineConfig:
    """``map_tokens``: the longest MapReduce note; ``max_tokens``: the longest answer
    (MapRerank's map answers included); ``kl_tokens``: full-prefill answer tokens
    teacher-forced for KL (default `default_kl_tokens`); ``layout``: the question ``after``
    or ``before`` the documents in every call (as in the full-prefill reference it is
    scored against)."""

    map_tokens: int = 32
    max_tokens: int = 32
    kl_tokens: int | None = None
    layout: str = "after"

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if self.kl_tokens is None:
            object.__setattr__(self, "kl_tokens", default_kl_tokens(self.max_tokens))
        for name in ("map_tokens", "max_tokens", "kl_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kl_tokens > self.max_tokens:  # KL follows full prefill's answer: at most max_tokens long
            raise ValueError(f"kl_tokens ({self.kl_tokens}) must be <= max_tokens ({self.max_tokens}): KL is taken "
                             "along full prefill's answer, which has at most max_tokens tokens")


class Decoded(NamedTuple):
    """Greedy output: text before the stop string, every generated id (the stop or EOS
    token included) and the log-probability of each id where it was drawn."""

    text: str
    token_ids: list[int]
    logprobs: list[float]


class MapCall(NamedTuple):
    """One per-document call."""

    document: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    prefill_s: float
    elapsed_s: float  # prepare + decode

    @property
    def confidence(self) -> float:
        """Mean token log-probability of the output (-inf when nothing was generated)."""
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else -math.inf


class BaselineRun(NamedTuple):
    """A baseline's outcome: the prompt its answer came from (cache rewound to the
    prompt), the answer, the map calls and the time to the answer's first token."""

    final: Prepared
    text: str
    token_ids: list[int]
    maps: list[MapCall]
    ttft_s: float
    picked: int | None  # MapRerank: the winning document; MapReduce: None


def decode_logprobs(engine: Engine, prepared: Prepared, max_tokens: int) -> Decoded:
    """Greedy decode from a prepared prompt, stopping at a newline or EOS, recording each
    token's log-probability; the cache is rewound to the prompt afterwards."""
    n = prepared.cache.length
    params = SamplingParams(max_tokens=max_tokens, stop=STOP)
    slot = DecodeSlot(engine.tokenizer, prepared.cache, params, engine.loaded.eos_token_ids,
                      engine.model.cfg.context_length)
    parts, ids, logprobs = [], [], []
    for event, logits in slot_steps(engine.model, slot, prepared.logits):
        parts.append(event.text)
        ids.append(event.token_id)
        logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[event.token_id]))
    prepared.cache.truncate(n)
    return Decoded("".join(parts), ids, logprobs)


def _map_call(engine: Engine, index: int, request: Request, max_tokens: int) -> tuple[MapCall, Prepared]:
    t = time.perf_counter()
    prepared = engine.prepare(request, max_tokens)
    out = decode_logprobs(engine, prepared, max_tokens)
    call = MapCall(index, out.text, out.token_ids, out.logprobs, prepared.stats.prompt_tokens,
                   prepared.stats.prefill_s, time.perf_counter() - t)
    return call, prepared


def map_request(ex: Example, index: int, layout: str = "after") -> Request:
    """MapReduce's map call for document ``index``: that document alone."""
    system, query = map_prompt(ex.question, layout)
    return Request(documents=[ex.documents[index]], question=query, system=system, method="full")


def answer_request(ex: Example, documents: Sequence[str], layout: str = "after") -> Request:
    """A full-prefill answer call over ``documents`` with the evaluation prompt."""
    system, query = musique_prompt(ex.question, layout)
    return Request(documents=list(documents), question=query, system=system, method="full")


def reduce_request(ex: Example, maps: Sequence[MapCall], layout: str = "after") -> Request:
    """MapReduce's final call: the question over every map call's notes, in order."""
    return answer_request(ex, [format_note(m.document, m.text) for m in maps], layout)


def map_reduce(engine: Engine, ex: Example, config: BaselineConfig = BaselineConfig()) -> BaselineRun:
    """MapReduce: per-document notes, then one answer from the notes."""
    start = time.perf_counter()
    maps = [_map_call(engine, i, map_request(ex, i, config.layout), config.map_tokens)[0]
            for i in range(len(ex.documents))]
    final = engine.prepare(reduce_request(ex, maps, config.layout), config.max_tokens)
    ttft = time.perf_counter() - start
    text, ids = decode_answer(engine, final, config.max_tokens)
    return BaselineRun(final, text, ids, maps, ttft, None)


def pick_answer(maps: Sequence[MapCall]) -> int:
    """Index (into ``maps``) of the most confident non-empty answer; empty answers win
    only when every answer is empty. Ties go to the earlier document."""
    candidates = [i for i, m in enumerate(maps) if m.text.strip()] or list(range(len(maps)))
    return max(candidates, key=lambda i: (maps[i].confidence, -i))


def map_rerank(engine: Engine, ex: Example, config: BaselineConfig = BaselineConfig()) -> BaselineRun:
    """MapRerank: per-document answers, the most confident one wins."""
    start = time.perf_counter()
    maps: list[MapCall] = []
    best: Prepared | None = None
    for i, doc in enumerate(ex.documents):
        call, prepared = _map_call(engine, i, answer_request(ex, [doc], config.layout), config.max_tokens)
        maps.append(call)
        if pick_answer(maps) == i:
            best = prepared
    ttft = time.perf_counter() - start
    winner = maps[pick_answer(maps)]
    assert best is not None  # set when the first document was read
    return BaselineRun(best, winner.text, winner.token_ids, maps, ttft, winner.document)


BASELINE_RUNNERS = {"mapreduce": map_reduce, "maprerank": map_rerank}


def _final_call(run: BaselineRun) -> tuple[float, int, int]:
    """(prefill seconds, prompt tokens, calls) of the final call: MapRerank has none."""
    if run.picked is not None:
        return 0.0, 0, 0
    return run.final.stats.prefill_s, run.final.stats.prompt_tokens, 1


def score_baseline(engine: Engine, ex: Example, method: str, ref: Reference,
                   config: BaselineConfig = BaselineConfig()) -> dict[str, Any]:
    """Run ``method`` ("mapreduce" or "maprerank") on ``ex`` and score it like the engine
    methods; the time breakdown adds up every call (there is no lookup or load)."""
    if not ex.documents:
        raise ValueError(f"example {ex.id!r}: {method} needs at least one document")
    run = BASELINE_RUNNERS[method](engine, ex, config)
    scores = score_prepared(engine, run.final, ex, ref, run.text, run.token_ids, run.ttft_s, config.kl_tokens)
    prefill_s, prompt_tokens, calls = _final_call(run)
    scores.update(
        lookup_s=0.0, load_s=0.0, prefill_s=prefill_s + sum(m.prefill_s for m in run.maps), recompute_frac=1.0,
        prompt_tokens=prompt_tokens + sum(m.prompt_tokens for m in run.maps), calls=calls + len(run.maps),
        map_s=sum(m.elapsed_s for m in run.maps), map_outputs=[m.text.strip() for m in run.maps],
        confidences=[m.confidence for m in run.maps], picked=run.picked,
        match_rate=1.0,  # every call is given its passages as documents, never matched
        matched_share=sum(map(len, run.final.layout.docs)) / max(1, len(run.final.layout)),  # of the final call
    )
    return scores
