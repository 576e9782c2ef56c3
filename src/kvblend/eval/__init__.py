"""Evaluation: metrics, datasets (MuSiQue, JSONL, synthetic two-hop), the runner that
scores methods against full prefill, MapReduce/MapRerank, the harness, sweeps, report.

Importing this package is cheap; the engine is imported by `runner` and what uses it."""
