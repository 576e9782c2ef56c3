"""Trust around blending, independent of HTTP.

* ``shadow``: ``shadow_check`` judges a served blended answer against full prefill
  (answer F1, first-token agreement, next-token KL along the answer).
* ``quality``: ``QualityGuard`` keeps a rolling window of shadow results per (model,
  tenant), falls back to full prefill (or a higher ratio) when agreement drops and
  recovers when it returns; it resolves ``method="auto"``. ``serve`` and
  ``ShadowRunner`` show how a server composes them.

The guard sits above the engine (it drives it); the model self-check that the engine
itself runs lives below, in ``kvblend.engine.selfcheck``, and the answer metrics shared
with the evaluation in ``kvblend.metrics``. Submodules are imported by name.
"""
