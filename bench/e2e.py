"""End-to-end throughput: the demo with max_staleness 0 (synchronous) vs 1 (one-step-off async).

Both runs share one vLLM engine and run back to back in this invocation, so the ratio compares like
with like. Prints JSON (and writes it under bench/results/ with --json-out):
samples/s and seconds per generation batch for each, and async/sync ratios.

    .venv/bin/python bench/e2e.py [--steps 400] [--json-out bench/results/e2e.json]
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


async def measure(steps: int) -> dict:
    from config import load_config
    from engines.vllm_engine import start_engine
    from rollstream import train as graph
    from tinymodels.text import tiny_model_path

    model_dir = tiny_model_path()
    # The demo's engine as `rollstream train` starts it (its [rollout] settings, engine threads included).
    engine = await start_engine(load_config("configs/demo.toml", ["rollout.max_model_len=256"]), model_dir)
    results: dict = {"steps": steps}
    try:
        # One warm-up run so neither measured run pays the engine's first-batch warm-up.
        for label, staleness, n in (("warmup", 1, 8), ("sync_k0", 0, steps), ("async_k1", 1, steps)):
            with tempfile.TemporaryDirectory() as out:
                cfg = load_config(
                    "configs/demo.toml",
                    [
                        f"run.output_dir={json.dumps(out)}",
                        f"run.name=bench-{label}",
                        f"run.max_steps={n}",
                        f"grpo.max_staleness={staleness}",
                        "rollout.max_model_len=256",
                    ],
                )
                started = time.monotonic()
                result = await graph.run_pipeline(cfg, engine=engine)
                seconds = time.monotonic() - started
                rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            if label == "warmup":
                continue
            batches = rows[-1]["policy_version"]
            samples = batches * cfg.grpo.generation_batch_size
            # steady state: from the first publish to the last, so model build and start-up do not count
            t_first = next(r["time"] for r in rows if r["policy_version"] == 1)
            t_last = rows[-1]["time"]
            steady = (batches - 1) * cfg.grpo.generation_batch_size / max(t_last - t_first, 1e-9)
            results[label] = {
                "max_staleness": staleness,
                "exit_code": result.exit_code,
                "generation_batches": batches,
                "samples": samples,
                "wall_seconds": round(seconds, 2),
                "samples_per_second": round(samples / seconds, 2),
                "steady_samples_per_second": round(steady, 2),
                "seconds_per_generation_batch": round((t_last - t_first) / max(batches - 1, 1), 3),
                "staleness_mean": round(sum(r["staleness/mean"] for r in rows) / len(rows), 3),
                "accuracy_last": rows[-1].get("rewards/accuracy/mean"),
            }
    finally:
        engine.shutdown()
    sync, async_ = results["sync_k0"], results["async_k1"]
    results["ratio_samples_per_second"] = round(async_["steady_samples_per_second"] / sync["steady_samples_per_second"], 3)
    results["ratio_seconds_per_batch"] = round(async_["seconds_per_generation_batch"] / sync["seconds_per_generation_batch"], 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per measured run (the demo's own 400)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    results = asyncio.run(measure(args.steps))
    emit(results, args.json_out)


if __name__ == "__main__":
    main()
