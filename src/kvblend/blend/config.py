"""How a request's prompt is built from cached pieces: the method and its knobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvblend.errors import InvalidRequestError

METHODS = ("full", "prefix", "reuse", "blend")
SIGNALS = ("v", "k", "kv")
CHUNK_PREFIXES = ("bos", "prompt")
# How recomputed tokens are chosen: "deviation" (CacheBlend: fresh vs cached K/V at the check
# layers), "question" (attention the question pays each document token over the reused cache),
# "oracle" (deviation from a full prefill's KV: a ceiling for the eval harness, costs a prefill).
SELECTIONS = ("deviation", "question", "oracle")
MAX_SINKS = 64
# What a model whose shift test fails recomputes instead of the shift, as a share of the
# prompt: on Qwen2.5 (the packaged model that fails it) a blend at the default ratio plus
# 0.15 without the shift left no question worse than reuse on 40 held-out questions (max
# 0.99 of reuse's KL), where plus 0.20 (twice the default) left one (1.11); docs/results.md 2.1.
# A fixed addition, not a multiple: its TTFT cost does not grow with the ratio asked for.
NO_SHIFT_EXTRA = 0.15
# (shift_test, shift_question) -> the shift's name in a strategy and a method spec's ``+NAME``
SHIFT_NAMES = {(True, False): "shift", (True, True): "shiftq", (False, False): "shiftall", (False, True): "shiftallq"}
# The paper's selection with no strategy on top: what ``BlendConfig.cacheblend`` is, and
# what a method spec that names its selection starts from (``eval.runner.parse_method``).
PLAIN_STRATEGY = {"selection": "deviation", "budget": False, "sinks": 0, "shift": False, "vdev": 0.0, "cover": 0.0}


def check_layers_fit(check_layers: Sequence[int], num_layers: int, name: str = "check layers",
                     field: str = "check_layers") -> None:
    """InvalidRequestError naming ``field`` when a check layer is past a model of
    ``num_layers`` layers: the one rule for requests, the ``blend.*`` settings, the
    evaluation's methods and fusion itself (``name`` says which in the message)."""
    if max(check_layers) >= num_layers:
        raise InvalidRequestError(f"{name} {list(check_layers)} must be below the model's {num_layers} layers", field)


@dataclass(frozen=True)
class BlendConfig:
    """Selective-recompute settings (CacheBlend).

    ``check_layers`` are the layers where deviation is measured and the recompute set is
    chosen; ``schedule`` gives the kept fraction of document tokens at each of them
    (non-increasing: sets are nested). Without a schedule every check layer keeps
    ``ratio``. ``signal`` picks what deviation compares: fresh vs cached V, K, or both.
    ``chunk_prefix``: a document's KV is computed after the prompt's first token ("bos",
    the attention sink) or after the request's whole prefix ("prompt").
    ``recompute_misses``: a document no tier holds is computed alone first, stored at once
    and blended (False, the default: one computation, and the next request carrying it hits
    at any load), or computed exactly in the prompt and written back later by a second
    computation that falls behind a busy server's traffic (True; issue #40, docs/results.md).

    Strategies (``kvblend.blend.strategies``): ``selection`` (see ``SELECTIONS``);
    ``budget``: each document gets a share of the kept tokens proportional to the score mass
    it receives, with a floor of ``budget_floor`` of its length-proportional share;
    ``sinks``: the first k tokens of every document are chosen first (within the budget);
    ``shift``: tokens not recomputed are moved by their document's mean fresh - stale
    residual (K in the pre-RoPE frame), at every layer, estimated on a uniform sample of the
    document — every s-th token, s = max(``shift_stride``, 2 x candidates / kept, so that
    the sample is at most half of the kept tokens), recomputed within the budget; with
    ``shift_test`` (the default) a document's mean moves its tokens (per KV head, K and V
    apart) only where it lowers the residual of sampled tokens left out of the mean (a
    held-out test in closed form: ``ShiftCorrection._test``), so the shift does not move a
    document whose residual is not a shift; ``+shiftall`` in a method spec is the untested
    shift (the default before session 9). ``shift_question`` (``+shiftq``; off by default)
    also tests each KV head's K and V shifts at every layer on the question rows' held-out
    attention output (``ShiftCorrection._question_test``): it trims Qwen2.5's tail a little
    and costs SmolLM2 more (docs/results.md, "Opt-in strategies"). The
    tokens a selection picks are not a fair sample: their residuals misestimate the rest's
    (on Qwen2.5 shifting by them multiplied reuse's KL several times).
    ``vdev`` (question selection only; 0 = off): a hybrid score, ``(1 - vdev)`` x the
    question-attention score's rank within its document + ``vdev`` x the layer-1 V
    deviation's rank within its document (ranks scaled to [0, 1]); 0.5 weighs them equally.
    ``cover`` (question and oracle selection; 0 = off; deviation selection ignores it): the
    kept count is at least the fewest candidates whose scores hold this share of all the
    candidates' score mass (for ``question``, the question's attention over the documents),
    and never below ``ratio``'s: a request whose question spreads its attention recomputes
    more, one that looks at a few tokens what ``ratio`` says. Ratio 0 still recomputes
    nothing (``strategies.covering_count``; ``+coverS`` in a method spec).
    ``question`` and ``oracle`` select once, with the last ratio of the schedule (check
    layers, schedule and signal are deviation's knobs).
    ``BlendConfig.cacheblend(r)`` is the paper's algorithm: V deviation at layer 1.
    ``escalate`` (a quantile, None = off): a question-selected blend whose risk is above this
    quantile of its tenant's recent risks of the same kind recomputes at twice its ratio
    (``engine.escalation``; docs/results.md, issues #23 and #44). Without the shift the risk is
    the moved risk (``strategies.moved_risk``: how little its recompute moved the answer from
    reuse's) and the blend recomputes again, the tokens it kept among them; with the shift it
    is the shift's own (``strategies.blend_risk``) and the blend runs again whole at twice
    the ratio. A quantile, not a level, so about the same share of requests pays for it on
    every model.
    ``min_reuse``: a blend whose stored KV covers less than this share of the prompt's tokens
    (and that has no missed document to compute and store) runs as an exact prefill instead:
    fusion's per-token recompute costs more than a full prefill's, so below about a third of
    the prompt reused a blend is slower than computing everything (measured on SmolLM2:
    fusion ~0.3 s + 2.4 s x the recomputed share against 2.2 s full, 1,300 tokens; docs/results.md,
    issue #40), and the exact prefill is also exact and prefix-cached. 0 blends whatever is reused.

    The default (``BlendConfig()``, hence ``blend`` in the engine, the CLI, the server and
    the demo) is ``blend:0.2:q+budget+sinks4+shift``: question-attention selection with
    per-document budgets, each document's first 4 tokens, and the sampled shift; the sweep
    behind that choice is in docs/results.md (issue #12), and the ratio, 20 % (15 % until
    issue #44), is the cheapest that met the fidelity goals on all 100 development questions
    held out in folds on SmolLM2 and Gemma 3 (docs/results.md 2.1).

    ``ratio="auto"``: the loading controller picks the ratio per request, at least
    ``r_min`` and at most ``r_max`` (``kvblend.pipeline.controller``).
    """

    ratio: float | str = 0.2
    check_layers: tuple[int, ...] = (1,)
    schedule: tuple[float, ...] | None = None
    signal: str = "v"
    chunk_prefix: str = "bos"
    recompute_misses: bool = False
    selection: str = "question"
    budget: bool = True
    budget_floor: float = 0.5
    sinks: int = 4
    shift: bool = True
    shift_stride: int = 16
    shift_test: bool = True
    shift_question: bool = False
    vdev: float = 0.0
    cover: float = 0.0
    escalate: float | None = 0.9
    min_reuse: float = 0.3

    @classmethod
    def cacheblend(cls, ratio: float = 0.15, chunk_prefix: str = "bos") -> BlendConfig:
        """The paper's selection, kept by name so comparisons stay reproducible."""
        return cls(ratio=ratio, check_layers=(1,), signal="v", chunk_prefix=chunk_prefix, **PLAIN_STRATEGY)

    @property
    def plain(self) -> bool:
        """True when no strategy beyond the paper's deviation top-k is asked for."""
        return self.selection == "deviation" and not (self.budget or self.sinks or self.shift)
    r_min: float = 0.2
    r_max: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "check_layers", tuple(self.check_layers))
        if not 0.0 <= self.r_min <= self.r_max <= 1.0:
            raise InvalidRequestError(f"need 0 <= r_min <= r_max <= 1; got {self.r_min}, {self.r_max}", "r_min")
        if self.auto:
            if self.schedule is not None:
                raise InvalidRequestError("ratio 'auto' picks one ratio: it cannot be combined with a schedule", "schedule")
            return self._check_rest()
        if isinstance(self.ratio, str):
            raise InvalidRequestError(f"ratio must be a number in [0, 1] or 'auto'; got {self.ratio!r}", "ratio")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", tuple(self.schedule))
        for r in self.ratios:
            if not 0.0 <= r <= 1.0:
                raise InvalidRequestError(f"recompute ratio must be within [0, 1], got {r}",
                                          "schedule" if self.schedule is not None else "ratio")
        if any(b > a for a, b in zip(self.ratios, self.ratios[1:])):
            raise InvalidRequestError(f"schedule must be non-increasing (nested sets), got {self.ratios}", "schedule")
        if len(self.ratios) != len(self.check_layers):
            raise InvalidRequestError("schedule needs one ratio per check layer", "schedule")
        self._check_rest()

    def _check_rest(self) -> None:
        """Checks shared by fixed and 'auto' ratios."""
        if not self.check_layers or min(self.check_layers) < 1:
            raise InvalidRequestError("check layers must be >= 1 (layer-0 V carries no context)", "check_layers")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise InvalidRequestError(f"check layers must be strictly increasing, got {self.check_layers}", "check_layers")
        if self.signal not in SIGNALS:
            raise InvalidRequestError(f"signal must be one of {SIGNALS}, got {self.signal!r}", "signal")
        if self.chunk_prefix not in CHUNK_PREFIXES:
            raise InvalidRequestError(f"chunk_prefix must be one of {CHUNK_PREFIXES}, got {self.chunk_prefix!r}", "chunk_prefix")
        if self.selection not in SELECTIONS:
            raise InvalidRequestError(f"selection must be one of {SELECTIONS}, got {self.selection!r}", "selection")
        if not 0 <= self.sinks <= MAX_SINKS:
            raise InvalidRequestError(f"sinks must be within [0, {MAX_SINKS}], got {self.sinks}", "sinks")
        if not 0.0 <= self.budget_floor <= 1.0:
            raise InvalidRequestError(f"budget_floor must be within [0, 1], got {self.budget_floor}", "budget_floor")
        if not 2 <= self.shift_stride <= 4096:
            raise InvalidRequestError(f"shift_stride must be within [2, 4096], got {self.shift_stride}", "shift_stride")
        if not 0.0 <= self.vdev <= 1.0:
            raise InvalidRequestError(f"vdev must be within [0, 1], got {self.vdev}", "vdev")
        if not 0.0 <= self.cover <= 1.0:
            raise InvalidRequestError(f"cover must be within [0, 1], got {self.cover}", "cover")
        if not 0.0 <= self.min_reuse <= 1.0:
            raise InvalidRequestError(f"min_reuse must be a share within [0, 1], got {self.min_reuse}", "min_reuse")
        if self.escalate is not None and not 0.0 <= self.escalate <= 1.0:
            raise InvalidRequestError(f"escalate must be a quantile within [0, 1] or None, got {self.escalate}", "escalate")
        if self.vdev and self.selection != "question":
            raise InvalidRequestError("vdev (the V-deviation hybrid) combines with question selection only", "vdev")

    @property
    def strategy(self) -> str:
        """How tokens are chosen and corrected, e.g. ``deviation`` or ``question+sinks4+shift``."""
        shift = SHIFT_NAMES[(self.shift_test, self.shift_question)]
        mods = ["budget"] * self.budget + [f"sinks{self.sinks}"] * bool(self.sinks) + [shift] * self.shift
        mods += [f"cover{self.cover:g}"] * bool(self.cover)
        return "+".join([self.selection, *mods])

    @property
    def auto(self) -> bool:
        return self.ratio == "auto"

    @property
    def ratios(self) -> tuple[float, ...]:
        """Kept fraction per check layer (ValueError while the ratio is still 'auto')."""
        if self.auto:
            raise ValueError("the ratio is 'auto': resolve it first (BlendConfig.with_ratio)")
        return self.schedule if self.schedule is not None else (float(self.ratio),) * len(self.check_layers)

    def without_shift(self) -> BlendConfig:
        """This config without the shift, recomputing ``NO_SHIFT_EXTRA`` more of the prompt
        instead (at most all): every ratio of a schedule, or the floor ``r_min`` of ``auto``
        (the loading controller still picks within it). What a model whose shift test failed
        runs for a blend that asked for the shift (``Engine.blend_config``)."""
        def more(r: float) -> float:
            return min(1.0, round(r + NO_SHIFT_EXTRA, 9))  # 0.2 + 0.15 is 0.35, not 0.35000000000000003

        if self.auto:
            return replace(self, shift=False, r_min=min(self.r_max, more(self.r_min)))
        if self.schedule is not None:
            return replace(self, shift=False, schedule=tuple(more(r) for r in self.schedule))
        return replace(self, shift=False, ratio=more(float(self.ratio)))

    def twice(self) -> BlendConfig:
        """This config recomputing twice its fixed ratio, or every ratio of its schedule (at
        most all): what an escalated blend runs (``engine.escalation``). ValueError while the
        ratio is 'auto' (the controller resolves it first)."""
        if self.auto:
            raise ValueError("the ratio is 'auto': resolve it first (BlendConfig.with_ratio)")
        if self.schedule is not None:
            return replace(self, schedule=tuple(min(1.0, 2 * r) for r in self.schedule))
        return replace(self, ratio=min(1.0, 2 * float(self.ratio)))

    def with_ratio(self, ratio: float) -> BlendConfig:
        """This config with a fixed ratio (the controller's choice for one request)."""
        return replace(self, ratio=ratio)
