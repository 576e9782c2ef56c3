"""Freed request memory stays in the process: a second request-sized allocation takes no page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

SNIPPET = """
import resource, sys, torch
from kvblend.engine.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tuned" else False
def cycle():
    bufs = [torch.ones(600_000) for _ in range(40)]  # 40 x 2.4 MB, like one KV cache's layers
    del bufs
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SNIPPET, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings are Linux-only")
def test_freed_memory_is_reused_without_page_faults() -> None:
    applied, tuned = _faults("tuned")
    assert applied
    _, plain = _faults("plain")
    # 5 cycles x 96 MB would be ~117k faults if every page came back from the kernel.
    assert tuned < 2_000, tuned
    assert plain > 10 * max(tuned, 100), (plain, tuned)


def test_opt_out_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvblend.engine.allocator as allocator

    monkeypatch.setenv("KVBLEND_MALLOC_TUNING", "0")
    assert allocator._apply() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings are Linux-only")
def test_engine_on_cpu_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvblend.engine.allocator as allocator
    from kvblend.engine import Engine
    from tests.conftest import make_loaded

    monkeypatch.setattr(allocator, "_applied", None)
    Engine(make_loaded()).close()
    assert allocator._applied is True
