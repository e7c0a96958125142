"""``rollstream`` command line. Entry points stay small and import heavy modules late."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

# CPU-only torchvision workaround (an import hook, costs nothing until transformers loads a Qwen-VL module).
# At the top: spawned vLLM processes re-import the main module's top-level imports, and only so get it.
import data.vl_compat  # noqa: F401
from config import (
    FIELDS,
    SECTIONS,
    Config,
    ConfigError,
    config_from_dict,
    format_config,
    load_config,
    resolve_output_dir,
    swift_args,
    trl_args,
)
from config.render import toml_value
from config.schema import field_default
from pipeline import log
from pipeline.edges import STAGE_NAMES
from pipeline.errors import SetupError, UserError
from pipeline.plugins import load_plugins
from pipeline.run_dir import latest_weights
from rollstream.report import Reporters

# Subcommands that read a config, and so take ms-swift's argument names as flags too.
_CONFIG_COMMANDS = ("train", "worker", "eval", "show", "top", "reset")
_SWIFT_FLAGS_HELP = (
    "ms-swift's argument names are flags too (--reward_funcs accuracy format --num_generations 8 --model ID "
    "--dataset a.jsonl b#100 ...: docs/swift-arguments.md); they override the file, --set overrides them"
)


def _config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    # -c is checked in main(): ms-swift flags alone make a config too
    parser.add_argument("-c", "--config", help="TOML config file (see configs/); or ms-swift flags alone")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field; the value parses as TOML (--set 'reward.reward_weights=[1.0, 0.5]')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream",
        description="GRPO-family RL training as an event-driven pipeline of asyncio stage workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train", help="run every stage in this process (memory transport by default)", allow_abbrev=False,
        epilog=_SWIFT_FLAGS_HELP,
    )
    _config_args(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR|latest",
        help="continue from a checkpoint: a checkpoint-<step> dir, an output dir, or latest (the default)",
    )

    worker = commands.add_parser(
        "worker", help="run one stage worker (the Procfile's lines)", allow_abbrev=False, epilog=_SWIFT_FLAGS_HELP
    )
    worker.add_argument("stage", choices=["feeder", "rollout", "reward", "advantage", "learner", "evaluate"])
    _config_args(worker)
    worker.add_argument("--burst", action="store_true", help="exit when the input stream is empty")
    worker.add_argument("--worker-id", default=None, help="consumer name (default: stage-host-pid)")
    worker.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /healthz (0 = off)")
    worker.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR|latest",
        help="learner only: continue from a checkpoint (a checkpoint-<step> dir, an output dir, or latest)",
    )

    evaluate = commands.add_parser(
        "eval", help="evaluate saved weights once on the held-out set (same prompts, seeds and rewards as in a run)",
        allow_abbrev=False, epilog=_SWIFT_FLAGS_HELP,
    )
    _config_args(evaluate)
    evaluate.add_argument(
        "--weights",
        required=True,
        metavar="DIR|RUN_DIR[:VERSION]",
        help="a weights snapshot (RUN_DIR/weights/v000004), a checkpoint-<step>, or a run directory "
        "(its newest snapshot, or :VERSION)",
    )
    evaluate.add_argument("-o", "--out", default=None, help="JSON to write (default: eval-v<VERSION>.json beside the weights)")

    config = commands.add_parser("config", help="inspect configs")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_commands.add_parser(
        "show", help="print the resolved config with every derived value", allow_abbrev=False, epilog=_SWIFT_FLAGS_HELP
    )
    _config_args(show)
    from_swift = config_commands.add_parser(
        "from-swift",
        help="convert an ms-swift run's args.json into a rollstream TOML, listing every argument not carried and why",
    )
    from_swift.add_argument(
        "args_json", metavar="ARGS_JSON",
        help="the args.json an ms-swift run wrote (its output dir), or an ms-swift launch file (.yaml / .json)",
    )
    from_swift.add_argument("-o", "--out", default=None, help="TOML to write (default: print it)")
    from_swift.add_argument("--name", default=None, help="run.name of the converted run (default: rollstream's)")
    from_swift.add_argument(
        "--accept-changes", action="store_true",
        help="write the config even where it would not train what the ms-swift run trained (a refused argument, "
        "the training processes, the precision: each is listed; without this flag nothing is written, exit 3)",
    )

    from_trl = config_commands.add_parser(
        "from-trl",
        help="convert a saved TRL GRPOConfig (JSON or YAML) into a rollstream TOML with TRL's defaults, listing every "
        "field not carried and why",
    )
    from_trl.add_argument(
        "grpo_config", metavar="GRPO_CONFIG",
        help="GRPOConfig(...).to_json_string() / to_dict() saved as .json, or the .yaml `trl grpo --config` reads",
    )
    from_trl.add_argument("-o", "--out", default=None, help="TOML to write (default: print it)")
    from_trl.add_argument("--name", default=None, help="run.name of the converted run (default: rollstream's)")
    from_trl.add_argument(
        "--accept-changes", action="store_true",
        help="write the config even where it would not train what TRL trains (each difference is listed; without "
        "this flag nothing is written, exit 3)",
    )

    tiny = commands.add_parser("tiny-model", help="the built-in tiny model")
    tiny_commands = tiny.add_subparsers(dest="tiny_command", required=True, metavar="ACTION")
    build = tiny_commands.add_parser("build", help="build (or reuse from the cache) the tiny model")
    build.add_argument("--out", default=None, help="directory to write it to (default: the user cache)")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.add_argument(
        "--recipe", default="tiny", choices=["tiny", "tiny-gym", "tiny-agent", "mid"],
        help="which built-in model (tiny: the demo's; tiny-agent: calls an add tool)",
    )
    build.add_argument("--gym", action="store_true", help='the gym demo\'s model: the same as --recipe tiny-gym')
    build.add_argument("--vl", nargs="?", const="qwen2_vl", default=None, choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
                       help="a tiny image-prompt model of this architecture (default qwen2_vl), warm-started on "
                       "the built-in shapes task")

    top = commands.add_parser(
        "top", help="live view of a run's edges and learner version (Redis transport)", allow_abbrev=False
    )
    _config_args(top)
    top.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds")
    top.add_argument("--once", action="store_true", help="print one table and exit")

    plot = commands.add_parser("plot", help="PNG of a run's training curves (from RUN_DIR/metrics.jsonl)")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a `rollstream train` output directory")
    plot.add_argument("-o", "--out", default=None, help="PNG to write (default: RUN_DIR/plot.png)")

    inspect = commands.add_parser(
        "inspect", help="last completions with rewards, dead letters with reasons, and the config of a run"
    )
    inspect.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help="a `rollstream train` output directory")
    inspect.add_argument("--redis", metavar="URL", default=None, help="read a live run's streams instead")
    inspect.add_argument("--run", metavar="NAME", default=None, help="run name (with --redis)")
    inspect.add_argument("--last", type=int, default=10, help="completions to show")

    ledger = commands.add_parser("ledger", help="audit a run's ledger (run.ledger = true)")
    ledger_commands = ledger.add_subparsers(dest="ledger_command", required=True, metavar="ACTION")
    ledger_check = ledger_commands.add_parser(
        "check", help="every released group trained once or dropped with a reason; exits 1 on any violation"
    )
    ledger_check.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help="a `rollstream train` output directory")
    ledger_check.add_argument("--redis", metavar="URL", default=None, help="read a run's Redis streams instead")
    ledger_check.add_argument("--run", metavar="NAME", default=None, help="run name (with --redis)")

    reset = commands.add_parser(
        "reset", help="delete a run's Redis streams (to start it again from scratch)", allow_abbrev=False
    )
    _config_args(reset)

    env_serve = commands.add_parser("env-serve", help="serve a registered gym Env over HTTP (envs[\"remote\"] uses it)")
    env_serve.add_argument("env", metavar="PLUGIN.py:NAME", help="a plugin file and the env name it registers "
                           "(or NAME alone for a built-in: guess_number, gridworld)")
    env_serve.add_argument("--port", type=int, default=8100, help="TCP port (0 = any free one, printed)")
    env_serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless clients are remote)")
    env_serve.add_argument("--timeout", type=float, default=60.0, help="seconds one reset/step/close may take")
    env_serve.add_argument("--max-sessions", type=int, default=1024, help="live envs at most (more get HTTP 503)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("inspect", "ledger") and (args.run_dir is None) == (args.redis is None or args.run is None):
        parser.error(f"{args.command} takes RUN_DIR, or --redis URL --run NAME (not both)")
    reads_config = args.command in _CONFIG_COMMANDS or getattr(args, "config_command", None) == "show"
    if extra and not reads_config:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if reads_config:
            args.swift = trl_args.parse_flags(extra)  # ms-swift's names, and TRL's it lacks
            _note_flags_without_effect(args.swift)
            if args.config is None and "rlhf_type" in args.swift:
                _note_ms_swift_command(args.swift, args.overrides)
            if args.config is None and not args.swift and not args.overrides:
                parser.error("give a config: -c FILE, and/or ms-swift flags (--model ... --reward_funcs ...)")
        if args.command == "config":
            if args.config_command == "from-swift":
                return _from_swift(args)
            if args.config_command == "from-trl":
                return _from_trl(args)
            return _config_show(args)
        if args.command == "tiny-model":
            from tinymodels.recipes import MODEL_RECIPES, VL_RECIPES
            from tinymodels.text import build_tiny_model

            recipe = VL_RECIPES[args.vl] if args.vl else MODEL_RECIPES["tiny-gym" if args.gym else args.recipe]
            path = build_tiny_model(Path(args.out) if args.out else None, force=args.force, recipe=recipe)
            print(path)
            return 0
        if args.command == "train":
            from rollstream.train import train

            return train(_load(args), resume=args.resume)
        if args.command == "worker":
            return asyncio.run(_worker(args))
        if args.command == "eval":
            from rollstream.evaluate_offline import run_offline

            asyncio.run(run_offline(_load(args), args.weights, Path(args.out) if args.out else None))
            return 0
        if args.command == "top":
            from rollstream import top

            return top.main(_load(args), interval=args.interval, once=args.once)
        if args.command == "plot":
            from rollstream import plot

            print(plot.write(Path(args.run_dir), Path(args.out) if args.out else None))
            return 0
        if args.command == "inspect":
            from rollstream import inspect_run

            return inspect_run.main(args.run_dir, args.redis, args.run, last=args.last)
        if args.command == "ledger":
            from pipeline import ledger

            return ledger.main(args.run_dir, args.redis, args.run)
        if args.command == "reset":
            return asyncio.run(_reset(_load(args)))
        if args.command == "env-serve":
            return asyncio.run(_env_serve(args))
    except KeyboardInterrupt:
        return 130
    except (UserError, FileNotFoundError, swift_args.SwiftArgError) as exc:
        # Every layer raises a pipeline.errors.UserError for what the user fixes (a missing file too):
        # one line, no traceback, exit 2. Anything else is a bug and keeps its traceback.
        kind = "config error" if isinstance(exc, (ConfigError, swift_args.SwiftArgError)) else "error"
        print(f"{kind}: {exc}", file=sys.stderr)
        return 2
    return 0


async def _env_serve(args: argparse.Namespace) -> int:
    from schedulers.remote_env import serve

    if args.timeout <= 0 or args.max_sessions < 1 or not 0 <= args.port <= 65535:
        raise SystemExit("env-serve: --timeout must be > 0, --max-sessions >= 1 and --port in 0..65535")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # closes every live env, then exits
    await serve(args.env, host=args.host, port=args.port, timeout_s=args.timeout, max_sessions=args.max_sessions,
                stop=stop, announce=lambda line: print(line, flush=True))
    return 0


def _load(args: argparse.Namespace) -> Config:
    flags = getattr(args, "swift", None) or {}
    cfg = load_config(args.config, list(args.overrides), swift=flags)
    # ms-swift flags that would train something else here (the precision, the training processes) are an
    # error naming the fix, as `config from-swift` refuses such a run without --accept-changes
    changes = swift_args.command_changes(flags, lambda dotted: getattr(getattr(cfg, dotted.split(".")[0]),
                                                                       dotted.split(".")[1]), os.environ)
    if changes:
        raise ConfigError("; ".join(f"--{name} {swift_args._show(value)}: {what}" if name in flags else
                                    f"{name}={value}: {what}" for name, value, what in changes))
    return cfg


def _config_show(args: argparse.Namespace) -> int:
    print(format_config(_load(args)))
    return 0


def _note_flags_without_effect(flags: dict[str, Any]) -> None:
    """An ms-swift flag rollstream accepts without effect is said so, once, on stderr (a refused one is an
    error when the config loads)."""
    for name, value in flags.items():
        arg = trl_args.known(name)
        if arg is not None and arg.kind == swift_args.NOT_NEEDED and arg.is_harmless(value):
            print(f"note: --{name} has no effect in rollstream: {arg.why}", file=sys.stderr)


def _note_ms_swift_command(flags: dict[str, Any], overrides: list[str]) -> None:
    """`--rlhf_type grpo ...` without -c is read as the ms-swift command it is (README's table of defaults)."""
    if swift_args.command_defaults(flags):
        servers = " (LoRA needs the in-process engine, not vLLM servers)" if flags.get("vllm_mode") == "server" else ""
        print("note: --rlhf_type without --train_type (and without -c): LoRA, ms-swift's default (learning rate "
              f"1e-4); --train_type full trains every weight{servers}", file=sys.stderr)
    if "torch_dtype" not in flags and not any(o.startswith("model.torch_dtype") for o in overrides):
        print("note: no --torch_dtype: the learner and engine run in float32 (ms-swift: the model's own dtype); "
              "--torch_dtype bfloat16 on a GPU", file=sys.stderr)


def _read_arguments(path: Path, where_from: str, what: str) -> dict[str, Any]:
    """A saved run's arguments: a JSON object, or YAML (``.yaml``/``.yml``, as `swift rlhf x.yaml` and `trl grpo
    --config x.yaml` take them); a missing or unreadable file is a ConfigError saying which and why."""
    yaml_file = path.suffix in (".yaml", ".yml")
    try:
        text = path.read_text(encoding="utf-8")
        if yaml_file:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file ({where_from})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError and YAMLError's parse errors
        raise ConfigError(f"{path}: not a readable {'YAML' if yaml_file else 'JSON'} file ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - yaml's own error classes
        raise ConfigError(f"{path}: not a readable YAML file ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of {what}, got {type(data).__name__}")
    return data


def _from_swift(args: argparse.Namespace) -> int:
    """``rollstream config from-swift args.json``: the TOML on stdout (or -o), the report on stderr."""
    path = Path(args.args_json)
    data = _read_arguments(path, "an ms-swift run writes args.json into its output_dir", "ms-swift arguments")
    conv = swift_args.from_args_json(data)
    _drop_missing_reporters(conv)
    if args.name is not None:
        conv.values["run.name"] = args.name
    report = _conversion_report(conv, path)
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in conv.values.items():
        section, field = dotted.split(".")
        nested.setdefault(section, {})[field] = value
    # the TOML keeps what differs from rollstream's defaults (loading it gives the same values)
    written = {
        section: {f: v for f, v in table.items() if f"{section}.{f}" == "run.name" or v != field_default(section, f)}
        for section, table in nested.items()
    }
    problem = None
    try:
        config_from_dict(nested)
    except (ConfigError, swift_args.SwiftArgError) as exc:
        problem = str(exc)
    if conv.changes and not args.accept_changes:
        # Never silent: a run that would train something else (one process for four, float32 for bf16, a dropped
        # DeepSpeed config) is not written until the user has read each difference and accepted it.
        print("\n".join(report), file=sys.stderr)
        if problem is not None:
            print(f"config error: the converted config does not load as it is: {problem}", file=sys.stderr)
        print(f"{path}: not converted: {len(conv.changes)} difference(s) in what trains (listed above under "
              f"'changes what trains'); change the ms-swift arguments, or give --accept-changes to write the config "
              f"with them", file=sys.stderr)
        return 3
    text = _conversion_toml(conv, written, report, path)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    print("\n".join(report), file=sys.stderr)
    if problem is not None:
        print(f"config error: the converted config does not load as it is: {problem}", file=sys.stderr)
        return 1
    if args.out:
        print(f"wrote {args.out} (check it: rollstream config show -c {args.out})", file=sys.stderr)
    return 0


def _drop_missing_reporters(conv: swift_args.Conversion) -> None:
    """ms-swift reports to TensorBoard by default; rollstream refuses to start without the package, so a
    tracker that is not installed here is left out of the converted config, and said so."""
    import importlib.util

    wanted = conv.values.get("run.report_to") or []
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        conv.values["run.report_to"] = [name for name in wanted if name not in missing]
        conv.notes.append(
            f"report_to: {', '.join(missing)} not carried: not installed here (pip install {' '.join(missing)}, "
            f"then add it to run.report_to)"
        )


def _conversion_report(conv: swift_args.Conversion, path: Path) -> list[str]:
    """What the user must see: every argument not carried, grouped by why."""
    show = swift_args._show
    lines = [f"{path}: {len(conv.carried)} ms-swift arguments carried into {len(conv.values)} rollstream fields"]
    changed = {name for name, _, _ in conv.changes}  # listed once, with the change
    groups = [
        ("changes what trains (ms-swift's value: what rollstream does instead)",
         [f"{n}={show(v)}: {what}" for n, v, what in conv.changes]),
        ("refused (not carried: a feature rollstream lacks, or a value it cannot take)",
         [f"{n}={show(v)}: {why}" for n, v, why in conv.refused if n not in changed]),
        ("set in ms-swift, accepted, no effect in rollstream",
         [f"{n}={show(v)}: {why}" for n, v, why in conv.no_effect if n not in changed]),
        ("read together or filled in by ms-swift at start", conv.notes),
        ("unknown to rollstream's table (not carried)", [f"{n}={show(v)}" for n, v in conv.unknown]),
    ]
    for title, items in groups:
        if items:
            lines.append(f"{title}: {len(items)}")
            lines += [f"  {item}" for item in items]
    if conv.at_default:
        lines.append(f"at ms-swift's default, or nothing to carry (not carried): {len(conv.at_default)}")
        lines += textwrap.wrap(", ".join(conv.at_default), width=110, initial_indent="  ", subsequent_indent="  ")
    return lines


def _conversion_toml(conv: swift_args.Conversion, nested: dict[str, dict[str, Any]], report: list[str],
                     path: Path) -> str:
    source = {dotted: name for name, targets in conv.carried.items() for dotted in targets}
    lines = [
        f"# rollstream config converted from the ms-swift run {path} (rollstream config from-swift);",
        "# values equal to rollstream's defaults are left out",
    ]
    lines += [f"# {line}" for line in report]
    for section in SECTIONS:
        table = nested.get(section)
        if not table:
            continue
        lines += ["", f"[{section}]"]
        for field in FIELDS[section]:
            if field in table:
                name = source.get(f"{section}.{field}")
                note = f"  # ms-swift {name}" if name and name != field else ""
                lines.append(f"{field} = {toml_value(table[field])}{note}")
    return "\n".join(lines) + "\n"


def _from_trl(args: argparse.Namespace) -> int:
    """``rollstream config from-trl grpo_config.json``: the TOML on stdout (or -o), the report on stderr; exit 3
    (nothing written) where the run would not train what TRL trains, unless --accept-changes."""
    path = Path(args.grpo_config)
    data = _read_arguments(path, "save one with GRPOConfig(...).to_json_string()", "GRPOConfig fields")
    conv = trl_args.from_trl(data)
    _drop_missing_reporters(conv)
    if args.name is not None:
        conv.values["run.name"] = args.name
    show = swift_args._show
    changed = {name for name, _, _ in conv.changes}  # listed once, with the change
    report = [(f"{path}: {len(conv.carried)} TRL {trl_args.TRL_VERSION} GRPOConfig fields carried into "
               f"{len(conv.values)} rollstream fields (TRL's defaults for the {len(conv.defaults)} the file leaves out)")]
    for title, items in (
        ("changes what trains", [f"{n}={show(v)}: {what}" for n, v, what in conv.changes]),
        ("refused (not carried)", [f"{n}={show(v)}: {why}" for n, v, why in conv.refused if n not in changed]),
        ("set in TRL, accepted, no effect in rollstream",
         [f"{n}={show(v)}: {why}" for n, v, why in conv.no_effect if n not in changed]),
        ("read together, or as TRL reads them", conv.notes),
        ("unknown to rollstream's table (not carried)", [f"{n}={show(v)}" for n, v in conv.unknown]),
    ):
        if items:
            report += [f"{title}: {len(items)}", *(f"  {item}" for item in items)]
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in conv.values.items():
        section, field = dotted.split(".")
        nested.setdefault(section, {})[field] = value
    # GRPOTrainer's arguments, not GRPOConfig's: the model, the dataset and the reward functions.
    missing = [] if nested.get("reward", {}).get("reward_funcs") else ["reward.reward_funcs"]
    missing += [f for f in ("model.model", "data.dataset") if f.split(".")[1] not in nested.get(f.split(".")[0], {})]
    report.append(f"GRPOTrainer's arguments, not in a GRPOConfig: set {', '.join(missing)} (rollstream's defaults: "
                  f"the built-in tiny model and task; a reward is required)")
    problem = None
    try:  # loads once the reward functions are given (a stand-in checks the rest)
        config_from_dict({**nested, "reward": {"reward_funcs": ["accuracy"], **nested.get("reward", {})}})
    except (ConfigError, swift_args.SwiftArgError) as exc:
        problem = str(exc)
    print("\n".join(report), file=sys.stderr)
    if problem is not None:
        print(f"config error: the converted config does not load as it is: {problem}", file=sys.stderr)
    if conv.changes and not args.accept_changes:
        print(f"{path}: not converted: {len(conv.changes)} difference(s) in what trains (listed above); change the "
              f"GRPOConfig, or give --accept-changes to write the config with them", file=sys.stderr)
        return 3
    source = {dotted: name for name, targets in conv.carried.items() for dotted in targets}
    lines = [f"# rollstream config converted from the TRL GRPOConfig {path} (rollstream config from-trl);",
             "# TRL's defaults for the fields it leaves out; values equal to rollstream's defaults are left out",
             *(f"# {line}" for line in report)]
    for section in SECTIONS:
        table = {f: v for f, v in nested.get(section, {}).items()
                 if f"{section}.{f}" == "run.name" or v != field_default(section, f)}
        if table:
            lines += ["", f"[{section}]"]
            for field in FIELDS[section]:
                if field in table:
                    name = source.get(f"{section}.{field}")
                    note = f"  # TRL {name}" if name and name != field else ""
                    lines.append(f"{field} = {toml_value(table[field])}{note}")
    if "reward.reward_funcs" in missing:
        lines += ["", "[reward]", "# reward_funcs = [\"accuracy\"]  # GRPOTrainer(reward_funcs=...): give yours"]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out} (check it: rollstream config show -c {args.out})", file=sys.stderr)
    else:
        print(text, end="")
    return 1 if problem is not None else 0


async def _worker(args: argparse.Namespace) -> int:
    """One stage worker over the configured transport (Redis, for the Procfile)."""
    from rollstream import train
    from stages.feeder import plan_batches

    cfg = _load(args)
    if args.resume is not None and args.stage != "learner":
        raise SetupError(
            f"--resume: only the learner worker resumes from a checkpoint; a restarted {args.stage} worker "
            f"continues from its streams by itself"
        )
    log.configure(cfg.run.log_level)
    train.quiet_libraries()
    load_plugins(cfg.run.external_plugins)
    train.check_registered(cfg)
    needs_rows = args.stage in ("feeder", "learner")
    needs_model = args.stage in ("rollout", "learner", "evaluate") or (
        args.stage == "feeder" and train.feeder_tokenizes(cfg)
    )
    if args.stage == "evaluate":
        rows = train.load_eval_rows(cfg) if cfg.eval.eval_strategy != "no" else []
    else:
        rows = train.load_rows(cfg) if needs_rows else None
    model_dir = train.model_dir_of(cfg, progress=_stderr) if needs_model else None
    checkpoint = None
    if args.resume is not None:
        assert rows is not None  # the learner's (only it resumes)
        checkpoint = train.resume_checkpoint(cfg, args.resume, plan_batches(cfg, len(rows)).num_batches, worker=True)
    if args.stage == "learner" and _learner_rank() > 0:
        # A follower of a learner under torchrun: no transport, no files; rank 0 leads (trainer/distributed.py).
        stage = train.build_stage("learner", cfg, model_dir=model_dir, rows=rows, output_dir=resolve_output_dir(cfg))
        stage.resume_from = checkpoint
        # torchrun passes SIGTERM/SIGINT to every rank: rank 0 drains (finishing its collective step with
        # us) and then tells us to stop; a dead rank 0 makes torchrun kill us.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        return await asyncio.to_thread(stage.follow)
    transport = await train.open_transport(cfg)
    reporters = None
    try:
        if await _run_finished(transport):
            raise SetupError(
                f"run {cfg.run.name!r} already finished on this transport; start it again with "
                f"`rollstream reset -c {args.config}` or choose another run.name"
            )
        output_dir = resolve_output_dir(cfg)
        if args.stage == "learner":  # the one worker that owns the run's output directory
            output_dir.mkdir(parents=True, exist_ok=True)
            train.write_config(cfg, output_dir)
        # run.report_to: the learner, which computes the metrics rows, sends them.
        reporters = Reporters(cfg, output_dir) if args.stage == "learner" else None
        on_step = reporters.log if reporters is not None else None
        stage = train.build_stage(
            args.stage, cfg, model_dir=model_dir, rows=rows, output_dir=output_dir, on_step=on_step
        )
        if checkpoint is not None:
            stage.resume_from = checkpoint
        port = args.metrics_port if args.metrics_port is not None else stage_port(cfg, args.stage)
        worker = train.make_worker(stage, transport, cfg, worker_id=args.worker_id, burst=args.burst, metrics_port=port)
        worker.install_signal_handlers()
        return await worker.serve()
    finally:
        if reporters is not None:
            reporters.close()
        await transport.close()


def _learner_rank() -> int:
    from trainer.distributed import rank_from_env  # late: it imports torch

    return rank_from_env()


async def _run_finished(transport: Any) -> bool:
    """The newest weights record says whether the run is over."""

    newest = await latest_weights(transport)
    return newest is not None and newest.final


def stage_port(cfg: Config, stage: str) -> int:
    base = cfg.run.metrics_port
    if stage == "evaluate":  # after the five training stages
        return base + len(STAGE_NAMES) if base else 0
    return base + STAGE_NAMES.index(stage) if base else 0


async def _reset(cfg: Config) -> int:
    from rollstream.train import open_transport

    transport = await open_transport(cfg)
    try:
        removed = await transport.delete_run()
    finally:
        await transport.close()
    print(f"run {cfg.run.name!r}: removed {removed} streams")
    return 0


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
