"""Measure the blend's shift test for installed packaged models and write the table that
ships with kvblend (``src/kvblend/data/shift_verdicts.json``; ``kvblend.engine.calibration``).

    PYTHONPATH=src .venv/bin/python scripts/shift_verdicts.py [--model NAME ...] [--reuse-stored]

Each model is loaded as the server loads it (fp32 on the CPU) and tested on a private
engine; entries of models not named are kept. ``--reuse-stored`` takes a verdict already
measured under ``$KVBLEND_HOME/calibration`` for this build instead of measuring again.
A verdict depends on the weights, the config and the dtype only; the key says so.
"""

from __future__ import annotations

import argparse
import json

from kvblend.data import SHIFT_VERDICTS
from kvblend.engine import Engine
from kvblend.engine import calibration
from kvblend.engine.selfcheck import check_key, read_stored, stored_path
from kvblend.models import load_model
from kvblend.models.registry import PACKAGED


def measure(name: str, reuse_stored: bool) -> tuple[str, calibration.ShiftVerdict]:
    loaded = load_model(name)
    verdict = None
    if reuse_stored:
        verdict = read_stored(stored_path(loaded, check_key(loaded), "calibration"), calibration.ShiftVerdict.from_json)
    if verdict is None:
        engine = Engine(loaded, self_check=False, calibrate=False)
        try:
            verdict = calibration.run_calibration(engine, calibration._progress)
        finally:
            engine.close()
    if verdict is None:
        raise SystemExit(f"{name}: no verdict (too few questions fit its context)")
    return calibration.shipped_key(loaded), verdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="a packaged model (default: every installed one)")
    p.add_argument("--reuse-stored", action="store_true")
    args = p.parse_args()
    names = args.model or [m.name for m in PACKAGED.values() if m.installed()]
    table = json.loads(SHIFT_VERDICTS.read_text()) if SHIFT_VERDICTS.is_file() else {}
    for name in names:
        key, verdict = measure(name, args.reuse_stored)
        table = {k: v for k, v in table.items() if v.get("model") != verdict.model}  # one entry per model
        table[key] = json.loads(verdict.to_json())
        print(f"{name}: shift {'helps' if verdict.helps else 'does not help'} "
              f"({verdict.shift_ratio:.3f}x reuse's KL with it, {verdict.plain_ratio:.3f}x without)")
    SHIFT_VERDICTS.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
