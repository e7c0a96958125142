"""The demo's accuracy curve per loss type: grpo, bnpo, dr_grpo, dapo, cispo, sapo, and the two options of
issue 26 on the grpo loss (scale_rewards = "gdpo", the off-policy sequence mask), in one invocation.

Every run is the demo (`configs/demo.toml`: tiny model, arithmetic, max_staleness 1) for ``--steps``
optimizer steps with one override set, back to back on one shared vLLM engine, so the curves compare like
with like; grpo is the baseline, and each run's accuracy over its last quarter of steps is also given as a
ratio to grpo's. cispo runs with ``epsilon_high = 5.0`` (ScaleRL's value: cispo caps the ratio at
epsilon_high itself). One seed per run: differences of a few points are within run-to-run noise.

Prints JSON (``--json-out`` writes it too) and draws the curves (``--png``, one point per generation batch).

    .venv/bin/python bench/loss_types.py [--steps 400] [--json-out bench/results/loss_types.json]
        [--png bench/results/loss_types.png]
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

# name -> the overrides on the demo config
VARIANTS = {
    "grpo": ["grpo.loss_type=grpo"],
    "bnpo": ["grpo.loss_type=bnpo"],
    "dr_grpo": ["grpo.loss_type=dr_grpo"],
    "dapo": ["grpo.loss_type=dapo"],
    "cispo": ["grpo.loss_type=cispo", "grpo.epsilon_high=5.0"],
    "sapo": ["grpo.loss_type=sapo"],
    "grpo+gdpo": ["grpo.loss_type=grpo", "grpo.scale_rewards=gdpo"],
    "grpo+off_policy_mask": ["grpo.loss_type=grpo", "grpo.off_policy_sequence_mask_delta=0.01"],
}


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


async def measure(steps: int, names: list[str]) -> dict:
    from config import load_config
    from engines.vllm_engine import start_engine
    from rollstream import train as graph
    from tinymodels.text import tiny_model_path

    engine = await start_engine(load_config("configs/demo.toml", ["rollout.max_model_len=256"]), tiny_model_path())
    runs: dict = {}
    try:
        for name in names:
            with tempfile.TemporaryDirectory() as out:
                cfg = load_config("configs/demo.toml", [
                    f"run.output_dir={json.dumps(out)}", f"run.name=bench-loss-{name.replace('+', '-')}",
                    f"run.max_steps={steps}", "rollout.max_model_len=256", *VARIANTS[name],
                ])
                started = time.monotonic()
                result = await graph.run_pipeline(cfg, engine=engine)
                seconds = time.monotonic() - started
                rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            accuracy = [r["rewards/accuracy/mean"] for r in rows]
            quarter = max(1, len(rows) // 4)
            # One point per generation batch: the mean of its optimizer steps.
            per_batch: dict[int, list[float]] = {}
            for r in rows:
                per_batch.setdefault(r["policy_version"], []).append(r["rewards/accuracy/mean"])
            runs[name] = {
                "overrides": VARIANTS[name],
                "exit_code": result.exit_code,
                "steps": len(rows),
                "wall_seconds": round(seconds, 1),
                "accuracy_first_quarter": round(mean(accuracy[:quarter]), 4),
                "accuracy_last_quarter": round(mean(accuracy[-quarter:]), 4),
                "nan_skipped": sum(r.get("nan_skipped", 0) for r in rows),
                "accuracy_curve": [round(mean(v), 4) for _, v in sorted(per_batch.items())],
            }
            print(f"{name}: {runs[name]['accuracy_first_quarter']} -> {runs[name]['accuracy_last_quarter']} "
                  f"in {seconds:.0f} s", file=sys.stderr, flush=True)
    finally:
        engine.shutdown()
    base = runs.get("grpo", {}).get("accuracy_last_quarter")
    return {
        "command": f"python bench/loss_types.py --steps {steps} --json-out bench/results/loss_types.json "
                   "--png bench/results/loss_types.png",
        "steps": steps,
        "workload": "configs/demo.toml (tiny model, arithmetic, max_staleness 1), one seed per run",
        "accuracy_last_quarter": {name: run["accuracy_last_quarter"] for name, run in runs.items()},
        "ratio_last_quarter_vs_grpo": {
            name: round(run["accuracy_last_quarter"] / base, 3) if base else None for name, run in runs.items()
        },
        "runs": runs,
    }


def write_png(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in results["runs"].items():
        ax.plot(range(1, len(run["accuracy_curve"]) + 1), run["accuracy_curve"], label=name,
                linestyle="--" if "+" in name else "-")
    ax.set_xlabel("generation batch (64 samples, 4 optimizer steps)")
    ax.set_ylabel("accuracy reward (mean per generation batch)")
    ax.set_title(f"demo: accuracy per loss type ({results['steps']} steps, bench/loss_types.py)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (the demo's own 400)")
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), help="variants to run")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--png", default=None, type=Path)
    args = parser.parse_args()
    results = asyncio.run(measure(args.steps, args.only))
    emit(results, args.json_out)
    if args.png:
        write_png(results, args.png)


if __name__ == "__main__":
    main()
