"""Security properties as tests: an AST scan of the package for code execution from data (pickle, marshal,
eval/exec, unsafe yaml, torch.load without weights_only, numpy pickles), for process spawns and dynamic
imports outside their one reviewed home each; /metrics and /healthz on loopback unless configured; plugin
files loaded only from the paths the user names; the code reward only through the sandbox."""

from __future__ import annotations

import ast
import asyncio
import socket
from pathlib import Path

import pytest

from pipeline.stage import Stage

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "config", "data", "tinymodels", "grpo", "rewards", "schedulers", "engines", "trainer", "weights", "stages", "rollstream", "ops", "compat")

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
SPAWNS = {
    ("subprocess", "run"),
    ("subprocess", "Popen"),
    ("subprocess", "call"),
    ("subprocess", "check_call"),
    ("subprocess", "check_output"),
    ("asyncio", "create_subprocess_exec"),
    ("asyncio", "create_subprocess_shell"),
    ("os", "system"),
    ("os", "popen"),
    ("os", "execv"),
    ("os", "execvp"),
    ("os", "execve"),
    ("os", "spawnv"),
    ("os", "posix_spawn"),
    ("os", "fork"),
}
DYNAMIC_IMPORTS = {"import_module", "spec_from_file_location", "exec_module", "run_path", "run_module"}

# (file, rule) -> why it is allowed. Every entry must still match something (see the last scan test).
ALLOWED = {
    ("rewards/sandbox.py", "spawn"): "the sandbox itself: runs the untrusted program under rlimits, an audit "
    "hook, an empty env and a temp cwd (and probes `unshare` once)",
    (
        "schedulers/builtin.py",
        "spawn",
    ): "the calculator tool: a fixed program (_CALCULATOR_SOURCE) in `python -I`; "
    "the model's text reaches it only as JSON data on stdin, evaluated by an AST whitelist of arithmetic",
    ("pipeline/plugins.py", "dynamic import"): "run.external_plugins: exactly the files the user names; "
    "load_object: exactly the module:attribute the user names (rollout.tools, environment_factory, agent)",
    ("schedulers/verifiers.py", "spawn"): "the verifiers bridge: the fixed program compat/verifiers_bridge.py "
    "under the interpreter rollout.verifiers_python names; requests reach it only as JSON lines on stdin",
    ("compat/verifiers_bridge.py", "spawn"): "make venv-verifiers' --warm: `uv lock --script` on the harness "
    "program verifiers itself installed (fixed arguments, no shell)",
    ("trainer/process.py", "spawn"): "learner.own_process: this interpreter on the fixed module trainer.process "
    "(no shell); calls and replies cross its pipes as msgpack of typed structs, never pickle",
    ("data/vl_compat.py", "dynamic import"): "the torchvision shim's import hook runs the loader of a "
    "transformers Qwen-VL processor module the import system already found, then patches its class",
    # The one wildcard address is there to be replaced, not bound: `rollstream top` scrapes a worker whose
    # metrics_host is 0.0.0.0 / :: through 127.0.0.1.
    ("rollstream/top.py", "wildcard address"): "top maps a wildcard metrics_host to 127.0.0.1 to scrape it",
    # The weights group refuses a wildcard as the address its learner advertises (config load and the bind).
    ("config/validate.py", "wildcard address"): "rollout.weight_sync_address = 0.0.0.0 / :: is refused at load",
    ("weights/transfer.py", "wildcard address"): "the weights group refuses to advertise a wildcard",
    ("data/loading.py", "wildcard address"): "'::' is ms-swift's hf:: / ms:: dataset prefix, not an address",
    ("config/trl_args.py", "wildcard address"): "TRL's declared default of vllm_server_host (a vLLM server to "
    "ask), listed, never bound",
}


def python_files():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def dotted(node: ast.AST) -> tuple[str, ...]:
    """``a.b.c`` -> ("a", "b", "c"); anything else -> ()."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return (node.id, *reversed(parts))
    return ()


def keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(rule, line, what) for every risky construct in one module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                ("forbidden module", node.lineno, a.name)
                for a in node.names
                if a.name.split(".")[0] in FORBIDDEN_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            out.append(("forbidden module", node.lineno, node.module))
        elif isinstance(node, ast.Constant) and node.value in ("0.0.0.0", "::"):
            out.append(("wildcard address", node.lineno, node.value))
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        what = ".".join(name)
        if len(name) == 1 and name[0] in FORBIDDEN_BUILTINS:
            out.append(("eval/exec", node.lineno, what))
        if name[-2:] in SPAWNS or (
            len(name) >= 2 and name[-2] == "os" and name[-1].startswith(("exec", "spawn"))
        ):
            out.append(("spawn", node.lineno, what))
        if is_true(keyword(node, "shell")):
            out.append(("shell=True", node.lineno, what))
        if (name and name[-1] in DYNAMIC_IMPORTS) or name[:2] == ("sys", "path"):
            out.append(("dynamic import", node.lineno, what))
        if (
            name[:1] == ("yaml",)
            and name[-1] != "safe_load"
            and name[-1] in ("load", "load_all", "full_load", "unsafe_load", "unsafe_load_all")
        ):
            out.append(("unsafe yaml", node.lineno, what))
        if name == ("torch", "load") and not is_true(keyword(node, "weights_only")):
            out.append(("torch.load without weights_only=True", node.lineno, what))
        if (
            name[-1:] == ("load",)
            and name[:1] in (("np",), ("numpy",))
            and is_true(keyword(node, "allow_pickle"))
        ):
            out.append(("numpy pickle", node.lineno, what))
    return out


def scan() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in python_files():
        relative = path.relative_to(ROOT).as_posix()
        for rule, line, what in findings(ast.parse(path.read_text(), filename=relative)):
            found.setdefault((relative, rule), []).append(f"{relative}:{line} {what}")
    return found


def test_no_code_execution_from_data_and_every_spawn_or_import_in_its_home():
    unexpected = {key: where for key, where in scan().items() if key not in ALLOWED}
    assert not unexpected, "\n".join(line for lines in unexpected.values() for line in lines)


def test_every_allowlist_entry_is_still_needed():
    found = scan()
    assert [key for key in ALLOWED if key not in found] == []


@pytest.mark.parametrize(
    "source,rule",
    [
        ("import pickle", "forbidden module"),
        ("from marshal import loads", "forbidden module"),
        ("eval(x)", "eval/exec"),
        ("exec(compile(s, 'f', 'exec'))", "eval/exec"),
        ("yaml.load(text)", "unsafe yaml"),
        ("yaml.unsafe_load(text)", "unsafe yaml"),
        ("torch.load(path)", "torch.load without weights_only=True"),
        ("torch.load(path, weights_only=False)", "torch.load without weights_only=True"),
        ("np.load(path, allow_pickle=True)", "numpy pickle"),
        ("subprocess.run(cmd, shell=True)", "shell=True"),
        ("os.system('ls')", "spawn"),
        ("importlib.import_module(name)", "dynamic import"),
        ("sys.path.insert(0, '.')", "dynamic import"),
        ("server = start_server(h, '0.0.0.0', 80)", "wildcard address"),
    ],
)
def test_the_scan_catches_each_pattern(source, rule):
    assert rule in {r for r, _, _ in findings(ast.parse(source))}


@pytest.mark.parametrize(
    "source",
    [
        "yaml.safe_load(text)",
        "torch.load(p, weights_only=True)",
        "np.load(p)",
        "re.compile('x')",
        "model.eval()",
    ],
)
def test_the_scan_lets_safe_forms_pass(source):
    assert findings(ast.parse(source)) == []


def test_the_code_reward_runs_only_through_the_sandbox():
    """rewards/code.py spawns nothing itself and reaches programs only via rewards.sandbox.run_python."""
    code = (ROOT / "rewards" / "code.py").read_text()
    assert findings(ast.parse(code)) == []
    calls = {".".join(dotted(n.func)) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)}
    assert "run_python" in calls
    assert "from rewards.sandbox import" in code


# ---------------------------------------------------------------- network binds


def non_loopback_address() -> str | None:
    """An address of this machine other than loopback (the one a route to the outside would use)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # UDP connect sends nothing; it only picks a source address
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


class Idle(Stage):
    name = "idle"
    consumes = ("in",)
    concurrency = 1

    async def handle(self, record, ctx):
        raise AssertionError("no input is ever produced")


@pytest.mark.parametrize("configured", [None, "0.0.0.0"])
async def test_metrics_bind_loopback_unless_configured(configured):
    """A worker built from the config serves /metrics and /healthz on 127.0.0.1 only; metrics_host opens it."""
    from config import load_config
    from pipeline.transport.memory import MemoryTransport
    from rollstream import train

    other = non_loopback_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback to probe from")
    overrides = ["reward.reward_funcs=['accuracy']"] + (
        [f"run.metrics_host={configured}"] if configured else []
    )
    cfg = load_config(None, overrides)
    assert cfg.run.metrics_host == (configured or "127.0.0.1")
    port = free_port()
    worker = train.make_worker(Idle(), MemoryTransport(), cfg, metrics_port=port, burst=False)
    task = asyncio.create_task(worker.serve())
    try:
        async with asyncio.timeout(30):
            while not await asyncio.to_thread(accepts, "127.0.0.1", port):
                await asyncio.sleep(0.05)  # poll interval inside the deadline
        assert await asyncio.to_thread(accepts, other, port) is (configured == "0.0.0.0")
    finally:
        worker.request_stop("test")
        await asyncio.wait_for(task, 30)


# ---------------------------------------------------------------- plugins


def test_plugins_load_only_from_the_named_paths(tmp_path, monkeypatch):
    """A named plugin file registers its reward; files beside it or in the cwd with plugin-like names are
    never imported (each would register a reward, and none does)."""
    from pipeline.plugins import load_plugins
    from rewards import orms

    body = "from rewards import orms\norms[{name!r}] = lambda completions, **kw: [1.0] * len(completions)\n"
    named = tmp_path / "named_plugin.py"
    named.write_text(body.format(name="named-probe"))
    for stray in (
        "plugin.py",
        "plugins.py",
        "rollstream_plugin.py",
        "rewards_plugin.py",
        "conftest_plugin.py",
    ):
        (tmp_path / stray).write_text(body.format(name=f"stray-{stray}"))
    monkeypatch.chdir(tmp_path)
    try:
        load_plugins(["named_plugin.py"])  # relative to the cwd, because the user named it so
        assert "named-probe" in orms
        assert not [name for name in orms if name.startswith("stray-")]
    finally:
        orms.pop("named-probe", None)
