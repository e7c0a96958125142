"""Gym-style environments: the built-in envs' rules, registries and config, and the env loop on the real
vLLM engine with the tiny model: an ms-swift plugin file (env + context manager) loaded by path, close()
exactly once in every ending, a hanging step timed out while other groups flow, sync envs off the event
loop, the env reward through the reward stage, and a remote env behind `rollstream env-serve` giving the
same trajectories as the same env in process."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_context import FakeContext
from polling import wait_until

from config import ConfigError, load_config
from pipeline.errors import SetupError
from pipeline.plugins import load_plugins
from pipeline.records import Feedback, PromptTask, Trajectory, TrajectoryGroup, pack_f32, pack_i32
from rewards.scoring import reward_kwargs
from schedulers import EnvFailed
from schedulers.gym import UnknownEnvError, env_class
from schedulers.gym_envs import GridWorldEnv, GuessNumberEnv, generate_map
from schedulers.protocol import RolloutInferRequest
from schedulers.remote_env import wait_healthy
from stages.reward import Reward
from stages.rollout import Rollout

PLUGIN = Path(__file__).with_name("gym_plugin.py")
REPO = Path(__file__).resolve().parents[1]


def plugin():
    load_plugins([str(PLUGIN)])
    return sys.modules[f"rollstream_plugin_{PLUGIN.stem}"]


def config(*overrides: str):
    return load_config(
        None,
        [
            "run.name=gymtest",
            f'run.external_plugins=["{PLUGIN}"]',
            "rollout.max_turns=4",
            "grpo.max_completion_length=6",
            "rollout.max_model_len=256",
            *overrides,
        ],
    )


def task(env_config=None, prompt_id="g0", generations=3, seed=500, ctx_config=None):
    data = {"env_config": env_config or {}}
    if ctx_config is not None:
        data["ctx_config"] = ctx_config
    return PromptTask(
        prompt_id=prompt_id,
        generation_batch=0,
        num_generations=generations,
        messages=[{"role": "user", "content": "placeholder"}],
        data_dict=data,
        seed=seed,
        min_policy_version=0,
    )


async def rollout(engine, model_dir, cfg, t):
    plugin()
    stage = Rollout(cfg, model_dir, engine=engine)
    await stage.start(FakeContext(run='gymtest', stage='rollout'))
    try:
        return await stage.handle(t, FakeContext(run='gymtest', stage='rollout'))
    finally:
        await stage.close()  # the shared engine stays; the scheduler's env threads go


def trajectories(handled) -> list[Trajectory]:
    return [t for _, r in handled.outputs if isinstance(r, TrajectoryGroup) for t in r.trajectories]


def feedback(handled) -> Feedback | None:
    return next((r for _, r in handled.outputs if isinstance(r, Feedback)), None)


def request(uuid="r0"):
    return RolloutInferRequest(messages=[], uuid=uuid)


# ----------------------------------------------------------------------------------------- pure parts


async def test_guess_number_rules():
    env = GuessNumberEnv({"low": 1, "high": 8, "target": 5, "step_penalty": 0.1})
    observation, info, system = await env.reset(request())
    assert (observation, info["target"]) == ("Guess a number between 1 and 8.", 5) and system
    assert await env.step([{"role": "assistant", "content": "3"}]) == ("higher", -0.1, False, {"guess": 3})
    assert (await env.step([{"role": "assistant", "content": "I say 7"}]))[:3] == ("lower", -0.1, False)
    assert (await env.step([{"role": "assistant", "content": "no idea"}]))[1:3] == (-0.1, False)
    assert (await env.step([{"role": "assistant", "content": "5"}]))[1:3] == (1.0, True)
    seeded = [GuessNumberEnv({"seed": s}) for s in (1, 1, 2)]
    targets = [(await e.reset(request()))[1]["target"] for e in seeded]
    assert targets[0] == targets[1] and all(1 <= t <= 8 for t in targets)
    by_uuid = [(await GuessNumberEnv({}).reset(request("req-7")))[1]["target"] for _ in range(2)]
    assert by_uuid[0] == by_uuid[1]  # no seed: derived from the request id, stable across processes
    with pytest.raises(ValueError, match="env_config.high"):
        GuessNumberEnv({"high": "8"})


async def test_gridworld_rules():
    env = GridWorldEnv({"map": ["SFF", "FHF", "FFG"], "step_penalty": 0.01})
    observation, info, _ = await env.reset(request())
    assert observation == "PFF\nFHF\nFFG" and info["map"] == ["SFF", "FHF", "FFG"]
    assert (await env.step([{"role": "assistant", "content": "up"}]))[:3] == (
        "PFF\nFHF\nFFG",
        -0.01,
        False,
    )  # wall
    assert (await env.step([{"role": "assistant", "content": "go Right"}]))[0] == "SPF\nFHF\nFFG"
    assert (await env.step([{"role": "assistant", "content": "down"}]))[1:3] == (-0.01, True)  # the hole
    env = GridWorldEnv({"map": ["SFF", "FHF", "FFG"]})
    await env.reset(request())
    for move in ("right", "right", "down"):
        assert not (await env.step([{"role": "assistant", "content": move}]))[2]
    assert (await env.step([{"role": "assistant", "content": "down"}]))[1:3] == (1.0, True)
    import random

    for seed in range(20):  # generated maps always have a way from S to G
        grid = generate_map(4, 0.5, random.Random(seed))
        assert grid[0][0] == "S" and grid[-1][-1] == "G"
    assert generate_map(4, 0.8, random.Random(3)) == generate_map(4, 0.8, random.Random(3))


def test_unknown_env_names_the_registered_ones():
    with pytest.raises(UnknownEnvError, match="did you mean 'guess_number'.*gridworld.*remote"):
        env_class("guess_numbr")
    with pytest.raises(SetupError, match="'nope' is not a registered env"):
        Rollout(config('rollout.gym_env="nope"'), Path("."))
    with pytest.raises(SetupError, match="needs a gym scheduler"):
        Rollout(
            config('rollout.gym_env="guess_number"', 'rollout.multi_turn_scheduler="math_tip_trick"'),
            Path("."),
        )


def test_config_defaults_and_errors():
    cfg = config('rollout.gym_env="guess_number"')
    assert cfg.rollout.use_gym_env and cfg.rollout.multi_turn_scheduler == "gym_scheduler"
    assert cfg.reward.reward_funcs == ["env_reward"] and cfg.rollout.loss_scale == "last_round"
    cfg = config(
        'rollout.gym_env="guess_number"',
        'reward.reward_funcs=["format", "env_reward"]',
        "reward.reward_weights=[0.2, 1.0]",
        'rollout.loss_scale="default"',
    )
    assert cfg.reward.reward_funcs == ["format", "env_reward"] and cfg.rollout.loss_scale == "default"
    plain = config('reward.reward_funcs=["accuracy"]')
    assert plain.rollout.loss_scale == "default" and not plain.rollout.use_gym_env
    with pytest.raises(ConfigError, match="env_reward.*use_gym_env"):
        config('reward.reward_funcs=["env_reward"]')
    with pytest.raises(ConfigError, match="rollout.gym_env='guess_number' with rollout.use_gym_env=false"):
        config(
            'rollout.gym_env="guess_number"', "rollout.use_gym_env=false", 'reward.reward_funcs=["accuracy"]'
        )
    with pytest.raises(ConfigError, match="rollout.env_timeout_s"):
        config('rollout.gym_env="guess_number"', "rollout.env_timeout_s=0")
    with pytest.raises(ConfigError, match="rollout.max_concurrent_envs"):
        config('rollout.gym_env="guess_number"', "rollout.max_concurrent_envs=0")


def _trajectory(rollout_infos, request_id="g/0/0"):
    return Trajectory(
        prompt_id="g",
        attempt=0,
        request_id=request_id,
        generation_batch=0,
        prompt_ids=pack_i32([1]),
        completion_ids=pack_i32([2]),
        logprobs=pack_f32([-0.5]),
        completion="4",
        rollout_infos=rollout_infos,
        policy_version=0,
        max_policy_version=0,
    )


def test_env_reward_and_trajectory_infos_reach_rewards():
    from rewards import get_reward

    steps = [{"step": 0, "info": {}}, {"step": 1, "reward": 0.5, "done": True, "info": {"guess": 4}}]
    completions, kwargs = reward_kwargs(
        [[_trajectory({"total_reward": 0.5, "trajectory_infos": steps})], [_trajectory({}, "g/0/1")]]
    )
    assert kwargs["trajectory_infos"] == [steps, None]
    assert get_reward("env_reward")(completions, **kwargs) == [0.5, None]
    with pytest.raises(ValueError, match="rollout.use_gym_env"):
        get_reward("env_reward")(["x"], rollout_infos=[{}])


async def test_env_server_protocol_is_idempotent_and_validates():
    from schedulers.remote_env import serve

    port, stop = free_port(), asyncio.Event()
    server = asyncio.create_task(serve("guess_number", port=port, stop=stop, announce=lambda _line: None))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url)
        async with httpx.AsyncClient(timeout=10) as client:
            body = {"session_id": "s1", "env_config": {"target": 3}, "request": {"messages": [], "uuid": "u"}}
            first = (await client.post(f"{url}/reset", json=body)).json()
            assert first == (await client.post(f"{url}/reset", json=body)).json()  # a retried reset
            step = {"session_id": "s1", "step": 1, "messages": [{"role": "assistant", "content": "5"}]}
            answer = (await client.post(f"{url}/step", json=step)).json()
            assert answer == {"observation": "lower", "reward": 0.0, "done": False, "info": {"guess": 5}}
            assert (
                await client.post(f"{url}/step", json=step)
            ).json() == answer  # a retried step: not stepped again
            skipped = await client.post(f"{url}/step", json={**step, "step": 3})
            assert skipped.status_code == 409 and "at step 1" in skipped.json()["error"]
            bad = await client.post(f"{url}/step", json={"session_id": "s1", "step": "2", "messages": []})
            assert bad.status_code == 400 and "'step'" in bad.json()["error"]
            assert (await client.post(f"{url}/reset", content=b"not json")).status_code == 400
            assert (await client.get(f"{url}/healthz")).json() == {"env": "guess_number", "sessions": 1}
            assert (await client.post(f"{url}/close", json={"session_id": "s1"})).json() == {"closed": True}
            assert (await client.post(f"{url}/close", json={"session_id": "s1"})).json() == {"closed": False}
            gone = await client.post(f"{url}/step", json={**step, "step": 2})
            assert gone.status_code == 404
    finally:
        stop.set()
        await asyncio.wait_for(server, 30)


# ------------------------------------------------------------------------ the env loop on the real engine


def check_layout(t: Trajectory) -> None:
    """The rollout rule: one logprob per trained token, none for observations (mask 0)."""
    ids, mask, lps = t.completion_token_ids(), t.completion_loss_mask(), t.completion_logprobs()
    assert len(ids) == len(mask) == len(lps) > 0
    assert all(lp < 0 for lp, m in zip(lps, mask) if m) and all(lp == 0 for lp, m in zip(lps, mask) if not m)


@pytest.mark.e2e
@pytest.mark.parametrize("loss_scale", ["default", "last_round"])
async def test_swift_plugin_env_runs_and_masks_observations(vllm_engine, tiny_model_dir, loss_scale):
    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = config('rollout.gym_env="counting"', f'rollout.loss_scale="{loss_scale}"')
    handled = await rollout(vllm_engine, tiny_model_dir, cfg, task({"done_at": 2}))
    group = trajectories(handled)
    assert len(group) == 3
    tokenizer = vllm_engine.tokenizer
    for t in group:
        check_layout(t)
        assert t.messages == [
            {"role": "system", "content": "You count."},
            {"role": "user", "content": "Say a number."},
        ]
        infos = t.rollout_infos
        assert (
            infos["num_turns"] == 2 and infos["step_rewards"] == [0.25, 1.0] and infos["total_reward"] == 1.25
        )
        assert [s["step"] for s in infos["trajectory_infos"]] == [0, 1, 2] and infos["env_done"]
        text = tokenizer.decode(t.completion_token_ids(), skip_special_tokens=False)
        observation = "<|im_start|>user\nStep 1 done. Say a number.<|im_end|>\n<|im_start|>assistant\n"
        assert observation in text
        ids, mask = list(t.completion_token_ids()), list(t.completion_loss_mask())
        obs_ids = tokenizer.encode(observation, add_special_tokens=False)
        at = next(i for i in range(len(ids)) if ids[i : i + len(obs_ids)] == obs_ids)
        assert mask[at : at + len(obs_ids)] == [0] * len(obs_ids)  # observations are never trained
        first_reply = mask[:at]
        assert (sum(first_reply) == 0) == (loss_scale == "last_round")  # last_round: only the last turn
        assert sum(mask[at + len(obs_ids) :]) > 0
    # The environment's reward reaches the reward stage as env_reward (the default reward_funcs).
    reward = Reward(cfg)
    [entry] = [r for _, r in handled.outputs if isinstance(r, TrajectoryGroup)]
    [(_, whole)] = (await reward.handle(entry, FakeContext(run='gymtest', stage='rollout'))).outputs  # one ScoredGroup
    scored = whole.records
    assert [s.rewards for s in scored] == [{"env_reward": 1.25}] * 3 and {s.reward for s in scored} == {1.25}


@pytest.mark.e2e
async def test_a_compressing_context_manager_starts_a_record_per_rewrite(vllm_engine, tiny_model_dir):
    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = config('rollout.gym_env="counting"', 'rollout.context_manager="last_turn"', "rollout.max_turns=3")
    group = trajectories(await rollout(vllm_engine, tiny_model_dir, cfg, task({}, generations=2)))
    assert len(group) == 6 and sorted({t.turn for t in group}) == [1, 2, 3]  # 2 requests x 3 turns
    for t in group:
        check_layout(t)
        assert (
            len(t.messages) == 2 and t.messages[0]["content"] == "You count."
        )  # system + newest observation
        assert t.messages[1]["content"] == (
            "Say a number." if t.turn == 1 else f"Step {t.turn - 1} done. Say a number."
        )
    lasts = [t for t in group if t.turn == 3]
    assert all(t.rollout_infos["step_rewards"] == [0.25] * 3 for t in lasts)


@pytest.mark.e2e
@pytest.mark.parametrize("ending", ["done", "max_turns", "raise", "timeout", "reset_raises"])
async def test_close_runs_exactly_once_per_env(vllm_engine, tiny_model_dir, ending):
    mod = plugin()
    env_config = {
        "done": {"done_at": 2},
        "max_turns": {},
        "raise": {"raise_at": 2},
        "timeout": {"hang_at": 1},
        "reset_raises": {"raise_on_reset": True},
    }[ending]
    before = set(mod.RESETS)
    cfg = config(
        'rollout.gym_env="counting"', "rollout.env_timeout_s=1", "reward.max_retries=1", "rollout.max_turns=3"
    )
    handled = await rollout(vllm_engine, tiny_model_dir, cfg, task(env_config, prompt_id=f"close-{ending}"))
    made = set(mod.RESETS) - before
    failed = ending in ("raise", "timeout", "reset_raises")
    # A failed request is tried again with a fresh env (max_retries=1); the first request to fail for good
    # fails the group, which cancels its siblings' episodes, wherever they are (their envs close too).
    assert (4 <= len(made) <= 6) if failed else len(made) == 3
    assert {mod.CLOSES.get(env_id) for env_id in made} == {1}
    if failed:
        fb = feedback(handled)
        assert fb.outcome == "dropped" and fb.reason.startswith("env_error")
        assert {
            "raise": "failed on purpose",
            "timeout": "timed out after 1 s",
            "reset_raises": "reset() raised",
        }[ending] in fb.reason
    else:
        turns = {t.rollout_infos["num_turns"] for t in trajectories(handled)}
        assert turns == ({2} if ending == "done" else {3})


@pytest.mark.e2e
async def test_close_runs_once_when_the_request_is_cancelled(vllm_engine, tiny_model_dir):
    mod = plugin()
    before = set(mod.RESETS)
    cfg = config('rollout.gym_env="counting"', "rollout.env_timeout_s=600")
    handling = asyncio.create_task(
        rollout(vllm_engine, tiny_model_dir, cfg, task({"hang_at": 1}, prompt_id="cancel"))
    )
    await wait_until(
        lambda: sum(mod.STEP_STARTED.get(f"cancel/0/{i}", asyncio.Event()).is_set() for i in range(3)) == 3,
        "three env steps to start",
        timeout_s=60,
    )
    handling.cancel()  # as a worker's shutdown does with a request in flight
    with pytest.raises(asyncio.CancelledError):
        await handling
    made = set(mod.RESETS) - before
    assert len(made) == 3 and {mod.CLOSES.get(env_id) for env_id in made} == {1}


@pytest.mark.e2e
async def test_a_hanging_step_times_out_while_other_groups_flow(vllm_engine, tiny_model_dir):
    plugin()
    cfg = config('rollout.gym_env="counting"', "rollout.env_timeout_s=15", "reward.max_retries=0")
    stage = Rollout(cfg, tiny_model_dir, engine=vllm_engine)
    await stage.start(FakeContext(run='gymtest', stage='rollout'))
    finished: dict[str, float] = {}

    async def handle(t):
        out = await stage.handle(t, FakeContext(run='gymtest', stage='rollout'))
        finished[t.prompt_id] = time.monotonic()
        return out

    started = time.monotonic()
    hanging = asyncio.create_task(handle(task({"hang_at": 1}, prompt_id="hang", generations=2)))
    flowing = [await handle(task({"done_at": 2}, prompt_id=f"flow{i}", generations=2)) for i in range(3)]
    assert all(len(trajectories(h)) == 2 for h in flowing)  # three groups came through meanwhile
    assert not hanging.done()
    dropped = feedback(await hanging)
    assert dropped.reason.startswith("env_error") and "timed out after 15 s" in dropped.reason
    assert finished["hang"] - started >= 15 and all(finished[f"flow{i}"] < finished["hang"] for i in range(3))


@pytest.mark.e2e
async def test_dead_letter_policy_raises_env_failed(vllm_engine, tiny_model_dir):
    cfg = config('rollout.gym_env="counting"', 'reward.on_error="dead_letter"', "reward.max_retries=0")
    with pytest.raises(EnvFailed, match="step 1 failed on purpose"):
        await rollout(vllm_engine, tiny_model_dir, cfg, task({"raise_at": 1}, prompt_id="dead"))


@pytest.mark.e2e
async def test_sync_env_methods_run_off_the_event_loop(vllm_engine, tiny_model_dir):
    mod = plugin()
    before = set(mod.STEP_THREADS)
    cfg = config('rollout.gym_env="guess_number"')  # the row's env_config.name wins
    group = trajectories(
        await rollout(
            vllm_engine, tiny_model_dir, cfg, task({"name": "sync_counting", "done_at": 2}, prompt_id="sync")
        )
    )
    assert len(group) == 3 and all(t.rollout_infos["total_reward"] == 1.25 for t in group)
    made = set(mod.STEP_THREADS) - before
    assert len(made) == 3 and all(mod.STEP_THREADS[e] for e in made)
    assert all(mod.CLOSES[e] == 1 for e in made)


# --------------------------------------------------------------------------------------- remote envs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def env_server(tmp_path):
    """`rollstream env-serve tests/gym_plugin.py:counting` (any registered env), stopped by PID."""
    port = free_port()
    log = open(tmp_path / "env-serve.log", "w")  # noqa: SIM115, ASYNC230
    proc = subprocess.Popen(  # noqa: ASYNC220 - a server for the test's lifetime, stopped by PID
        [sys.executable, "-m", "rollstream.cli", "env-serve", "guess_number", "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.e2e
async def test_remote_env_gives_the_same_trajectories_as_in_process(vllm_engine, tiny_model_dir, env_server):
    await vllm_engine.reset_weights(tiny_model_dir)
    env_config = {"low": 1, "high": 8, "seed": 7}
    local_cfg = config('rollout.gym_env="guess_number"', "rollout.max_turns=3")
    remote_cfg = config(
        'rollout.gym_env="remote"', "rollout.max_turns=3", f'rollout.env_config={{url="{env_server}"}}'
    )
    local = trajectories(
        await rollout(vllm_engine, tiny_model_dir, local_cfg, task(env_config, generations=4))
    )
    remote = trajectories(
        await rollout(vllm_engine, tiny_model_dir, remote_cfg, task(env_config, generations=4))
    )
    assert len(local) == len(remote) == 4
    for a, b in zip(local, remote):
        assert a.request_id == b.request_id and a.messages == b.messages
        assert a.completion_token_ids().tolist() == b.completion_token_ids().tolist()
        assert a.completion_loss_mask().tolist() == b.completion_loss_mask().tolist()
        assert a.rollout_infos == b.rollout_infos  # rewards, per-step infos, turns
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(f"{env_server}/healthz")).json()["sessions"] == 0  # every session closed


def test_gym_tiny_model_trains_on_the_guesses_only_and_leaves_the_demo_model_alone():
    import random

    from tinymodels.recipes import GYM_TINY_MODEL_RECIPE, TINY_MODEL_RECIPE, recipe_hash
    from tinymodels.text import GuessNumberSFTData, train_tokenizer

    # The gym fields live on a subclass: the demo recipe's fields, hash and cached model stay as they were.
    assert not hasattr(TINY_MODEL_RECIPE, "max_turns")
    assert recipe_hash(GYM_TINY_MODEL_RECIPE) != recipe_hash(TINY_MODEL_RECIPE)
    tokenizer = train_tokenizer(GYM_TINY_MODEL_RECIPE)
    data = GuessNumberSFTData(tokenizer, GYM_TINY_MODEL_RECIPE)
    for seed in range(20):
        ids, labels = data.episode(random.Random(seed), correct_prob=1.0)
        trained = tokenizer.decode(
            [t for t, label in zip(ids, labels) if label != -100], skip_special_tokens=False
        )
        replies = trained.split("<|im_end|>")[:-1]
        assert 1 <= len(replies) <= GYM_TINY_MODEL_RECIPE.max_turns and all(r.isdigit() for r in replies)
        assert int(replies[0]) == 4  # bisection of 1..8 starts in the middle


def test_gym_datasets_need_no_solution():
    from data.loading import DatasetError, load_dataset

    rows = load_dataset("guess_number", size=4, seed=1, require_solution=False)
    assert len(rows) == 4 and all(set(r) == {"messages", "env_config"} for r in rows)
    assert rows == load_dataset("guess_number", size=4, seed=1, require_solution=False)
    with pytest.raises(DatasetError, match="no 'solution'"):
        load_dataset("guess_number", size=4, seed=1)


@pytest.mark.e2e
async def test_live_envs_are_bounded_by_max_concurrent_envs(vllm_engine, tiny_model_dir):
    mod = plugin()
    mod.LIVE.update(now=0, peak=0)
    cfg = config('rollout.gym_env="counting"', "rollout.max_concurrent_envs=2", "rollout.max_turns=2")
    group = trajectories(
        await rollout(vllm_engine, tiny_model_dir, cfg, task({}, prompt_id="bounded", generations=6))
    )
    assert len(group) == 6 and mod.LIVE == {"now": 0, "peak": 2}
