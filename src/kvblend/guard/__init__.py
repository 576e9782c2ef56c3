"""Trust around blending, independent of HTTP.

* ``selfcheck``: per model and dtype, once, the exact invariants of re-rotation and
  fusion on a built-in input; a model that fails is refused for KV reuse.
* ``shadow``: ``shadow_check`` judges a served blended answer against full prefill
  (answer F1, first-token agreement, next-token KL along the answer).
* ``quality``: ``QualityGuard`` keeps a rolling window of shadow results per (model,
  tenant), falls back to full prefill (or a higher ratio) when agreement drops and
  recovers when it returns; it resolves ``method="auto"``. ``serve`` and
  ``ShadowRunner`` show how a server composes them.

Submodules are imported by name; this package imports none of them, so the engine can
use the self-check without an import circle.
"""
