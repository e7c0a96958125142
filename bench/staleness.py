"""Bounded staleness on the demo: max_staleness 0, 1, 2, 4 back to back on one vLLM engine.

Per k: steady samples/s, the fraction of trajectories dropped for staleness, observed staleness
(mean, max over every trained trajectory: the learner's version at training minus the version that
sampled it), and accuracy after a fixed number of samples (every run trains the same number) and after
a fixed wall-clock budget (the shortest run's time from its start to its last optimizer step; a faster
k gets further in it). Both accuracies are means over the last ``ACCURACY_WINDOW`` optimizer steps up to
that point. k = 0 is the synchronous baseline: ratios are against it. Prints JSON (and writes it with --json-out).

    .venv/bin/python bench/staleness.py [--steps 400] [--json-out bench/results/staleness.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


ACCURACY_WINDOW = 8  # optimizer steps (two generation batches of the demo) averaged into one accuracy


def accuracy_until(rows: list[dict], keep) -> float | None:
    """Pure: mean accuracy of the last ACCURACY_WINDOW rows for which ``keep(row)`` holds."""
    kept = [r["rewards/accuracy/mean"] for r in rows if keep(r)][-ACCURACY_WINDOW:]
    return round(sum(kept) / len(kept), 3) if kept else None


def summarize(rows: list[dict], completions: list[dict], generation_batch_size: int) -> dict:
    """Pure: the figures of one run from its metrics.jsonl and completions.jsonl rows."""
    batches = rows[-1]["policy_version"]
    t_first = next(r["time"] for r in rows if r["policy_version"] == 1)
    steady = (batches - 1) * generation_batch_size / max(rows[-1]["time"] - t_first, 1e-9)
    staleness = [c["trained_at_version"] - c["policy_version"] for c in completions]
    dropped = sum(r.get("staleness/dropped", 0) for r in rows)
    quarter = max(1, len(rows) // 4)
    return {
        "generation_batches": batches,
        "steady_samples_per_second": round(steady, 2),
        "trained_samples": len(completions),
        "dropped_for_staleness": dropped,
        "fraction_dropped": round(dropped / (dropped + len(completions)), 4),
        "staleness_mean": round(sum(staleness) / len(staleness), 3),
        "staleness_max": max(staleness),
        "staleness_histogram": {str(s): staleness.count(s) for s in sorted(set(staleness))},
        "accuracy_first_quarter": round(sum(r["rewards/accuracy/mean"] for r in rows[:quarter]) / quarter, 3),
        "accuracy_last_quarter": round(sum(r["rewards/accuracy/mean"] for r in rows[-quarter:]) / quarter, 3),
    }


async def measure(steps: int, ks: list[int]) -> dict:
    from config import load_config
    from engines.vllm_engine import start_engine
    from rollstream import train as graph
    from tinymodels.text import tiny_model_path

    # The demo's engine as `rollstream train` starts it (its [rollout] settings, engine threads included).
    engine = await start_engine(load_config("configs/demo.toml", ["rollout.max_model_len=256"]), tiny_model_path())
    results: dict = {"steps": steps, "runs": {}}
    histories: dict[str, tuple[float, list[dict]]] = {}  # label -> (start, metrics rows)
    try:
        for label, k, n in [("warmup", 1, 8)] + [(f"k{k}", k, steps) for k in ks]:
            with tempfile.TemporaryDirectory() as out:
                cfg = load_config(
                    "configs/demo.toml",
                    [
                        f"run.output_dir={json.dumps(out)}",
                        f"run.name=bench-staleness-{label}",
                        f"run.max_steps={n}",
                        f"grpo.max_staleness={k}",
                        "rollout.max_model_len=256",
                    ],
                )
                started, started_unix = time.monotonic(), time.time()
                result = await graph.run_pipeline(cfg, engine=engine)
                wall = time.monotonic() - started
                rows, completions = (
                    read_jsonl(Path(out) / "metrics.jsonl"),
                    read_jsonl(Path(out) / "completions.jsonl"),
                )
            if label == "warmup":
                continue
            run = summarize(rows, completions, cfg.grpo.generation_batch_size)
            run.update(max_staleness=k, exit_code=result.exit_code, wall_seconds=round(wall, 2))
            results["runs"][label] = run
            histories[label] = (started_unix, rows)
            print(f"k={k}: {json.dumps(run)}", file=sys.stderr)
    finally:
        engine.shutdown()
    budget = min(rows[-1]["time"] - start for start, rows in histories.values())
    per_step = cfg.grpo.per_device_train_batch_size  # samples per optimizer step
    samples = min(rows[-1]["step"] for _, rows in histories.values()) * per_step
    for label, (start, rows) in histories.items():
        results["runs"][label]["accuracy_at_wall_seconds"] = {
            "seconds": round(budget, 2),
            "accuracy": accuracy_until(rows, lambda r, start=start: r["time"] - start <= budget),
        }
        results["runs"][label]["accuracy_at_samples"] = {
            "samples": samples,
            "accuracy": accuracy_until(rows, lambda r: r["step"] * per_step <= samples),
        }
    base = results["runs"]["k0"]["steady_samples_per_second"]
    results["ratio_samples_per_second_vs_k0"] = {
        label: round(run["steady_samples_per_second"] / base, 3) for label, run in results["runs"].items()
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (the demo's own 400)")
    parser.add_argument("--ks", default="0,1,2,4", help="max_staleness values (0 first: the baseline)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(measure(args.steps, [int(k) for k in args.ks.split(",")]))
    emit(results, args.json_out)


if __name__ == "__main__":
    main()
