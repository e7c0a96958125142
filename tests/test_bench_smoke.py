"""The benches' smoke tier (#38 item 5): every script in bench/ runs whole at its smallest settings, its JSON
written to a tmp path (never over bench/results/), and fails on any error: a non-zero exit, or an "error"
anywhere in its JSON. A benchmark, not a timed test: it checks that a bench still runs, not its figures (a
module move once broke bench/peer_trl.py and bench/learner.py at import and nothing noticed).

The subprocesses inherit conftest's environment (vLLM and inductor caches in the session's scratch dir, vLLM
in-process) and the tiny models the fixtures build into the shared cache. bench/scale.py has its own smoke
test (tests/test_bench_scale.py); bench/gpu.sh and, without a GPU, bench/weight_publish.py are checked
without running them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIMEOUT_S = 600  # each script takes seconds to ~1.5 min on 2 shared cores; this bounds a hang

# name -> (arguments, marks). "{out}" is the JSON path, "{redis}" the test Redis URL.
SMOKES: dict[str, tuple[list[str], list[pytest.MarkDecorator]]] = {
    "report_json": (["-c", ("import sys; sys.path.insert(0, '.'); from bench.report_json import emit; "
                            "emit(dict(ok=1), sys.argv[1])"), "{out}"], []),
    "report": (["bench/report.py", "--png", "{tmp}/accuracy_vs_wall.png"], []),
    "transport": (["bench/transport.py", "--url", "{redis}", "--records", "512", "--batch", "64", "--repeats", "1",
                   "--seconds", "0.5", "--json-out", "{out}"], []),
    "reward": (["bench/reward.py", "--url", "{redis}", "--accuracy-records", "20", "--code-records", "4",
                "--lag-records", "20", "--json-out", "{out}"], []),
    "env": (["bench/env.py", "--turns", "1", "--step-latency-s", "0.001", "--concurrency", "1",
             "--min-trajectories", "2", "--rounds", "1", "--json-out", "{out}"], []),
    "learner": (["bench/learner.py", "--repeats", "1", "--generation-batch-size", "8",
                 "--per-device-train-batch-size", "4", "--json-out", "{out}"], []),
    "weight_sync": (["bench/weight_sync.py", "--models", "tiny", "--receivers", "1", "--versions", "1",
                     "--networks", "loopback", "--link-versions", "1", "--redis-url", "{redis}", "--json-out", "{out}"],
                    []),
    "e2e": (["bench/e2e.py", "--steps", "8", "--json-out", "{out}"], [pytest.mark.e2e]),
    "staleness": (["bench/staleness.py", "--steps", "8", "--ks", "0,1", "--json-out", "{out}"], [pytest.mark.e2e]),
    "eval": (["bench/eval.py", "--steps", "4", "--repeats", "1", "--eval-steps", "2", "--eval-limit", "2",
              "--no-nice0", "--json-out", "{out}"], [pytest.mark.e2e]),
    "loss_types": (["bench/loss_types.py", "--steps", "8", "--only", "grpo", "--json-out", "{out}",
                    "--png", "{tmp}/loss_types.png"], [pytest.mark.e2e]),
    "metrics_overhead": (["bench/metrics_overhead.py", "--steps", "8", "--repeats", "1", "--json-out", "{out}"],
                         [pytest.mark.e2e]),
    "rollout": (["bench/rollout.py", "--prompts", "2", "--generations", "2", "--max-tokens", "8", "--rounds", "1",
                 "--json-out", "{out}"], [pytest.mark.e2e]),
    "agent": (["bench/agent.py", "--prompts", "2", "--generations", "2", "--max-tokens", "8", "--rounds", "1",
               "--json-out", "{out}"], [pytest.mark.e2e]),
    "vl": (["bench/vl.py", "--prompts", "2", "--generations", "2", "--max-tokens", "8", "--rounds", "1",
            "--json-out", "{out}"], [pytest.mark.e2e]),
    "peer_trl": (["bench/peer_trl.py", "--smoke", "--json-out", "{out}"], [pytest.mark.e2e]),
    "overhead": (["bench/overhead.py", "--steps", "8", "--warm-batches", "1", "--redis-url", "{redis}", "--profile",
                  "--limit-rounds", "1", "--json-out", "{out}"], [pytest.mark.e2e]),
}


def errors_in(value: Any, where: str = "$") -> list[str]:
    """Every non-empty "error" key in the JSON, with its path."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "error" and item:
                found.append(f"{where}.error = {item!r}"[:500])
            found += errors_in(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += errors_in(item, f"{where}[{i}]")
    return found


def run_bench(name: str, args: list[str], tmp_path: Path, redis_url: str) -> subprocess.CompletedProcess:
    argv = [a.format(out=tmp_path / f"{name}.json", tmp=tmp_path, redis=redis_url) for a in args]
    try:
        return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        pytest.fail(f"bench/{name} smoke ran past {TIMEOUT_S} s; stderr tail:\n{tail!r}")


@pytest.fixture(scope="session")
def bench_models(tiny_model_dir, tiny_vl_model_dir, tiny_agent_model_dir) -> None:
    """Build the cached tiny models here, once, so no bench pays for it (or races another for it)."""


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=marks, id=name) for name, (_, marks) in SMOKES.items()]
)
def test_the_bench_runs_whole_at_its_smallest_settings(name, tmp_path, redis_url, request):
    if SMOKES[name][1]:  # the vLLM benches: their tiny models built before the clock starts
        request.getfixturevalue("bench_models")
    if name == "peer_trl":
        pytest.importorskip("trl", reason="the bench extra (pip install -e '.[cpu,bench]') is not installed")
    args, _ = SMOKES[name]
    done = run_bench(name, args, tmp_path, redis_url)
    assert done.returncode == 0, f"bench/{name} exited {done.returncode}; stderr tail:\n{done.stderr[-3000:]}"
    if "{out}" in args:
        out = tmp_path / f"{name}.json"
        assert out.exists(), f"bench/{name} wrote no JSON; stderr tail:\n{done.stderr[-3000:]}"
        results = json.loads(out.read_text())
        assert results, f"bench/{name} wrote empty JSON"
        problems = errors_in(results)
        assert not problems, f"bench/{name} reported errors: {problems}; stderr tail:\n{done.stderr[-2000:]}"
    else:
        assert done.stdout.strip(), f"bench/{name} printed nothing"


def test_weight_publish_runs_on_a_gpu_and_imports_everywhere(tmp_path, redis_url):
    """It measures a GPU learner's snapshot: without CUDA, --help (every module-level import) is what runs."""
    import torch

    if torch.cuda.is_available():
        args = ["bench/weight_publish.py", "--versions", "2", "--warmup", "1", "--json-out", "{out}"]
    else:
        args = ["bench/weight_publish.py", "--help"]
    done = run_bench("weight_publish", args, tmp_path, redis_url)
    assert done.returncode == 0, f"bench/weight_publish exited {done.returncode}; stderr tail:\n{done.stderr[-3000:]}"
    if torch.cuda.is_available():
        assert not errors_in(json.loads((tmp_path / "weight_publish.json").read_text()))


def test_gpu_sh_passes_bash_n_and_shellcheck():
    """bench/gpu.sh needs the GPU machine: here only its syntax and shellcheck."""
    script = ROOT / "bench" / "gpu.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run([str(BIN / "shellcheck"), "--severity=style", str(script)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout


def test_every_bench_script_has_a_smoke():
    """A new bench joins the tier: every bench/*.py is listed above (scale.py in test_bench_scale.py)."""
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    assert scripts - {"scale", "weight_publish"} == set(SMOKES)
