"""ms-swift's OpenEnv integration (``OpenEnvScheduler`` / ``OpenEnvWrapper``, issue #39): ms-swift's own
example plugin style (tests/plugins/swift_openenv_sudoku.py: ``from swift.rollout.multi_turn import
OpenEnvScheduler, multi_turns``, ``multi_turns['sudoku_scheduler'] = ...``) loaded by the plugin path of
``run.external_plugins``, playing episodes against a real OpenEnv server (openenv-core's ``create_app`` under
uvicorn on loopback: tests/plugins/openenv_sudoku.py) through the rollout stage, and its env reward reaching
the reward stage beside ``format`` with ms-swift's weights.

The player is scripted (the engine protocol with a fixed policy; the real tokenizer, chat template and
token-level multi-turn run): the tiny model's 512-token context cannot hold a 9x9 board and its replies
never name a move, so a scripted player is what makes the episodes' rewards exact."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from fake_context import FakeContext
from polling import wait_until
from procs import openenv_app

from config import load_config
from engines.base import EngineBase, Sample
from pipeline.plugins import load_plugins
from pipeline.records import PromptTask, TrajectoryGroup
from schedulers import OpenEnvScheduler, multi_turns
from stages.reward import Reward
from stages.rollout import Rollout

PLUGINS = Path(__file__).parent / "plugins"
SUDOKU_PLUGIN = PLUGINS / "swift_openenv_sudoku.py"
HINT = re.compile(r"GUARANTEED MOVES \(only one option\): (\[\d \d \d\])")


class ScriptedPlayer(EngineBase):
    """The engine protocol with a fixed policy: ``policy(prompt text) -> reply``, then end of turn."""

    def __init__(self, tokenizer: Any, model_dir: Path, policy: Any) -> None:
        super().__init__(tokenizer, model_dir)
        self.max_model_len = 8192
        self.policy = policy
        self.prompts: list[str] = []

    async def generate(self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int,
                       **sampling: Any) -> Sample:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(self.policy(prompt), add_special_tokens=False)[: max_tokens - 1]
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return Sample(ids, [-0.5] * len(ids), "stop", self.version, self.version)

    async def _reload(self, path: Path, version: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


def plays_the_hint(prompt: str) -> str:
    """Plays the last guaranteed move the scheduler's hints offer (the hints are in the newest observation)."""
    moves = HINT.findall(prompt)
    return f"I place {moves[-1]}" if moves else "no idea"


@pytest.fixture
async def sudoku_server(tmp_path):
    """openenv_sudoku:app under uvicorn on a loopback port; yields (url, the server's session log)."""
    log = tmp_path / "sessions.jsonl"
    env = {**os.environ, "OPENENV_SUDOKU_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    async with openenv_app("openenv_sudoku:app", env) as url:
        yield url, log


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def sessions_closed(log: Path, episodes: int):
    """A predicate for wait_until: the server has seen ``episodes`` resets and closed each of them."""
    def check():
        seen = events(log)
        resets = {e["episode"] for e in seen if e["event"] == "reset"}
        closed = {e["episode"] for e in seen if e["event"] == "close"}
        return len(resets) == episodes and resets <= closed
    return check


def config(tmp_path, *overrides: str):
    return load_config(None, [
        "run.name=openenv",
        f"run.output_dir={json.dumps(str(tmp_path / 'run'))}",
        f"run.external_plugins={json.dumps([str(SUDOKU_PLUGIN)])}",
        "rollout.use_gym_env=true",
        "rollout.max_model_len=4096",
        "data.max_length=1024",
        "grpo.max_completion_length=64",
        *overrides,
    ])


def task(env_config: dict[str, Any], generations: int = 2) -> PromptTask:
    return PromptTask(prompt_id="p0", generation_batch=0, num_generations=generations,
                      messages=[{"role": "user", "content": "Play"}],  # ms-swift's placeholder row
                      data_dict={"env_config": env_config}, seed=7, min_policy_version=0)


async def score(cfg, group) -> list[Any]:
    """The reward stage's scored records for ``group`` (one ScoredGroup, or ScoredTrajectory records)."""
    handled = await Reward(cfg).handle(group, FakeContext(run='openenv', stage='rollout'))
    return [s for _, r in handled.outputs for s in getattr(r, "records", [r]) if hasattr(s, "rewards")]


async def roll(cfg, engine, t):
    load_plugins(cfg.run.external_plugins)  # what `rollstream train` does with run.external_plugins
    stage = Rollout(cfg, engine.model_dir, engine=engine)
    await stage.start(FakeContext(run='openenv', stage='rollout'))
    try:
        handled = await stage.handle(t, FakeContext(run='openenv', stage='rollout'))
    finally:
        await stage.close()
    [group] = [r for _, r in handled.outputs if isinstance(r, TrajectoryGroup)]
    return stage, group


# ----------------------------------------------------------------------------------------- real server


async def test_ms_swift_sudoku_plugin_plays_episodes_against_an_openenv_server(tmp_path, tiny_model_dir,
                                                                               sudoku_server):
    from transformers import AutoTokenizer

    url, log = sudoku_server
    engine = ScriptedPlayer(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir, plays_the_hint)
    cfg = config(tmp_path, 'rollout.multi_turn_scheduler="sudoku_scheduler"', "rollout.max_turns=5",
                 'reward.reward_funcs=["format"]')
    # ms-swift: the gym reward is one more reward column after reward_funcs, weight 1.0 unless given
    assert cfg.reward.reward_funcs == ["format", "env_reward"] and cfg.reward.reward_weights == [1.0, 1.0]
    stage, group = await roll(cfg, engine, task({"name": "openenv", "base_url": url,
                                                 "reset_kwargs": {"blanks": 3, "seed": 11}}))
    scheduler = stage.sampler.scheduler
    assert isinstance(scheduler, multi_turns["sudoku_scheduler"]) and isinstance(scheduler, OpenEnvScheduler)
    assert len(group.trajectories) == 2
    for t in group.trajectories:
        infos = t.rollout_infos
        # 3 empty cells, each filled from the hints: 3 turns, solved; per step the plugin's combined reward
        # (empty_cell mean 1 + valid_move mean 1 + repetition 0 + progress k/3 + correct, 1 when solved)
        assert infos["num_turns"] == 3 and infos["gym_done"] is True and infos["env_done"] is True
        assert infos["step_rewards"] == pytest.approx([2 + 1 / 3, 2 + 2 / 3, 4.0])
        assert infos["total_reward"] == pytest.approx(4.0) and infos["correct_reward"] == 1.0
        assert t.messages[0]["content"].startswith("You are an expert Sudoku player")  # the plugin's system
        assert "R9" in t.messages[1]["content"] and "GUARANTEED MOVES" in t.messages[1]["content"]
        replies = [m["content"] for m in t.conversation if m["role"] == "assistant"]
        assert len(replies) == 3 and all(re.fullmatch(r"I place \[\d \d \d\]", r) for r in replies)
        assert [m["role"] for m in t.conversation].count("user") == 3  # the reset's board, then 2 observations
    # every episode's session was stepped 3 times and closed exactly once on the server; none left here
    await wait_until(sessions_closed(log, 2), what="both sessions closed", timeout_s=30)
    seen = events(log)
    for episode in {e["episode"] for e in seen if e["event"] == "reset"}:
        assert [e["event"] for e in seen if e.get("episode") == episode].count("step") == 3
        assert [e["event"] for e in seen if e.get("episode") == episode].count("close") == 1
    assert scheduler._envs == {} and scheduler.live_envs == 0

    # The reward stage: format and the env's total_reward, weighted 1.0 each (ms-swift's default weights).
    scored = await score(cfg, group)
    assert [s.rewards for s in scored] == [{"format": 0.0, "env_reward": pytest.approx(4.0)}] * 2
    assert [s.reward for s in scored] == [pytest.approx(4.0)] * 2


async def test_a_reply_without_a_move_ends_the_episode_with_the_plugins_penalty(tmp_path, tiny_model_dir,
                                                                                 sudoku_server):
    from transformers import AutoTokenizer

    url, log = sudoku_server
    engine = ScriptedPlayer(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir, lambda _: "hmm")
    cfg = config(tmp_path, 'rollout.multi_turn_scheduler="sudoku_scheduler"', "rollout.max_turns=5",
                 'reward.reward_funcs=["format"]', "reward.reward_weights=[0.5, 2.0]")
    _, group = await roll(cfg, engine, task({"base_url": url}, generations=1))
    [t] = group.trajectories
    assert t.rollout_infos["num_turns"] == 1 and t.rollout_infos["step_rewards"] == [-1.0]
    await wait_until(sessions_closed(log, 1), what="the session closed", timeout_s=30)
    assert not [e for e in events(log) if e["event"] == "step"]  # the env was never stepped
    [scored] = await score(cfg, group)
    assert scored.rewards == {"format": 0.0, "env_reward": -1.0} and scored.reward == -2.0  # 0.5*0 + 2.0*-1


async def test_the_built_in_openenv_scheduler_sends_json_actions_and_shows_json_observations(
        tmp_path, tiny_model_dir, sudoku_server):
    from transformers import AutoTokenizer

    url, log = sudoku_server
    # ms-swift's default parse_action: a JSON object is the action; the cell (1, 1) is never empty, so every
    # move is rejected and the third ends the game (TextArena's rule in the test server)
    engine = ScriptedPlayer(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir,
                            lambda _: '```json\n{"message": "[1 1 5]"}\n```')
    cfg = config(tmp_path, 'rollout.multi_turn_scheduler="openenv_scheduler"', "rollout.max_turns=5",
                 f'rollout.env_config={{base_url = "{url}", system_message = "Play Sudoku."}}')
    assert cfg.reward.reward_funcs == ["env_reward"]
    _, group = await roll(cfg, engine, task({"reset_kwargs": {"blanks": 2, "seed": 3}}, generations=1))
    [t] = group.trajectories
    infos = t.rollout_infos
    assert infos["num_turns"] == 3 and infos["step_rewards"] == [0.0, 0.0, 0.0] and infos["gym_done"] is True
    assert t.messages[0] == {"role": "system", "content": "Play Sudoku."}  # rollout.env_config's system_message
    observations = [json.loads(m["content"]) for m in t.conversation if m["role"] == "user"]
    assert "Current board" in observations[0]["prompt"] and len(observations) == 3
    assert observations[-1]["prompt"].endswith("Please resubmit a valid move to avoid penalties.")
    steps = [e["message"] for e in events(log) if e["event"] == "step"]
    assert steps == ["[1 1 5]"] * 3
    await wait_until(sessions_closed(log, 1), what="the session closed", timeout_s=30)


async def test_an_unreachable_server_fails_the_request_after_its_retries(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from schedulers import EnvFailed

    engine = ScriptedPlayer(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir, plays_the_hint)
    cfg = config(tmp_path, 'rollout.multi_turn_scheduler="openenv_scheduler"', "reward.max_retries=1",
                 'reward.on_error="dead_letter"')
    load_plugins(cfg.run.external_plugins)
    stage = Rollout(cfg, engine.model_dir, engine=engine)
    await stage.start(FakeContext(run='openenv', stage='rollout'))
    try:
        with pytest.raises(EnvFailed, match=r"failed on all 2 attempts: .*reset\(\) at http://127.0.0.1:1 raised"):
            await stage.handle(task({"base_url": "http://127.0.0.1:1"}, generations=1), FakeContext(run='openenv', stage='rollout'))
        scheduler = stage.sampler.scheduler
        assert scheduler.env_errors == 2 and scheduler.live_envs == 0 and scheduler._envs == {}
    finally:
        await stage.close()


async def test_a_cancelled_episode_still_closes_its_session(tmp_path, tiny_model_dir, sudoku_server):
    import asyncio

    from transformers import AutoTokenizer

    url, log = sudoku_server
    never = asyncio.Event()

    class Stuck(ScriptedPlayer):
        async def generate(self, prompt_ids, **kwargs):
            self.prompts.append("reset done")
            await never.wait()  # the worker is shut down mid-turn

    engine = Stuck(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir, plays_the_hint)
    cfg = config(tmp_path, 'rollout.multi_turn_scheduler="sudoku_scheduler"', "rollout.max_turns=5")
    load_plugins(cfg.run.external_plugins)
    stage = Rollout(cfg, engine.model_dir, engine=engine)
    await stage.start(FakeContext(run='openenv', stage='rollout'))
    try:
        handling = asyncio.create_task(stage.handle(task({"base_url": url}, generations=2), FakeContext(run='openenv', stage='rollout')))
        await wait_until(lambda: len(engine.prompts) == 2, what="both episodes reset and sampling", timeout_s=60)
        handling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handling
        scheduler = stage.sampler.scheduler
        assert scheduler._envs == {} and scheduler.live_envs == 0
    finally:
        await stage.close()
    await wait_until(sessions_closed(log, 2), what="both sessions closed", timeout_s=30)
