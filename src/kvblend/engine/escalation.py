"""Which blends recompute again: a risk in the top of its tenant's recent ones.

A question-selected blend without the shift measures how little its recompute moved the
answer from plain reuse's (``blend.strategies.moved_risk``). Where that is high, the blend
most likely left reuse's error in place, and the engine runs its recompute again at twice
the ratio (``FusionPlan.escalate_at``, ``strategies.escalated_keep``). A blend with the shift
has the shift's own risk (``blend_risk``) and, above the bar, runs again whole at twice the
ratio (issue #44). "High" is relative: above the ``BlendConfig.escalate`` quantile of the
tenant's last ``WINDOW`` risks of the same kind (the two kinds are on different scales), so
about the same share of requests pays for a second pass on every model, whatever the scale
of its risks (issue #23, docs/results.md "The tail"); strictly above, so a prompt sent
again and again (equal risks) does not escalate every time. Before ``MIN_SAMPLES`` risks
are in, nothing escalates.

``top_quantile`` is the one rule for "in the top of recent risks": the guard's risk-first
shadow checks use it too (``guard.quality.QualityGuard.risky``).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

WINDOW = 256  # risks kept per tenant
MIN_SAMPLES = 16  # risks a tenant needs before anything escalates
MAX_TENANTS = 4096  # (tenant, risk kind) windows kept; the least recently seen go first


def top_quantile(recent: Sequence[float], q: float, min_samples: int) -> float | None:
    """The ``q``-quantile of ``recent`` (the ceil(q x n)-th smallest): a risk above it is in
    their top 1 - q. None while fewer than ``min_samples`` are in. The guard shadow-checks a
    risk at or above it (a tie costs a check, and its pending checks are bounded); a blend
    escalates only above it (a prompt sent again and again would otherwise pay a second
    recompute every time)."""
    if len(recent) < max(1, min_samples):
        return None
    ordered = sorted(recent)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class RiskWindows:
    """The last ``window`` risks of each tenant and risk kind; thread-safe, bounded in
    (tenant, kind) windows.
    Holds floats only (no request content); one tenant's risks never set another's bar."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES, max_tenants: int = MAX_TENANTS) -> None:
        if not 1 <= min_samples <= window or max_tenants < 1:
            raise ValueError("need 1 <= min_samples <= window and max_tenants >= 1")
        self.window, self.min_samples, self.max_tenants = window, min_samples, max_tenants
        self._risks: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()  # (tenant, kind)
        self._lock = threading.Lock()

    def threshold(self, tenant: str, quantile: float | None, kind: str = "moved") -> float | None:
        """The risk of ``kind`` above which this tenant's next blend escalates
        (``top_quantile``); None when ``quantile`` is None or too few risks are in."""
        if quantile is None:
            return None
        with self._lock:
            recent = tuple(self._risks.get((tenant, kind), ()))
        return top_quantile(recent, quantile, self.min_samples)

    def add(self, tenant: str, risk: float, kind: str = "moved") -> None:
        """Record a blend's risk of ``kind`` (``strategies.risk_kind``), the one that decided
        (before any escalation)."""
        key = (tenant, kind)
        with self._lock:
            recent = self._risks.get(key)
            if recent is None:
                recent = self._risks[key] = deque(maxlen=self.window)
                while len(self._risks) > self.max_tenants:
                    self._risks.popitem(last=False)
            self._risks.move_to_end(key)
            recent.append(risk)
