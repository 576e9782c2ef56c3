"""Whether the blend's shift helps this model: tested once per model, on built-in questions (#23).

The default blend moves the KV of tokens it does not recompute by their document's mean
fresh - stale residual (``BlendConfig.shift``). On SmolLM2 that brings the mean KL to
full prefill from 0.43x plain reuse's to 0.16x; on Qwen2.5-Coder it makes the answer
worse than reuse on 8 of 15 questions, while the same selection without the shift is
worse on none. The per-document held-out test inside the shift judges the KV, not what the
question reads, and passes Qwen2.5's harmful shift. So the sign is a property of the model:
it is measured here once, on the model's output, and on a model where it does not help the
engine runs a blend that asks for the shift without it, recomputing a fixed share more of the
prompt instead (``blend.config.NO_SHIFT_EXTRA``; ``Engine.blend_config``, ``Engine(calibrate=...)``).

The test: five MuSiQue questions shipped with kvblend (``kvblend.data``; dev examples 0, 1
and 3-5, four passages each) are answered by full prefill (greedy, ``ANSWER_TOKENS``
tokens, stopped at a newline); plain reuse and the default blend with and without the
shift are teacher-forced along that answer, and each one's KL to full prefill is divided
by reuse's on the same question. The shift stays when its mean ratio is no higher than the
mean ratio without it. One rule, no threshold, the same on every model.

Results are memoised in the process and stored as JSON under
``$KVBLEND_HOME/calibration/``, keyed as the self-check is (weights, config, dtype,
device type, kvblend build). Only a model loaded from files is tested: one built in memory
(the tests' tiny models) keeps the shift as configured, as does a model whose context is
too short for three of the questions.

A packaged model's verdict is the same on every machine, so it ships with kvblend
(``kvblend.data.SHIFT_VERDICTS``, keyed by weights fingerprint, config digest and compute
dtype, not by build or device): a fresh ``$KVBLEND_HOME`` serves at once (issue #40). A
model with no verdict shipped or stored can be tested in the background
(``calibrate_later``) while it serves; until the verdict is in, the engine blends without
the shift, the choice that is never worse than reuse (``Engine.blend_config``).
"""

from __future__ import annotations

import atexit
import json
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from kvblend.blend.config import BlendConfig
from kvblend.data import MUSIQUE_RAG, MUSIQUE_SAMPLE, SHIFT_VERDICTS, format_musique_passage
from kvblend.engine.request import Request
from kvblend.engine.selfcheck import check_key, read_stored, stored_path, write_atomic
from kvblend.generation import SamplingParams, collect, stream_from
from kvblend.metrics import kl_divergence
from kvblend.models.loader import LoadedModel

ANSWER_TOKENS = 8  # full prefill's answer tokens the KL is measured along (`kvblend eval`'s default)
PASSAGES = 4  # per question: the demo corpus's examples have four
MIN_EXAMPLES = 3  # fewer questions fit the context: no verdict
SYSTEM = "Answer the question from the passages. Give only the answer, in a few words."


@dataclass(frozen=True)
class ShiftVerdict:
    """What the test measured: the mean over questions of each method's KL to full prefill
    divided by reuse's, with and without the shift; ``helps`` is the decision."""

    model: str
    dtype: str
    examples: int
    shift_ratio: float
    plain_ratio: float

    @property
    def helps(self) -> bool:
        return not self.shift_ratio > self.plain_ratio  # a NaN mean keeps the configured shift

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ShiftVerdict":
        raw = json.loads(text)
        return cls(str(raw["model"]), str(raw["dtype"]), int(raw["examples"]),
                   float(raw["shift_ratio"]), float(raw["plain_ratio"]))


class _Preparer(Protocol):  # an Engine: what the test needs of one
    model: Any
    tokenizer: Any
    loaded: LoadedModel

    def prepare(self, request: Request, extra_capacity: int = 0) -> Any: ...

    def layout(self, request: Request) -> Any: ...

    def chunk_prefix(self, request: Request, layout: Any) -> tuple[int, ...]: ...

    def warm(self, documents: list[Any], chunk_prefix: tuple[int, ...]) -> Any: ...

    def close(self) -> None: ...


def teacher_force(engine: _Preparer, prepared: Any, ids: Sequence[int]) -> torch.Tensor:
    """(len(ids), V) logits predicting ``ids`` one by one from the prepared prompt; rewinds after."""
    n = prepared.cache.length
    rows = [prepared.logits[None]]
    if len(ids) > 1:
        tail = torch.tensor(list(ids[:-1]), dtype=torch.long, device=engine.model.device)
        rows.append(engine.model(tail, prepared.cache, logits_for="all"))
    prepared.cache.truncate(n)
    return torch.cat(rows)


def decode_answer(engine: _Preparer, prepared: Any, max_tokens: int) -> tuple[str, list[int]]:
    """The greedy answer from the prepared prompt, stopped at a newline; rewinds after."""
    n = prepared.cache.length
    events = stream_from(engine.model, engine.tokenizer, prepared.cache, prepared.logits,
                         SamplingParams(max_tokens=max_tokens, stop=("\n",)), engine.loaded.eos_token_ids)
    done = collect(events, n)
    prepared.cache.truncate(n)
    return done.text, done.token_ids


def examples() -> list[tuple[str, tuple[str, ...]]]:
    """(question, passages) of the built-in questions, in the eval's passage format."""
    out = []
    for path in (MUSIQUE_SAMPLE, MUSIQUE_RAG):
        for item in json.loads(path.read_text(encoding="utf-8")):
            docs = tuple(format_musique_passage(c["title"], c["text"]) for c in item["ctxs"][:PASSAGES])
            out.append((item["question"], docs))
    return out


def _request(question: str, docs: tuple[str, ...], method: str, blend: BlendConfig) -> Request:
    return Request(documents=docs, question=f"Question: {question}\nAnswer:", system=SYSTEM,
                   method=method, blend=blend)


def _ratios(engine: _Preparer, question: str, docs: tuple[str, ...]) -> tuple[float, float] | None:
    """(shift, plain) KL ratios to reuse's on one question; None when it does not fit the
    context or reuse is already exact there."""
    blend = BlendConfig()
    full = _request(question, docs, "full", blend)
    if len(engine.layout(full)) + ANSWER_TOKENS > engine.loaded.config.context_length:
        return None
    cached = _request(question, docs, "reuse", blend)  # each passage's KV computed alone, stored
    layout = engine.layout(cached)
    engine.warm(list(layout.docs), engine.chunk_prefix(cached, layout))
    prepared = engine.prepare(full, ANSWER_TOKENS)
    _, ids = decode_answer(engine, prepared, ANSWER_TOKENS)
    want = teacher_force(engine, prepared, ids) if ids else prepared.logits[None]

    def kl(method: str, cfg: BlendConfig) -> float:
        got = engine.prepare(_request(question, docs, method, cfg), len(ids) + 1)
        return kl_divergence(want, teacher_force(engine, got, ids) if ids else got.logits[None])

    reuse = kl("reuse", blend)
    if not reuse > 1e-9:
        return None
    return kl("blend", replace(blend, shift=True)) / reuse, kl("blend", replace(blend, shift=False)) / reuse


class _Stopped(Exception):
    """The test was asked to stop (its engine is closing) before it finished."""


def run_calibration(engine: _Preparer, progress: Callable[[str], None] | None = None,
                    stop: threading.Event | None = None) -> ShiftVerdict | None:
    """Measure the verdict with ``engine`` (give it a private store: the questions' chunks
    are computed and kept there). None when fewer than ``MIN_EXAMPLES`` questions fit;
    ``_Stopped`` once ``stop`` is set (checked before each question)."""
    cases = examples()
    rows = []
    for i, (question, docs) in enumerate(cases, 1):
        if stop is not None and stop.is_set():
            raise _Stopped
        if progress is not None:
            progress(f"testing the blend's shift on {engine.loaded.name}: question {i} of {len(cases)}")
        got = _ratios(engine, question, docs)
        if got is not None:
            rows.append(got)
    if len(rows) < MIN_EXAMPLES:
        return None
    mean = lambda xs: math.fsum(xs) / len(xs)  # noqa: E731
    return ShiftVerdict(engine.loaded.name, str(engine.model.dtype), len(rows),
                        mean([s for s, _ in rows]), mean([p for _, p in rows]))


_memo: dict[str, ShiftVerdict | None] = {}
_memo_lock = threading.Lock()
_measure_lock = threading.Lock()  # held while a test runs (minutes), never by a reader


def _progress(message: str) -> None:
    print(f"kvblend: {message}", file=sys.stderr, flush=True)


def shipped_key(loaded: LoadedModel) -> str:
    """What a shipped verdict is valid for: the weights, the model config and the compute dtype."""
    return f"{loaded.fingerprint}:{loaded.config_digest}:{loaded.model.dtype}"


def shipped_verdict(loaded: LoadedModel, path: Path = SHIFT_VERDICTS) -> ShiftVerdict | None:
    """The verdict shipped for this model (``shipped_key``), or None."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    entry = table.get(shipped_key(loaded)) if isinstance(table, dict) else None
    return ShiftVerdict.from_json(json.dumps(entry)) if entry is not None else None


_UNKNOWN = object()


def known_verdict(loaded: LoadedModel) -> ShiftVerdict | None | object:
    """The verdict without testing anything: memoised, shipped or stored; ``_UNKNOWN`` when
    it would have to be measured (``is_known`` tells)."""
    key = check_key(loaded)
    with _memo_lock:
        if key in _memo:
            return _memo[key]
        path = stored_path(loaded, key, "calibration")
        verdict = None if path is None else shipped_verdict(loaded) or read_stored(path, ShiftVerdict.from_json)
        if path is None or verdict is not None:
            _memo[key] = verdict
            return verdict
        return _UNKNOWN


def is_known(verdict: ShiftVerdict | None | object) -> bool:
    return verdict is not _UNKNOWN


def calibrate_later(loaded: LoadedModel, private_engine: Callable[[], _Preparer],
                    done: Callable[[ShiftVerdict | None], None], stop: threading.Event) -> threading.Thread:
    """Run ``ensure_calibrated`` on a daemon thread and hand its verdict to ``done``. The
    test runs its own forward passes beside whoever else uses the model (the model holds no
    state between forwards), at the cost of CPU time while it lasts: a few minutes, once per
    model and build. Setting ``stop`` ends it before its next question, nothing stored (the
    owner joins the thread before the process exits: a thread cut inside a forward pass at
    exit aborts the process)."""
    def at_exit() -> None:  # a process that exits without closing its engine
        stop.set()
        thread.join()

    def run() -> None:
        verdict = None
        try:
            verdict = ensure_calibrated(loaded, private_engine, stop)
        finally:
            atexit.unregister(at_exit)
            done(verdict)

    thread = threading.Thread(target=run, name="kvblend-shift-test", daemon=True)
    atexit.register(at_exit)
    thread.start()
    return thread


def ensure_calibrated(loaded: LoadedModel, private_engine: Callable[[], _Preparer],
                      stop: threading.Event | None = None) -> ShiftVerdict | None:
    """The model's shift verdict: memoised, else shipped with kvblend, else read from disk,
    else measured (on the engine ``private_engine`` builds) and stored. None for a model built
    in memory, too short a context, or a test that raised (reported, not stored): the shift
    then stays as configured."""
    known = known_verdict(loaded)
    if is_known(known):
        return known  # type: ignore[return-value]
    with _measure_lock:  # one test at a time; the memo stays readable meanwhile (``known_verdict``)
        known = known_verdict(loaded)  # measured meanwhile by another thread or process?
        if is_known(known):
            return known  # type: ignore[return-value]
        key = check_key(loaded)
        engine = private_engine()
        try:
            verdict = run_calibration(engine, _progress, stop)
        except _Stopped:
            return None  # neither stored nor memoised: the next engine tests again
        except Exception as exc:  # noqa: BLE001 - a failed test must not stop the model from serving
            _progress(f"the shift test failed on {loaded.name} ({exc!r}); the shift stays as configured")
            verdict = None  # not stored: the next process tests again
        finally:
            engine.close()
        if verdict is not None:
            write_atomic(stored_path(loaded, key, "calibration"), verdict.to_json())
            _progress(f"the shift {'helps' if verdict.helps else 'does not help'} {loaded.name}: "
                      f"KL {verdict.shift_ratio:.2f}x reuse's with it, {verdict.plain_ratio:.2f}x without")
        with _memo_lock:
            _memo[key] = verdict
        return verdict


def forget() -> None:
    """Drop the in-process memo (the stored files stay)."""
    with _memo_lock:
        _memo.clear()
