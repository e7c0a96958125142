"""Evaluation while training does not slow the learner: the demo with evaluation off and on, alternated.

One rollout engine serves every run (started with the "priority" policy and room for an eval batch,
as `train` starts it under eval.share_rollout_engine, so both arms run on the same engine); in the "on"
runs evaluation has its own engine (the default), which `run_pipeline` starts before training. Both arms
hold out the same split (data.split_dataset_ratio), so they train on the same rows; "off" sets
eval_strategy = "no". Per run: the learner's steady optimizer steps per second (from the first published
version to the last step, so engine starts and model build do not count), and for "on" the versions
evaluated and skipped and the seconds one evaluation took. Arms: "off"; "on" (evaluation's engine at
eval.engine_nice = 19, the default: it gets the CPU time training leaves idle); "on-nice0" (the same at
nice 0, competing as an equal; --no-nice0 leaves it out). Each round runs every arm once, in rotated
order, and each "on" run is compared with its round's "off" run (paired ratios), so drifts in the other
processes' load cancel; the median paired on/off ratio is the figure (acceptance: >= 0.9).

    .venv/bin/python bench/eval.py [--steps 60] [--repeats 3] [--eval-steps 5] [--eval-limit 8] [--no-nice0]
                                   [--json-out bench/results/eval.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def summarize(rows: list[dict]) -> dict:
    """Pure: the learner's steady steps/s and the evaluations of one run's metrics.jsonl rows."""
    steps = [r for r in rows if r.get("split") != "eval"]
    evals = [r for r in rows if r.get("split") == "eval"]
    t_first = next(r["time"] for r in steps if r["policy_version"] == 1)
    after_first = [r for r in steps if r["time"] > t_first]
    steady = len(after_first) / max(steps[-1]["time"] - t_first, 1e-9)
    out = {"optimizer_steps": len(steps), "steady_optimizer_steps_per_second": round(steady, 4)}
    if evals:
        out.update(
            evaluated_versions=[r["policy_version"] for r in evals],
            skipped_versions=evals[-1]["eval_skipped_versions"],
            eval_seconds_mean=round(statistics.mean(r["eval_runtime"] for r in evals), 2),
            eval_accuracy_first=evals[0].get("eval_rewards/accuracy/mean"),
            eval_accuracy_last=evals[-1].get("eval_rewards/accuracy/mean"),
        )
    return out


def paired_ratios(runs: list[dict], arm: str) -> list[float]:
    """Pure: each round's ``arm`` steps/s over the same round's "off" steps/s."""
    off = {r["round"]: r["steady_optimizer_steps_per_second"] for r in runs if r["arm"] == "off"}
    return [r["steady_optimizer_steps_per_second"] / off[r["round"]] for r in runs if r["arm"] == arm]


def eval_settings(eval_steps: int, eval_limit: int) -> list[str]:
    """Both arms hold out the same 5 %; "on" evaluates eval_limit prompts x 8 samples in one engine batch."""
    return [
        "data.split_dataset_ratio=0.05",
        f"eval.eval_steps={eval_steps}",
        f"eval.eval_limit={eval_limit}",
        f"eval.per_device_eval_batch_size={eval_limit * 8}",
        "eval.eval_num_generations=8",
    ]


async def measure(steps: int, repeats: int, eval_steps: int, eval_limit: int, nice0: bool = True) -> dict:
    from config import load_config
    from engines.vllm_engine import start_engine
    from rollstream import train as graph
    from stages.evaluate import eval_completions_in_flight
    from tinymodels.text import tiny_model_path

    base = load_config(
        "configs/demo.toml", ["rollout.max_model_len=256", *eval_settings(eval_steps, eval_limit)]
    )
    # As `train` starts it under eval.share_rollout_engine: priority policy, room for an eval batch.
    engine = await start_engine(
        base, tiny_model_path(), priority_scheduling=True, extra_num_seqs=eval_completions_in_flight(base)
    )
    results: dict = {
        "steps": steps,
        "eval_steps": eval_steps,
        "eval_limit": eval_limit,
        "engine_priority_scheduling": engine.priority_scheduling,
        "runs": [],
    }
    names = ("off", "on", "on-nice0") if nice0 else ("off", "on")
    arms = [("warmup", 0, 8)] + [
        (arm, round_, steps)
        for round_ in range(repeats)
        for arm in names[round_ % len(names) :] + names[: round_ % len(names)]
    ]
    try:
        for i, (arm, round_, n) in enumerate(arms):
            evaluating = arm != "off"
            with tempfile.TemporaryDirectory() as out:
                overrides = [
                    f"run.output_dir={json.dumps(out)}",
                    f"run.name=bench-eval-{i}-{arm}",
                    f"run.max_steps={n}",
                    "rollout.max_model_len=256",
                    *eval_settings(eval_steps, eval_limit),
                    f"eval.eval_strategy={'steps' if evaluating else 'no'}",
                    f"eval.engine_nice={0 if arm == 'on-nice0' else 19}",
                ]
                cfg = load_config("configs/demo.toml", overrides)
                started = time.monotonic()
                result = await graph.run_pipeline(cfg, engine=engine)
                wall = time.monotonic() - started
                rows = read_jsonl(Path(out) / "metrics.jsonl")
            if arm == "warmup":
                continue
            run = {
                "arm": arm,
                "round": round_,
                "exit_code": result.exit_code,
                "wall_seconds": round(wall, 2),
                **summarize(rows),
            }
            results["runs"].append(run)
            print(json.dumps(run), file=sys.stderr)
    finally:
        engine.shutdown()
    runs = results["runs"]
    results["mean_steady_optimizer_steps_per_second"] = {
        arm: round(
            statistics.mean(r["steady_optimizer_steps_per_second"] for r in runs if r["arm"] == arm), 4
        )
        for arm in names
    }
    for arm in names[1:]:
        ratios = sorted(paired_ratios(runs, arm))
        key = arm.replace("-", "_")
        results[f"paired_{key}_vs_off_ratios"] = [round(x, 3) for x in ratios]
        results[f"paired_{key}_vs_off_median"] = round(statistics.median(ratios), 3)
    results["ratio_on_vs_off"] = results["paired_on_vs_off_median"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every arm, in rotated order")
    parser.add_argument("--eval-steps", type=int, default=5, help="eval.eval_steps of the 'on' runs")
    parser.add_argument("--eval-limit", type=int, default=8, help="eval.eval_limit of the 'on' runs")
    parser.add_argument("--no-nice0", action="store_true", help="leave out the on-nice0 arm")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    emit(
        asyncio.run(measure(args.steps, args.repeats, args.eval_steps, args.eval_limit, not args.no_nice0)),
        args.json_out,
    )


if __name__ == "__main__":
    main()
