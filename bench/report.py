"""Every benchmark JSON under bench/results/ as Markdown, and the docs' Performance page from it.

- ``python bench/report.py`` prints one Markdown document: a headline table (each figure, its ratio to
  the peer or baseline measured in the same run, and the one command that reproduces it), then one
  section per JSON file (known files as tables, any other file as its scalar fields).
- ``--png bench/results/accuracy_vs_wall.png`` also draws accuracy against wall time for TRL's fastest
  variant and rollstream at max_staleness 0 and 1, from bench/results/peer_trl.json (the demo workload).
- ``--docs`` writes docs/performance.md (the headline table, the PNG, every JSON in full) and copies the
  PNG beside it (docs/assets/), where the mkdocs site can show it. tests/test_docs.py checks the page is
  current: rerun this after adding or changing a results file.

    .venv/bin/python bench/report.py [--results bench/results] [--png PATH] [--docs]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PNG_DEFAULT = "bench/results/accuracy_vs_wall.png"
PERFORMANCE_PAGE = ROOT / "docs" / "performance.md"
PAGE_PNG = "assets/accuracy_vs_wall.png"  # relative to docs/

# The command behind each results file that does not record its own ("command" field).
COMMANDS = {
    "e2e": ".venv/bin/python bench/e2e.py --json-out bench/results/e2e.json",
    "staleness": ".venv/bin/python bench/staleness.py --json-out bench/results/staleness.json",
    "rollout": ".venv/bin/python bench/rollout.py --json-out bench/results/rollout.json",
    "reward": ".venv/bin/python bench/reward.py --json-out bench/results/reward.json",
    "transport": ".venv/bin/python bench/transport.py --json-out bench/results/transport.json",
    "learner": ".venv/bin/python bench/learner.py",
    "metrics_overhead": ".venv/bin/python bench/metrics_overhead.py --json-out bench/results/metrics_overhead.json",
    "peer_trl": ".venv/bin/python bench/peer_trl.py",
    "scale": ".venv/bin/python bench/scale.py",
}
Headline = tuple[str, str, str]  # figure, value, ratio (to what)


def command_of(name: str, data: dict[str, Any]) -> str:
    recorded = data.get("command")
    if isinstance(recorded, str):
        return recorded.replace("python bench/", ".venv/bin/python bench/", 1)
    return COMMANDS.get(name, f".venv/bin/python bench/{name}.py")


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if value is None:
        return "—"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def scalars(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted key -> scalar, for a file without a renderer of its own (long lists are left out)."""
    out: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            out += scalars(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, list):
        if len(data) <= 4:
            for index, value in enumerate(data):
                out += scalars(value, f"{prefix}[{index}]")
    else:
        out.append((prefix, data))
    return out


# ----------------------------------------------------------------------------- per-file renderers


def render_peer_trl(data: dict[str, Any]) -> str:
    parts = []
    for workload, runs in data.get("runs", {}).items():
        rows = []
        for variant, run in runs.items():
            if variant in ("limit", "trl_server"):
                continue
            split = run.get("time_split_seconds", {})
            rows.append(
                [
                    variant,
                    run.get("steady_samples_per_second"),
                    run.get("steady_completion_tokens_per_second"),
                    split.get("generate"),
                    split.get("score_and_logprob_passes"),
                    split.get("train"),
                    split.get("steady_wall"),
                    run.get("peak_rss_mib"),
                    run.get("error"),
                ]
            )
        parts.append(
            f"**{workload}**\n\n"
            + table(
                [
                    "variant",
                    "samples/s",
                    "tokens/s",
                    "generate s",
                    "score + log-prob s",
                    "train s",
                    "steady wall s",
                    "peak RSS MiB",
                    "error",
                ],
                rows,
            )
        )
        limit = runs.get("limit", {})
        if "compute_bound_samples_per_second" in limit:
            parts.append(
                table(
                    ["machine limit", "value"],
                    [
                        ["generation core-s / sample", limit["generate_core_seconds_per_sample"]],
                        ["learner core-s / sample", limit["learner_core_seconds_per_sample"]],
                        [
                            f"compute-bound samples/s ({limit['cores']} cores)",
                            limit["compute_bound_samples_per_second"],
                        ],
                    ],
                )
            )
        server = runs.get("trl_server", {})
        if server:
            errors = [
                f"`trl vllm-serve`: {' / '.join(server.get('trl_vllm_serve', {}).get('error') or [])}",
                f"trainer: {server.get('trainer', {}).get('error')}",
                f"weight sync: {server.get('weight_sync')}",
            ]
            parts.append("TRL server mode (not runnable on CPU):\n\n" + "\n".join(f"- {e}" for e in errors))
        ratios = data.get("ratios", {}).get(workload, {})
        if ratios:
            parts.append(table(["ratio", "value"], [[k, v] for k, v in ratios.items()]))
    return "\n\n".join(parts)


def render_scale(data: dict[str, Any]) -> str:
    rows = [
        [
            r["rollout_workers"],
            r["reward_workers"],
            r["max_staleness"],
            r.get("balanced"),
            r.get("weight_sync", "pause"),
            r.get("learner_gpus"),
            r.get("steady_samples_per_second"),
            r.get("ideal_samples_per_second"),
            r.get("overlap_efficiency"),
            r.get("overlap_efficiency_tail_aware"),
            r.get("speedup_over_sync"),
            r.get("bottleneck_from_queues"),
        ]
        for r in data.get("runs", [])
    ]
    out = table(
        [
            "rollout W",
            "reward R",
            "k",
            "balanced",
            "weight_sync",
            "learner GPUs",
            "samples/s (real; × time_scale = simulated)",
            "ideal",
            "efficiency",
            "efficiency (tail-aware)",
            "speedup vs sync",
            "bottleneck",
        ],
        rows,
    )
    redis = data.get("redis") or {}
    if redis:
        out += "\n\n" + table(["Redis", "value"], [[k, v] for k, v in redis.items() if k != "sharding"])
        out += f"\n\n{redis.get('sharding', '')}"
    return out


def render_staleness(data: dict[str, Any]) -> str:
    rows = []
    for label, run in data.get("runs", {}).items():
        rows.append(
            [
                run.get("max_staleness", label),
                run.get("steady_samples_per_second"),
                data.get("ratio_samples_per_second_vs_k0", {}).get(label),
                run.get("fraction_dropped"),
                run.get("staleness_mean"),
                run.get("staleness_max"),
                (run.get("accuracy_at_samples") or {}).get("accuracy", run.get("accuracy_last_quarter")),
                (run.get("accuracy_at_wall_seconds") or {}).get("accuracy"),
            ]
        )
    return table(
        [
            "max_staleness",
            "samples/s",
            "ratio to k=0",
            "dropped",
            "staleness mean",
            "max",
            "accuracy at fixed samples",
            "accuracy at fixed wall time",
        ],
        rows,
    )


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "peer_trl": render_peer_trl,
    "scale": render_scale,
    "staleness": render_staleness,
}


# ------------------------------------------------------------------------------------- headlines


def headlines_peer_trl(data: dict[str, Any]) -> list[Headline]:
    out = []
    for workload, ratios in data.get("ratios", {}).items():
        runs = data["runs"][workload]
        best, trl = ratios.get("best_rollstream_variant"), ratios.get("fastest_trl_variant")
        if best and trl:
            out.append(
                (
                    f"{workload}: samples/s, {best} vs TRL {trl}",
                    f"{fmt(runs[best]['steady_samples_per_second'])} vs {fmt(runs[trl]['steady_samples_per_second'])}",
                    f"{fmt(ratios['rollstream_vs_fastest_trl_samples_per_second'])}× TRL",
                )
            )
        for name in ("rollstream_k0", "rollstream_k1"):
            if f"{name}_time_to_accuracy_vs_trl" in ratios:
                out.append(
                    (
                        f"{workload}: wall time to TRL's final accuracy ({fmt(ratios['trl_final_accuracy'])}), {name}",
                        f"{fmt(ratios[f'{name}_seconds_to_trl_final_accuracy'])} s",
                        f"{fmt(ratios[f'{name}_time_to_accuracy_vs_trl'])}× TRL's",
                    )
                )
            if f"{name}_training_time_to_accuracy_vs_trl" in ratios:
                out.append(
                    (
                        f"{workload}: the same from each run's first optimizer step (start-up left out), {name}",
                        (f"{fmt(ratios[f'{name}_training_seconds_to_trl_final_accuracy'])} s vs "
                         f"{fmt(ratios['trl_training_seconds_to_final_accuracy'])} s"),
                        f"{fmt(ratios[f'{name}_training_time_to_accuracy_vs_trl'])}× TRL's",
                    )
                )
            if f"{name}_fraction_of_compute_bound" in ratios:
                limit = runs["limit"]["compute_bound_samples_per_second"]
                out.append(
                    (
                        f"{workload}: {name} vs the machine's compute-bound samples/s",
                        f"{fmt(runs[name]['steady_samples_per_second'])} vs {fmt(limit)}",
                        f"{fmt(ratios[f'{name}_fraction_of_compute_bound'])} of the limit",
                    )
                )
        if "compute_bound_vs_fastest_trl" in ratios:
            out.append(
                (
                    f"{workload}: the most any trainer could beat TRL {trl} by here (compute bound / TRL)",
                    f"{fmt(runs['limit']['compute_bound_samples_per_second'])} vs {fmt(runs[trl]['steady_samples_per_second'])}",
                    f"{fmt(ratios['compute_bound_vs_fastest_trl'])}×",
                )
            )
    return out


def headlines_scale(data: dict[str, Any]) -> list[Headline]:
    out = []
    scale = (data.get("cost_model") or {}).get("time_scale", 1.0)  # real seconds per simulated second
    for r in data.get("runs", []):
        if r["max_staleness"] == 0 or "error" in r:
            continue
        name = f"scale: W={r['rollout_workers']} R={r['reward_workers']} k={r['max_staleness']}"
        name += " (balanced)" if r.get("balanced") else ""
        name += f", weight_sync {r.get('weight_sync', 'pause')}"
        out.append(
            (
                name,
                f"{fmt(r['steady_samples_per_second'] * scale)} simulated samples/s",
                (
                    f"efficiency {fmt(r.get('overlap_efficiency'))} "
                    f"(tail-aware {fmt(r.get('overlap_efficiency_tail_aware'))}), "
                    f"{fmt(r.get('speedup_over_sync'))}× sync"
                ),
            )
        )
    redis = data.get("redis") or {}
    if redis:
        out.append(
            (
                "scale: one Redis core saturates at",
                f"{fmt(redis['saturation_records_per_second'])} records/s",
                f"{fmt(redis['saturation_samples_per_second'])} samples/s",
            )
        )
    return out


def headlines_staleness(data: dict[str, Any]) -> list[Headline]:
    out = []
    for label, run in data.get("runs", {}).items():
        accuracy = (run.get("accuracy_at_wall_seconds") or {}).get(
            "accuracy", run.get("accuracy_last_quarter")
        )
        out.append(
            (
                f"staleness: max_staleness {run.get('max_staleness', label)}",
                f"{fmt(run['steady_samples_per_second'])} samples/s, accuracy {fmt(accuracy)}",
                f"{fmt(data.get('ratio_samples_per_second_vs_k0', {}).get(label))}× k=0",
            )
        )
    return out


# The other benches' headline ratios: file -> (dotted key, what the ratio compares).
RATIO_FIELDS = {
    "e2e": [("ratio_samples_per_second", "demo samples/s, max_staleness 1 vs 0")],
    "learner": [("ratio_learner_vs_bare", "learner tokens/s vs a bare transformers loop")],
    "rollout": [("single_turn.ratio_stage_vs_bare", "rollout stage tokens/s vs bare vLLM")],
    "transport": [("ratio", "records/s through one Redis hop vs raw pipelined XADD")],
    "transport_wait": [
        ("ratio_wait_vs_none", "records/s through one Redis hop, WAIT for 1 replica vs none (batch 256)"),
        ("ratio_wait_vs_none_batch_8", "the same, batches of 8"),
    ],
    "reward": [
        ("speedup_2_vs_1_workers.accuracy", "accuracy reward, 2 workers vs 1"),
        ("speedup_2_vs_1_workers.code_execution", "code_execution reward, 2 workers vs 1"),
    ],
}


def headlines_metrics_overhead(data: dict[str, Any]) -> list[Headline]:
    """The paired ratio (each round's "on" run over that round's "off" run: load drifts cancel), and the
    overhead by parts, which load does not move (the bench's docstring says why both)."""
    parts = data["by_parts"]
    return [
        (
            "metrics_overhead: demo samples/s, metrics live + scraped (1/s) vs off",
            (
                f"paired median {fmt(data['paired_on_vs_off_samples_per_second_median'])} "
                f"(pairs {', '.join(fmt(x) for x in data['paired_on_vs_off_samples_per_second_ratios'])})"
            ),
            f"{fmt(data['paired_on_vs_off_samples_per_second_median'])}× off",
        ),
        (
            "metrics_overhead: metrics CPU per sample, by parts (operations + 1/s scrape)",
            f"{fmt(parts['overhead_percent_1s_scrape'])} % of {fmt(parts['cpu_ms_per_sample_off'])} ms/sample",
            f"budget {fmt(data['budget_percent'])} %",
        ),
    ]


def headlines_overhead(data: dict[str, Any]) -> list[Headline]:
    """The pipeline's own core-ms per sample in one process (memory, Redis) and the Procfile's busiest process."""
    out = []
    for kind, label in (("memory", "one process, memory"), ("redis", "one process, Redis")):
        run = data.get(kind)
        if run and "core_ms_per_sample" in run:
            cores = run["core_ms_per_sample"]
            out.append((
                f"overhead: {data['workload']['name']}, {label}: core-ms per sample outside the engine and learner",
                (f"{fmt(cores['outside_engine_and_learner'])} of {fmt(cores['total_this_process_and_engine'])} "
                 f"(event loop {fmt(cores['event_loop'])}); this process busy {fmt(run['this_process_cores'])} cores"),
                (f"{fmt(run['samples_per_second'])} samples/s, "
                 f"{fmt(run.get('fraction_of_compute_bound'))} of the limit"),
            ))
    procfile = data.get("procfile")
    if procfile and "cores_by_process" in procfile:
        busiest = max(procfile["cores_by_process"].items(), key=lambda item: item[1])
        out.append((
            f"overhead: {data['workload']['name']}, the Procfile's workers over Redis: the busiest process",
            (f"{busiest[0]} {fmt(busiest[1])} cores; outside the engine and learner "
             f"{fmt(procfile['core_ms_per_sample']['outside_engine_and_learner'])} core-ms/sample"),
            (f"{fmt(procfile['samples_per_second'])} samples/s, "
             f"{fmt(procfile.get('fraction_of_compute_bound'))} of the limit"),
        ))
    return out


def headlines_generic(name: str, data: dict[str, Any]) -> list[Headline]:
    """Files without a headline function: the ratio fields named in RATIO_FIELDS."""
    values = dict(scalars(data))
    return [
        (f"{name}: {label}", fmt(values.get(key)), f"{fmt(values.get(key))}×")
        for key, label in RATIO_FIELDS.get(name, [])
        if key in values
    ]


def headlines_learner_gpu(data: dict[str, Any]) -> list[Headline]:
    return [(
        f"GPU learner, {data['model']} shape, {data['dtype']}, {data['device']}: tokens/s",
        f"{fmt(data['tokens_per_second']['learner'])} (bare loop {fmt(data['tokens_per_second']['bare'])})",
        (f"{fmt(data['ratio_learner_vs_bare'])}× the bare transformers loop "
         f"(paired median {fmt(data.get('ratio_learner_vs_bare_paired_median'))}×)"),
    )]


def headlines_weight_publish_gpu(data: dict[str, Any]) -> list[Headline]:
    # The file snapshot's figures (the CUDA IPC publish this bench also timed until #29 is gone).
    median = data["seconds_median"]
    return [(
        f"GPU weight publish, {data['shape']} ({data['bytes'] / 1e9:.2f} GB), {data['device']}: file snapshot write + load",
        f"{fmt(median['file_end_to_end'])} s",
        f"write {fmt(median['file_publish'])} s, load {fmt(median['file_load'])} s",
    )]


HEADLINES: dict[str, Callable[[dict[str, Any]], list[Headline]]] = {
    "learner_gpu": headlines_learner_gpu,
    "weight_publish_gpu": headlines_weight_publish_gpu,
    "peer_trl": headlines_peer_trl,
    "scale": headlines_scale,
    "staleness": headlines_staleness,
    "metrics_overhead": headlines_metrics_overhead,
    "overhead": headlines_overhead,
}


def handler(table: dict[str, Callable], name: str) -> Callable | None:
    """The renderer of a result file: by its name, or by the bench it came from (``peer_trl_mid`` is a
    ``peer_trl`` run with other arguments)."""
    return table.get(name) or next((f for bench, f in table.items() if name.startswith(bench + "_")), None)


def load_results(results: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(results.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except ValueError as error:
            print(f"skipping {path}: not JSON ({error})", file=sys.stderr)
    return out


def headline_table(files: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, data in files.items():
        if name.endswith("_smoke"):
            continue  # a smoke run checks the script, its figures are not results
        headlines = handler(HEADLINES, name)
        lines = headlines(data) if headlines else headlines_generic(name, data)
        rows += [[figure, value, ratio, f"`{command_of(name, data)}`"] for figure, value, ratio in lines]
    return table(["figure", "value", "ratio", "reproduce"], rows)


def machine_line(files: dict[str, dict[str, Any]]) -> str:
    for data in files.values():
        machine = data.get("machine")
        if isinstance(machine, dict):
            versions = machine.get("versions") or {}
            text = ", ".join(f"{k} {v}" for k, v in versions.items())
            return f"Machine: {machine.get('platform', '?')}, {machine.get('cpus', '?')} CPUs{'; ' + text if text else ''}."
    return ""


def file_sections(files: dict[str, dict[str, Any]], heading: str = "##") -> list[str]:
    """One section per results file: its command, then its table."""
    parts = []
    for name, data in files.items():
        renderer = handler(RENDERERS, name)
        body = renderer(data) if renderer else table(["field", "value"], scalars(data))
        parts += [f"{heading} {name}", f"`{command_of(name, data)}`", body]
    return parts


def render(files: dict[str, dict[str, Any]]) -> str:
    parts = ["# rollstream benchmarks", machine_line(files), "## Headlines", headline_table(files)]
    parts += file_sections(files)
    return "\n\n".join(p for p in parts if p) + "\n"


def performance_page(files: dict[str, dict[str, Any]], png: bool) -> str:
    """docs/performance.md: the headline table, the accuracy plot when there is one, every file in full."""
    parts = [
        "# Performance",
        "<!-- generated by bench/report.py --docs from bench/results/*.json; edit there, then rerun it -->",
        (
            "The latest figure of every benchmark, each with its ratio to the peer or baseline measured in the "
            "same run and the command that reproduces it. What each bench measures and how to read its "
            "figures: [Benchmarks](benchmarks.md)."
        ),
        machine_line(files),
        "## Headlines",
        headline_table(files),
    ]
    missing = [name for name in COMMANDS if name not in files]
    if missing:
        parts.append(
            "No results yet (run them on a quiet machine): " + ", ".join(f"`{COMMANDS[name]}`" for name in missing) + "."
        )
    if png:
        parts.append(f"![accuracy against wall time]({PAGE_PNG})")
    parts += ["## Every result in full", *file_sections(files, "###")]
    return "\n\n".join(p for p in parts if p) + "\n"


def write_png(peer: dict[str, Any], out: Path) -> bool:
    """Accuracy against wall time on the demo: TRL's fastest variant, rollstream k=0 and k=1."""
    runs = peer.get("runs", {}).get("demo", {})
    trl = peer.get("ratios", {}).get("demo", {}).get("fastest_trl_variant")
    names = [
        n for n in (trl, "rollstream_k0", "rollstream_k1") if n and runs.get(n, {}).get("accuracy_curve")
    ]
    if not names:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        curve = runs[name]["accuracy_curve"]
        # one point per generation batch (64 samples): TRL logs that way, rollstream per optimizer step
        points: dict[int, list[tuple[float, float]]] = {}
        for seconds, samples, accuracy in curve:
            points.setdefault((samples - 1) // 64, []).append((seconds, accuracy))
        xs = [max(s for s, _ in p) for p in points.values()]
        ys = [sum(a for _, a in p) / len(p) for p in points.values()]
        ax.plot(xs, ys, label=name)
    ax.set_xlabel("wall seconds since the run's process started")
    ax.set_ylabel("accuracy reward (mean per generation batch)")
    ax.set_title("demo: accuracy against wall time (bench/peer_trl.py)")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def write_docs(files: dict[str, dict[str, Any]], results: Path = RESULTS, page: Path = PERFORMANCE_PAGE) -> None:
    """docs/performance.md, and the accuracy plot copied beside it (the site serves only docs/)."""
    png = results / Path(PNG_DEFAULT).name
    if png.exists():
        target = page.parent / PAGE_PNG
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, target)
    page.write_text(performance_page(files, png=png.exists()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS, type=Path)
    parser.add_argument(
        "--png",
        nargs="?",
        const=PNG_DEFAULT,
        default=None,
        help=f"write accuracy against wall time (default path {PNG_DEFAULT})",
    )
    parser.add_argument("--docs", action="store_true", help=f"write {PERFORMANCE_PAGE.relative_to(ROOT)}")
    args = parser.parse_args()
    files = load_results(args.results)
    if args.png and "peer_trl" in files:
        write_png(files["peer_trl"], Path(args.png))
    print(render(files))
    if args.docs:
        write_docs(files, args.results)


if __name__ == "__main__":
    main()
