"""Evaluation: datasets (MuSiQue, JSONL, synthetic two-hop), the runner that
scores methods against full prefill, MapReduce/MapRerank, the harness, sweeps, report.

The metrics (F1, KL, ...) live in ``kvblend.metrics``, below the engine, the guard and
this package, which all use them. Importing this package is cheap; the engine is imported
by `runner` and what uses it."""
