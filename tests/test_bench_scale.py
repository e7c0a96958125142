"""bench/scale.py end to end at a toy size: the real worker processes over a Redis server of its own, with the
cost-model engine and learner. A benchmark, not a timed test: this only checks that it still runs whole (it once
stayed broken for two stops when the rollout started reading the model's config.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("weight_sync", ["pause", "in_flight"])
def test_the_scale_bench_runs_every_stage_to_the_end(tmp_path, weight_sync):
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, "bench/scale.py", "--workers", "1", "--ks", "1", "--batches", "3",
         "--generation-batch-size", "32", "--no-balanced", "--time-scale", "0.02", "--weight-sync", weight_sync,
         "--json-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert "error" not in run, run
    assert set(run["exit_codes"].values()) == {0}
    assert run["samples"] == 3 * 32 and run["weight_sync"] == weight_sync
    assert run["steady_samples_per_second"] > 0 and run["redis_records"] > 0
