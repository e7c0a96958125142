"""ms-swift plugin files load unchanged (issue #27): rollstream's ``swift`` shim (compat/swift), reward classes
built as ms-swift builds them, and the names that import but need ms-swift itself.

The plugins are files written for these tests in ms-swift's styles (tests/plugins/swift_*.py: v3.7.3,
v3.12.6 and main import blocks); one real short ``rollstream train`` runs them all. A real ``swift`` package
(a stand-in written to a temp dir) is tried in a fresh interpreter, so this process's ``sys.modules`` stays
as the shim left it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from pathlib import Path

import pytest

import rewards
import schedulers
from config import config_from_dict, load_config
from pipeline.plugins import SWIFT_SHIM_DIR, PluginError, load_plugins
from rewards import ORM, AsyncORM, RewardBuildError, builtin, get_reward, orms, swift_args
from rewards.builtin import Cosine, SoftOverlong
from schedulers import protocol

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "tests" / "plugins"
SWIFT_PLUGINS = [PLUGINS / "swift_v3_7_plugin.py", PLUGINS / "swift_v3_12_plugin.py", PLUGINS / "swift_main_plugin.py"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports rollstream from this checkout (a clean sys.modules)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


# ---------------------------------------------------------------- the shim: loading, precedence, errors


def test_every_ms_swift_path_resolves_to_rollstreams_objects():
    load_plugins([str(SWIFT_PLUGINS[1])])  # puts the shim on sys.path (no ms-swift here)
    import swift.infer_engine
    import swift.infer_engine.protocol
    import swift.llm
    import swift.llm.infer.protocol
    import swift.llm.template
    import swift.llm.utils
    import swift.plugin
    import swift.plugin.context_manager
    import swift.plugin.env
    import swift.plugin.multi_turn
    import swift.plugin.orm
    import swift.plugin.rm_plugin
    import swift.rewards
    import swift.rewards.orm
    import swift.rewards.rm_plugin
    import swift.rollout
    import swift.rollout.gym_env
    import swift.rollout.multi_turn
    import swift.rollout.openenv_wrapper
    import swift.template
    import swift.utils

    assert Path(swift.__file__).is_relative_to(SWIFT_SHIM_DIR)
    # appended: after the environment's installed packages, so it never shadows one. (Compared with this
    # environment's own site-packages: a library may append other site dirs later in a long test session.)
    purelib = sysconfig.get_paths()["purelib"]
    assert sys.path.index(str(SWIFT_SHIM_DIR)) > sys.path.index(purelib)
    for module in (swift.plugin, swift.plugin.orm, swift.rewards, swift.rewards.orm):
        assert module.orms is rewards.orms and module.ORM is rewards.ORM and module.AsyncORM is rewards.AsyncORM
    for module in (swift.plugin, swift.plugin.multi_turn, swift.rollout, swift.rollout.multi_turn):
        assert module.multi_turns is schedulers.multi_turns
        assert module.MultiTurnScheduler is schedulers.MultiTurnScheduler
        assert module.RolloutScheduler is schedulers.RolloutScheduler
    assert swift.rollout.multi_turn.OpenEnvScheduler is schedulers.OpenEnvScheduler
    assert swift.rollout.openenv_wrapper.OpenEnvWrapper is schedulers.OpenEnvWrapper
    assert schedulers.multi_turns["openenv_scheduler"] is schedulers.OpenEnvScheduler  # ms-swift's registry name
    for module in (swift.plugin, swift.plugin.env, swift.rollout, swift.rollout.gym_env):
        assert module.envs is schedulers.envs and module.Env is schedulers.Env
    for module in (swift.plugin, swift.plugin.context_manager):
        assert module.context_managers is schedulers.context_managers
        assert module.ContextManager is schedulers.ContextManager
    assert swift.plugin.rm_plugins is swift.rewards.rm_plugins is swift.rewards.rm_plugin.rm_plugins
    for orm in (swift.plugin.orm, swift.rewards.orm):
        assert orm.MathAccuracy is orm.MathORM is builtin.Accuracy and orm.Format is builtin.Format
        assert orm.ReActFormat is builtin.ReactFormat and orm.CosineReward is builtin.Cosine
        assert orm.RepetitionPenalty is builtin.Repetition and orm.SoftOverlong is builtin.SoftOverlong
    names = ["RolloutOutput", "ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatMessage", "RequestConfig"]
    for module in (swift.llm, swift.llm.infer.protocol, swift.infer_engine, swift.infer_engine.protocol):
        for name in names:
            assert getattr(module, name) is getattr(protocol, name), (module.__name__, name)
    for module in (swift.llm, swift.llm.template, swift.infer_engine.protocol):
        assert module.RolloutInferRequest is protocol.RolloutInferRequest
    assert swift.llm.Messages is swift.llm.utils.Messages is swift.template.Messages is protocol.Messages
    assert swift.llm.Template is swift.template.Template and swift.llm.to_device is swift.utils.to_device
    assert swift.utils.remove_response is protocol.remove_response


def test_names_that_need_ms_swift_import_and_fail_only_when_used():
    load_plugins([str(SWIFT_PLUGINS[1])])
    from swift.infer_engine import TransformersEngine
    from swift.llm import PtEngine, Template
    from swift.plugin.orm import ReactORM
    from swift.plugin.rm_plugin import DefaultRMPlugin, GenRMPlugin

    for use in (
        lambda: PtEngine.from_model_template(object(), object(), max_batch_size=0),
        lambda: TransformersEngine(object(), template=object(), max_batch_size=0),
        lambda: DefaultRMPlugin(object(), object()),
        lambda: GenRMPlugin(object(), object()),
        lambda: Template(),
    ):
        with pytest.raises(NotImplementedError, match=r"needs ms-swift itself.*reward\.reward_model"):
            use()
    with pytest.raises(NotImplementedError, match="ReactORM .* has no rollstream equivalent"):
        ReactORM()


def test_swift_utils_helpers_behave_as_ms_swifts(capfd):
    import torch

    load_plugins([str(SWIFT_PLUGINS[1])])
    from swift.utils import get_logger, remove_response, to_device

    logger = get_logger()
    assert get_logger() is logger and logger.name == "swift"
    logger.info("plugin says hi")
    logger.warning_once("once only")
    logger.warning_once("once only")
    err = capfd.readouterr().err
    assert "plugin says hi" in err and err.count("once only") == 1  # the console: where the user looks
    batch = {"ids": [torch.ones(2)], "mask": (torch.zeros(1),), "text": "x"}
    moved = to_device(batch, "meta")
    assert moved["ids"][0].device.type == "meta" and moved["mask"][0].device.type == "meta"
    assert moved["text"] == "x" and isinstance(moved["mask"], tuple)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert remove_response(messages) == "a" and messages == [{"role": "user", "content": "q"}]


def test_a_swift_module_the_shim_lacks_is_a_clear_error(tmp_path):
    plugin = write(tmp_path / "needs_more.py", "from swift.llm.argument import RLHFArguments\n")
    with pytest.raises(PluginError, match=r"compatibility layer has no module 'swift\.llm\.argument'"):
        load_plugins([str(plugin)])
    plugin = write(tmp_path / "needs_name.py", "from swift.plugin import loss_mapping\n")
    with pytest.raises(PluginError, match=r"compatibility layer lacks a name .*loss_mapping"):
        load_plugins([str(plugin)])


def test_a_real_swift_earlier_on_sys_path_wins_over_the_shim(tmp_path):
    real = tmp_path / "site"
    write(real / "swift" / "__init__.py", "REAL = True\n")
    write(real / "swift" / "plugin" / "__init__.py", "orms = {}\nclass ORM:\n    pass\n")
    plugin = write(tmp_path / "plugin.py", "from swift.plugin import ORM, orms\norms['mine'] = ORM\n")
    result = python(
        f"""
        import sys
        sys.path.insert(0, {str(real)!r})
        from pipeline.plugins import SWIFT_SHIM_DIR, load_plugins
        load_plugins([{str(plugin)!r}])
        import rewards, swift, swift.plugin
        print(swift.__file__, swift.REAL, 'mine' in swift.plugin.orms, 'mine' in rewards.orms,
              str(SWIFT_SHIM_DIR) in sys.path)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(real / "swift" / "__init__.py"), "True", "True", "False", "False"]


def test_a_swift_that_is_not_ms_swift_is_named_in_the_error(tmp_path):
    openstack = tmp_path / "site"
    write(openstack / "swift" / "__init__.py", "# OpenStack Swift, the object store\n")
    plugin = write(tmp_path / "plugin.py", "from swift.plugin import ORM, orms\n")
    result = python(
        f"""
        import sys
        sys.path.insert(0, {str(openstack)!r})
        from pipeline.plugins import PluginError, load_plugins
        try:
            load_plugins([{str(plugin)!r}])
        except PluginError as exc:
            print(exc)
            sys.exit(3)
        """,
        tmp_path,
    )
    assert result.returncode == 3, result.stderr
    assert "is not ms-swift (OpenStack Swift installs a `swift` package too)" in result.stdout
    assert str(openstack / "swift" / "__init__.py") in result.stdout


# ---------------------------------------------------------------- reward classes built as ms-swift builds them


def soft_config(**reward):
    return config_from_dict(
        {"reward": {"reward_funcs": ["soft_overlong"], "soft_cache_length": 4, **reward},
         "grpo": {"max_completion_length": 16, "num_generations": 4}}
    )


def test_args_view_has_ms_swifts_names_and_derived_values():
    args = swift_args(soft_config())
    assert (args.soft_max_length, args.soft_cache_length, args.cosine_max_len) == (16, 4, 16)  # <- max_completion_length
    assert (args.max_completion_length, args.num_generations, args.beta, args.temperature) == (16, 4, 0.04, 1.0)
    assert args.seed == 42 and args.reward_funcs == ["soft_overlong"] and args.vllm_max_model_len is None  # ms-swift's default
    assert not hasattr(args, "no_such_argument") and not hasattr(args, "timeout_s")  # rollstream-only name
    assert swift_args(soft_config(soft_max_length=12)).soft_max_length == 12
    cfg = soft_config()
    assert swift_args(cfg).config is cfg


def test_each_constructor_form_gets_what_ms_swift_would_pass(monkeypatch):
    seen = {}

    class V3(ORM):  # ms-swift 3: parameters named like GRPO arguments
        def __init__(self, soft_max_length, soft_cache_length, num_generations=1, own_knob=7):
            seen["v3"] = (soft_max_length, soft_cache_length, num_generations, own_knob)

    class V4(ORM):  # ms-swift 4: args=
        def __init__(self, args=None, **kwargs):
            super().__init__(args, **kwargs)
            seen["v4"] = (self.args.soft_max_length, self.args.max_completion_length, sorted(kwargs))

    class Inherited(AsyncORM):  # no __init__: AsyncORM's (args=None, **kwargs)
        async def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    class KeywordsOnly(ORM):  # **kwargs: ms-swift 4 passes args= all the same
        def __init__(self, **kwargs):
            seen["kwargs"] = sorted(kwargs)

    class Rollstream(ORM):  # rollstream's own form keeps working
        def __init__(self, config):
            seen["config"] = config

    for name, cls in {"v3": V3, "v4": V4, "inherited": Inherited, "kw": KeywordsOnly, "rollstream": Rollstream}.items():
        monkeypatch.setitem(orms, f"form_{name}", cls)
    cfg = soft_config()
    get_reward("form_v3", cfg)
    get_reward("form_v4", cfg)
    assert seen["v3"] == (16, 4, 4, 7) and seen["v4"] == (16, 16, [])
    assert get_reward("form_inherited", cfg).args.soft_cache_length == 4
    get_reward("form_kw", cfg)
    assert seen["kwargs"] == ["args"]
    get_reward("form_rollstream", cfg)
    assert seen["config"] is cfg


def test_a_parameter_nothing_can_fill_is_an_error_naming_class_parameter_and_fix(monkeypatch):
    class NeedsThreshold(ORM):
        def __init__(self, threshold):
            self.threshold = threshold

    monkeypatch.setitem(orms, "needs_threshold", NeedsThreshold)
    with pytest.raises(RewardBuildError, match=r"'needs_threshold' \(NeedsThreshold\): __init__ parameter "
                       r"'threshold' has no default.*give 'threshold' a default, or read it from `args`"):
        get_reward("needs_threshold", soft_config())


def test_tokenizer_comes_from_the_runs_model_dir(monkeypatch, tiny_model_dir):
    from transformers import AutoTokenizer

    class WithTokenizer(ORM):
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

    monkeypatch.setitem(orms, "with_tokenizer", WithTokenizer)
    cfg = soft_config()
    with pytest.raises(RewardBuildError, match="declares `tokenizer`, but this process was not told where"):
        get_reward("with_tokenizer", cfg)
    built = get_reward("with_tokenizer", cfg, model_dir=lambda: tiny_model_dir)
    expected = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert built.tokenizer.encode("12+7") == expected.encode("12+7")


def test_builtins_take_ms_swift_3_and_4_constructor_forms():
    cfg = soft_config()
    by_args = SoftOverlong(args=swift_args(cfg))
    assert (by_args.soft_max_length, by_args.soft_cache_length) == (16, 4)
    positional = SoftOverlong(100, 20)  # ms-swift 3.12: SoftOverlong(soft_max_length, soft_cache_length)
    assert positional(["x"] * 2, completion_ids=[[0] * 90, [0] * 50]) == pytest.approx([-0.5, 0.0])
    with pytest.raises(ValueError, match="soft_cache_length=20 must be below soft_max_length=20"):
        SoftOverlong(20, 20)
    explicit = Cosine(cosine_max_len=100, args=swift_args(cfg))  # an explicit argument wins over args
    assert (explicit.max_len, explicit.min_len_value_wrong, Cosine().max_len) == (100, -0.5, 1000)


# ---------------------------------------------------------------- one real run of all three plugin styles


@pytest.mark.e2e
async def test_ms_swift_plugins_run_unchanged_in_a_real_run(tmp_path, monkeypatch, vllm_engine, tiny_model_dir):
    from transformers import AutoTokenizer

    from rollstream import train

    probe = tmp_path / "probe.jsonl"
    monkeypatch.setenv("SWIFT_COMPAT_PROBE", str(probe))
    funcs = ["accuracy", "v312_soft", "v312_tokenizer", "v312_async", "v37_math", "main_args", "soft_overlong"]
    cfg = load_config(
        "configs/demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path / 'run'))}",
            f"run.name=swift-compat-{uuid.uuid4().hex[:6]}",
            f"run.external_plugins={json.dumps([str(p) for p in SWIFT_PLUGINS])}",
            f"reward.reward_funcs={json.dumps(funcs)}",
            f"reward.reward_weights={json.dumps([1.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.1])}",
            "reward.soft_cache_length=4",
            "grpo.num_generations=4",
            "grpo.generation_batch_size=8",
            "grpo.per_device_train_batch_size=4",
            "run.max_steps=2",
            "rollout.max_model_len=256",
        ],
    )
    try:
        result = await train.run_pipeline(cfg, engine=vllm_engine)
    finally:
        from swift.plugin import rm_plugins

        registered = {
            "orms": {n for n in ("v312_soft", "v312_tokenizer", "v312_async", "v37_math", "main_args") if n in orms},
            "multi_turns": "v312_nudge" in schedulers.multi_turns,
            "envs": "v312_env" in schedulers.envs,
            "context_managers": "v312_ctx" in schedulers.context_managers,
            "rm_plugins": "v312_rm" in rm_plugins,
        }
        for registry, name in [(orms, n) for n in ("v312_soft", "v312_tokenizer", "v312_async", "v37_math",
                                                    "main_args")] + [(schedulers.multi_turns, "v312_nudge"),
                               (schedulers.envs, "v312_env"), (schedulers.context_managers, "v312_ctx"),
                               (rm_plugins, "v312_rm")]:
            registry.pop(name, None)  # other tests see the registries as they were
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(f"rewards/{name}/mean" in rows[0] for name in funcs)
    # The plugins' registrations landed in rollstream's own registries (the shim's names ARE them).
    assert registered == {
        "orms": {"v312_soft", "v312_tokenizer", "v312_async", "v37_math", "main_args"},
        "multi_turns": True, "envs": True, "context_managers": True, "rm_plugins": True,
    }

    events = [json.loads(line) for line in probe.read_text().splitlines()]
    built = {e["probe"]: e for e in events if e["event"] == "built"}
    calls = {name: [e for e in events if e["probe"] == name and e["event"] == "called"] for name in built}
    assert set(built) == {"v312_soft", "v312_tokenizer", "v37_math", "main_args"}
    assert {"v312_async"} <= {e["probe"] for e in events}
    # ms-swift 3: each parameter named like a GRPO argument, from the config (soft_max_length <- max_completion_length).
    assert (built["v312_soft"]["soft_max_length"], built["v312_soft"]["soft_cache_length"]) == (16, 4)
    # tokenizer=: the run's tokenizer, as loaded from the model directory.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert built["v312_tokenizer"]["encoded"] == tokenizer.encode("12+7", add_special_tokens=False)
    for call in calls["v312_tokenizer"]:
        assert call["lengths"] == [len(tokenizer.encode(c, add_special_tokens=False)) for c in call["completions"]]
    # ms-swift 4: args= with ms-swift's attribute names, from grpo / reward config.
    assert built["main_args"]["args"] == {
        "max_completion_length": 16, "num_generations": 4, "beta": 0.04, "temperature": 1.0, "soft_max_length": 16,
        "soft_cache_length": 4, "cosine_max_len": 16, "repetition_n_grams": 3, "reward_funcs": funcs,
    }
    # The AsyncORM ran on the event loop (sync rewards run in the reward threads), scoring with MathAccuracy.
    async_calls = [e for e in events if e["probe"] == "v312_async"]
    accuracy = get_reward("accuracy")
    assert async_calls and all(not e["thread"].startswith("reward") for e in async_calls)
    assert all(e["scores"] == accuracy(e["completions"], solution=e["solution"]) for e in async_calls)
    assert all(e["thread"].startswith("reward") for name in ("v312_soft", "v37_math") for e in calls[name])
    completions = sum(e["n"] for e in calls["v37_math"])
    assert completions == sum(e["n"] for e in calls["main_args"]) == 8  # one generation batch: 2 groups of 4
