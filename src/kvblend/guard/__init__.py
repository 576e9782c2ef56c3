"""Trust checks around blending: the per-model self-check (``kvblend.guard.selfcheck``).

Submodules are imported by name; this package imports none of them, so the engine can
use the self-check without an import circle.
"""
