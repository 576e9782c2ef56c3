"""Running examples through methods and scoring them against full prefill.

Per example: full prefill gives the reference answer and next-token distributions;
every other method is prepared once and then (1) teacher-forced along full's first
answer tokens for KL, (2) rewound and teacher-forced along the gold answer for its
NLL, (3) rewound and decoded greedily for its own answer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvblend.blend.config import CHUNK_PREFIXES, METHODS, PLAIN_STRATEGY, SHIFT_NAMES, SIGNALS, BlendConfig
from kvblend.blend.layout import tokenize_document
from kvblend.engine import Engine, Prepared, Request
from kvblend.engine.calibration import decode_answer, teacher_force
from kvblend.engine.matching import DocumentIndex, IndexedText
from kvblend.engine.shaping import Draft, ShapeConfig, ShapedRequest, shape
from kvblend.eval.datasets import Example, app_chunks, inline_context, layout_kind, musique_prompt
from kvblend.metrics import (
    best_f1, first_line, first_token_agree, kl_divergence, mean_nll, rouge_l, token_f1,
)


BASELINES = ("mapreduce", "maprerank")  # multi-call baselines, run by `kvblend.eval.baselines`
_METHOD_START = re.compile(r",\s*(?=[A-Za-z])")


@dataclass(frozen=True)
class MethodSpec:
    """A labelled method: an engine method (``full``, ``prefix``, ``reuse``, ``blend...``)
    or a multi-call baseline (``mapreduce``, ``maprerank``); see `parse_method`."""

    label: str
    method: str
    blend: BlendConfig = field(default_factory=BlendConfig)


def split_methods(text: str) -> list[str]:
    """``"full,blend:0.3,0.15@1,2,reuse"`` -> ``["full", "blend:0.3,0.15@1,2", "reuse"]``:
    a comma starts a new method only when a letter follows it."""
    return [m.strip() for m in _METHOD_START.split(text) if m.strip()]


def _floats(text: str, what: str, spec: str, kind: type = float) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError as exc:
        raise ValueError(f"method {spec!r}: {what} must be comma-separated numbers") from exc


SELECTION_NAMES = {"q": "question", "oracle": "oracle"}  # grammar name -> BlendConfig.selection
# A spec that names its selection (or check layers, or ``cacheblend``) starts from
# PLAIN_STRATEGY and takes only the modifiers it names: ``blend:0.15:q`` and
# ``cacheblend:0.15`` mean the same whatever the engine's default strategy is; ``blend:0.15``
# is that default.


def _blend_options(spec: str, rest: list[str], base: BlendConfig) -> BlendConfig:
    """``RATIOS[@LAYERS]`` then ``SIGNAL`` or a selection (``q``, ``oracle``): one ratio for
    every check layer, or a schedule of one ratio per layer (layers default to 1..n)."""

    if len(rest) > 2:
        raise ValueError(f"method {spec!r}: expected blend[:RATIOS[@LAYERS]][:SIGNAL|q|oracle]")
    choice = rest[1] if len(rest) > 1 else None
    ratio_text, at, layer_text = (rest[0] if rest else "").partition("@")
    if choice or at:  # a named selection (check layers name deviation's) is exactly what the spec says
        base = replace(base, **PLAIN_STRATEGY)
    if choice in SELECTION_NAMES:
        base = replace(base, selection=SELECTION_NAMES[choice])
    elif choice:
        if choice not in SIGNALS:
            raise ValueError(f"method {spec!r}: signal must be one of {SIGNALS} (or a selection: "
                             f"{', '.join(SELECTION_NAMES)})")
        base = replace(base, selection="deviation", signal=choice)
    if not ratio_text and not at:
        return replace(base)
    ratios = _floats(ratio_text, "ratios", spec) if ratio_text else (base.ratio,)  # ``blend:@2``: the ratio as is
    if at:
        layers = _floats(layer_text, "check layers", spec, int)
    else:
        layers = base.check_layers if len(ratios) == 1 else tuple(range(1, len(ratios) + 1))
    if len(ratios) == 1:
        return replace(base, ratio=ratios[0], check_layers=layers, schedule=None)
    return replace(base, ratio=ratios[-1], check_layers=layers, schedule=ratios)


VDEV_EQUAL = 0.5  # ``+vdev``: question attention and V deviation weigh the same


def _modifier(spec: str, name: str) -> dict[str, Any]:
    """One ``+NAME`` as BlendConfig fields: a chunk prefix, ``budget``, ``sinksK``, ``shift``
    ``vdev[W]`` (the V-deviation hybrid, weight W of the deviation's rank, default 0.5) or
    ``coverS`` (keep at least the tokens covering share S of the question's attention)."""
    if name in CHUNK_PREFIXES:
        return {"chunk_prefix": name}
    if name == "budget":
        return {"budget": True}
    shifts = {name: key for key, name in SHIFT_NAMES.items()}
    if name in shifts:
        return {"shift": True, "shift_test": shifts[name][0], "shift_question": shifts[name][1]}
    if name.startswith("sinks") and name[5:].isdigit():
        return {"sinks": int(name[5:])}
    if name.startswith("cover") and name[5:]:
        return {"cover": _floats(name[5:], "the cover share", spec)[0]}
    if name.startswith("vdev"):
        return {"vdev": _floats(name[4:], "the vdev weight", spec)[0] if name[4:] else VDEV_EQUAL}
    raise ValueError(f"method {spec!r}: '+' takes a chunk prefix ({', '.join(CHUNK_PREFIXES)}), "
                     "budget, sinksK, shift, shiftq, shiftall, shiftallq, vdev[W] or coverS")


def parse_method(spec: str, base: BlendConfig | None = None) -> MethodSpec:
    """A method spec -> MethodSpec; errors name the spec.

    ``full``, ``prefix``, ``reuse``, ``mapreduce``, ``maprerank``,
    ``cacheblend[:RATIO]`` (the paper's algorithm: V deviation at check layer 1), or
    ``blend[:RATIOS[@LAYERS]][:SIGNAL|q|oracle]``: ``blend:0.15`` (the engine's default
    strategy at 0.15; a spec that names a signal, a selection or check layers, and
    ``cacheblend``, get exactly what they name, see ``PLAIN_STRATEGY``),
    ``blend:0.15:k`` (deviation of K), ``blend:0.15@2`` (check layer 2), ``blend:0.3,0.15@1,2``
    (progressive: 30% of document tokens selected at layer 1, a 15% subset at layer 2),
    ``blend:0.15:q`` (question-attention selection), ``blend:0.15:oracle`` (a ceiling: the
    tokens deviating most from full prefill). Modifiers follow with ``+``: ``+prompt`` /
    ``+bos`` (the chunk prefix documents' KV is computed after; also on reuse), ``+budget``
    (per-document budgets), ``+sinks4`` (first 4 tokens of each document), ``+shift``
    (correct the tokens not recomputed, per document where a held-out test says it helps;
    ``+shiftall``: always, as before session 9), ``+vdev`` (with ``q``: rank question attention and
    layer-1 V deviation within each document and average the ranks; ``+vdev0.3`` weighs the
    deviation 0.3), ``+cover0.8`` (with ``q``: recompute at least the fewest tokens that
    hold 0.8 of the question's attention over the documents), e.g. ``blend:0.15:q+budget+sinks4+shift``, ``blend:0.15:q+vdev``.
    Modifiers apply after the selection, whatever their order in the spec.
    """
    from kvblend.errors import InvalidRequestError

    base = base or BlendConfig()
    body, *mods = spec.strip().split("+")
    name, *rest = body.split(":")
    if mods and not (name in ("blend", "cacheblend") or (name == "reuse" and set(mods) <= set(CHUNK_PREFIXES))):
        raise ValueError(f"method {spec!r}: '+' takes a chunk prefix ({', '.join(CHUNK_PREFIXES)}) "
                         "after reuse, or a modifier after blend / cacheblend")
    if name not in METHODS + BASELINES + ("cacheblend",):
        raise ValueError(f"method {spec!r}: unknown; expected one of {', '.join(METHODS + BASELINES)}, cacheblend")
    try:
        fields: dict[str, Any] = {}
        for m in mods:
            fields.update(_modifier(spec, m))
        if name == "cacheblend":
            if len(rest) > 1:
                raise ValueError(f"method {spec!r}: expected cacheblend[:RATIO]")
            ratio = _floats(rest[0], "ratio", spec)[0] if rest and rest[0] else base.ratio
            paper = BlendConfig.cacheblend(ratio, base.chunk_prefix)
            return MethodSpec(spec.strip(), "blend", replace(paper, **fields))
        if name != "blend":
            if rest:
                raise ValueError(f"method {spec!r}: only blend takes options")
            return MethodSpec(spec.strip(), name, replace(base, **fields))
        return MethodSpec(spec.strip(), "blend", replace(_blend_options(spec, rest, base), **fields))
    except InvalidRequestError as exc:
        raise ValueError(f"method {spec!r}: {exc}") from exc


# Each MuSiQue passage stays one document (as the paper's prompt has it): shaped without a cut.
EVAL_SHAPING = ShapeConfig(match=True)


def example_request(ex: Example, spec: MethodSpec, layout: str = "after", engine: Engine | None = None) -> Request:
    """The MuSiQue prompt of ``ex`` for ``spec``, the question placed by ``layout``
    (`datasets.musique_prompt`: ``after`` or ``before`` the documents; ``inline``: after
    them, the passages pasted into the user message's text). With ``engine`` the request
    is shaped (`kvblend.engine.shaping.shape`, layout rendered once), which ``inline``
    needs: its passages are found in the message by matching (`inline_request`)."""
    system, query = musique_prompt(ex.question, layout)
    if layout_kind(layout) == "inline":
        if engine is None:
            raise ValueError("the inline layout is shaped by an engine: pass engine=")
        return inline_request(engine, ex, spec, system, query, app_chunks(layout)).request
    if engine is None:
        return Request(documents=ex.documents, question=query, system=system, method=spec.method, blend=spec.blend)
    draft = Draft(documents=ex.documents, question=query, system=system, method=spec.method, blend=spec.blend)
    return shape(engine, draft, EVAL_SHAPING).request


def example_index(engine: Engine, ex: Example) -> DocumentIndex:
    """An index holding ``ex``'s passages as registered documents (each one chunk, its
    text tokenized alone), as a server holds a tenant's stored documents."""
    index = DocumentIndex(tokenizer=engine.tokenizer)
    index.add("default", [IndexedText(d, tokenize_document(engine.tokenizer, d), f"{ex.id}:{i}", f"{ex.id}:{i}")
                          for i, d in enumerate(ex.documents)])
    return index


def inline_request(engine: Engine, ex: Example, spec: MethodSpec, system: str, query: str,
                   chunks: tuple[int, int] | None = None) -> ShapedRequest:
    """The prompt with ``ex``'s passages pasted into the user turn (`datasets.inline_context`;
    ``chunks``: cut first as an app cuts them, (characters, overlap)), shaped with matching
    over an index of the whole passages: each passage, or run of one, found becomes a document."""
    context = inline_context(ex.documents, query, chunks)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": context}]
    draft = Draft(messages=messages, method=spec.method, blend=spec.blend)
    return shape(engine, draft, EVAL_SHAPING, index=example_index(engine, ex))


@dataclass
class Reference:
    """Full prefill's outcome for one example."""

    answer: str
    answer_ids: list[int]
    logits: torch.Tensor  # (K, V) next-token logits along its first K answer tokens


def gold_nll(engine: Engine, prepared: Prepared, answers: Sequence[str]) -> float:
    """Mean per-token negative log-likelihood of the first gold answer."""
    ids = engine.tokenizer(" " + answers[0].strip(), add_special_tokens=False)["input_ids"] if answers else []
    if not ids:
        return float("nan")
    logp = torch.log_softmax(teacher_force(engine, prepared, ids).double(), dim=-1)
    return mean_nll(logp[torch.arange(len(ids)), torch.tensor(ids)])


def reference(engine: Engine, ex: Example, max_tokens: int, kl_tokens: int,
              layout: str = "after") -> tuple[Reference, dict[str, Any]]:
    spec = MethodSpec("full", "full")
    t = time.perf_counter()
    prepared = engine.prepare(example_request(ex, spec, layout, engine), max_tokens)
    ttft = time.perf_counter() - t
    text, ids = decode_answer(engine, prepared, max_tokens)
    ref = Reference(first_line(text), ids, teacher_force(engine, prepared, ids[:kl_tokens]) if ids else prepared.logits[None])
    return ref, {**score_prepared(engine, prepared, ex, ref, text, ids, ttft, kl_tokens), **match_rate(prepared, ex)}


def score_prepared(engine: Engine, prepared: Prepared, ex: Example, ref: Reference, text: str, ids: list[int],
                   ttft: float, kl_tokens: int) -> dict[str, Any]:
    """Scores of an answer (``text``, ``ids``) decoded from ``prepared``, against ``ref``;
    the prompt is teacher-forced along ref's first ``kl_tokens`` tokens for KL."""
    forced = teacher_force(engine, prepared, ref.answer_ids[:kl_tokens]) if ref.answer_ids else prepared.logits[None]
    s = prepared.stats
    return {
        "answer": first_line(text), "gold_f1": best_f1(first_line(text), ex.answers),
        "rouge_l": max(rouge_l(first_line(text), a) for a in ex.answers),
        "agree_f1": token_f1(first_line(text), ref.answer), "first_token_agree": first_token_agree(ids, ref.answer_ids),
        "kl": kl_divergence(ref.logits, forced), "gold_nll": gold_nll(engine, prepared, ex.answers),
        "ttft_s": ttft, "lookup_s": s.lookup_s, "load_s": s.load_s, "prefill_s": s.prefill_s,
        "recompute_frac": s.recompute_frac, "prompt_tokens": s.prompt_tokens,
        "sources": sorted({d.source for d in s.docs}),  # where document KV came from (tier or "computed")
    }


def match_rate(prepared: Prepared, ex: Example) -> dict[str, float]:
    """How much of the prompt reuse could cover: documents placed per passage
    (``match_rate``: 1 when they are given as documents; under the ``inline`` layout, those
    matching found, runs of app chunks counted one by one) and the share of the prompt's
    tokens inside them (``matched_share``)."""
    layout = prepared.layout
    return {"match_rate": len(layout.docs) / max(1, len(ex.documents)),
            "matched_share": sum(map(len, layout.docs)) / max(1, len(layout))}


def warm_documents(engine: Engine, ex: Example, specs: Sequence[MethodSpec], layout: str = "after") -> None:
    """Store every document's chunk KV (for each chunk-prefix mode used) before timing."""
    for mode in {s.blend.chunk_prefix for s in specs if s.method in ("reuse", "blend")}:
        req = example_request(ex, MethodSpec("warm", "blend", BlendConfig(chunk_prefix=mode)), layout, engine)
        rendered = engine.layout(req)
        engine.warm(list(rendered.docs), engine.chunk_prefix(req, rendered))


def score_method(engine: Engine, ex: Example, spec: MethodSpec, ref: Reference, max_tokens: int = 32,
                 kl_tokens: int = 8, layout: str = "after") -> dict[str, Any]:
    """One engine method on one example, scored against full prefill's ``ref`` (made with
    the same ``layout``; chunk KV should already be stored: `warm_documents`). TTFT = the
    prepare call."""
    t = time.perf_counter()
    prepared = engine.prepare(example_request(ex, spec, layout, engine), max_tokens)
    ttft = time.perf_counter() - t
    text, ids = decode_answer(engine, prepared, max_tokens)
    return {**score_prepared(engine, prepared, ex, ref, text, ids, ttft, kl_tokens), **match_rate(prepared, ex)}


def run_example(engine: Engine, ex: Example, specs: Sequence[MethodSpec], max_tokens: int = 32,
                kl_tokens: int = 8, layout: str = "after") -> dict[str, dict[str, Any]]:
    """Scores of every engine method on one example, keyed by method label ("full" always
    included); `harness.score_spec` also runs the multi-call baselines."""
    warm_documents(engine, ex, specs, layout)
    ref, full_scores = reference(engine, ex, max_tokens, kl_tokens, layout)
    out = {"full": full_scores}
    for spec in specs:
        if spec.label != "full":
            out[spec.label] = score_method(engine, ex, spec, ref, max_tokens, kl_tokens, layout)
    return out
