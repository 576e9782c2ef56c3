"""End to end on the real SmolLM2: ``kvblend serve`` with the default model and the
README's "Serve" snippet run as written (only the port differs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.helpers import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"


def serve_snippet() -> str:
    section = README.read_text().split("## Serve", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory, smollm2_calibrated):
    work = tmp_path_factory.mktemp("smol")  # a fresh disk tier: the first run's documents are misses
    proc = ServerProcess("smollm2-135m", work, {"store": {"disk_dir": str(work / "kv")}}, ready_s=180)
    yield proc
    assert proc.stop() == 0


def test_readme_serve_snippet_runs_against_smollm2(smol_server) -> None:
    code = serve_snippet()
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{smol_server.port}")
    runs = []
    for _ in range(2):  # the second run repeats the first run's prompts
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout)
    cached = [int(n) for run in runs for n in re.findall(r"cached prompt tokens: (\d+)", run)]
    assert len(cached) == 4 and cached[1] > cached[0], runs  # the second question reused the documents' KV
    assert re.search(r"cached prompt tokens: \d+ hits: \{'memory': 2\}", runs[0].splitlines()[-1]), runs
    assert cached[2] > cached[1], runs  # a repeated prompt: served whole, all but its last token
    answers = [re.split(r"cached prompt tokens: [^\n]*\n", run) for run in runs]
    assert answers[0][0] == answers[1][0] and "Paris" in answers[0][0], runs  # the blend from the documents
