"""Remote environments: ``envs["remote"]`` talks to ``rollstream env-serve`` over HTTP, so an env with heavy
state (a sandbox, a browser, a game) runs on its own machines and scales apart from rollout.

Protocol (JSON bodies both ways, never pickle; one session per trajectory, its id made by the client):

- ``POST /reset``  ``{"session_id", "env_config", "request": {messages, data_dict, uuid, tools, ...}}``
  -> ``{"observation", "info", "system_message"}``
- ``POST /step``   ``{"session_id", "step": k, "messages"}`` -> ``{"observation", "reward", "done", "info"}``
- ``POST /close``  ``{"session_id"}`` -> ``{"closed": bool}``
- ``GET /healthz`` -> ``{"env", "sessions"}``

Both mutating calls are idempotent, so the client can retry a request whose answer was lost: a second
``/reset`` of a session returns the first answer, and a ``/step`` repeating the last step index returns
that step's answer instead of stepping again. An env that raised answers 500 with ``{"error"}`` (not
retried: the env failed, the scheduler's retry policy applies); a connection error, a timeout, 429 and
502/503/504 are retried with exponential backoff. The client is aiohttp (see ``schedulers.env_http`` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pipeline.plugins import load_plugins
from schedulers.env_http import client_session
from schedulers.gym import DEFAULT_ENV_TIMEOUT_S, Env, EnvError, call_env, env_class, envs
from schedulers.protocol import Messages, RolloutInferRequest

# env_config keys the client reads itself; every other key goes to the server's env.
CLIENT_KEYS = ("name", "url", "timeout_s", "retries", "backoff_s")
RETRY_STATUSES = (429, 502, 503, 504)
DEFAULT_MAX_SESSIONS = 1024


class RemoteEnvError(RuntimeError):
    """The env server refused or failed a call (the message has its answer)."""


def _dumps(value: Any) -> bytes:
    return msgspec.json.encode(value, enc_hook=repr)  # a value JSON cannot hold travels as its repr


async def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the env server at ``url`` answers ``/healthz`` (one started alongside, e.g. by honcho)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with client_session().get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=5)) as answer:
                if answer.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"env server {url} did not answer /healthz in {timeout_s:.0f} s")
        await asyncio.sleep(0.1)  # polling a server that is still starting


class RemoteEnv(Env):
    """``envs["remote"]``: an env behind ``rollstream env-serve``.

    env_config: ``url`` (``http://host:port``, required), ``timeout_s`` per HTTP request (30), ``retries``
    (3) with backoff from ``backoff_s`` (0.1 s, doubling); every other key is the served env's env_config.
    """

    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        url = env_config.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"env_config.url={url!r}: the remote env needs the env server's http(s):// URL")
        self.url = url.rstrip("/")
        self.timeout_s = float(env_config.get("timeout_s", 30.0))
        self.retries = int(env_config.get("retries", 3))
        self.backoff_s = float(env_config.get("backoff_s", 0.1))
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0:
            raise ValueError(
                f"env_config: timeout_s > 0, retries >= 0 and backoff_s >= 0 are needed, got "
                f"{self.timeout_s}, {self.retries}, {self.backoff_s}"
            )
        self.session_id = uuid.uuid4().hex
        self.steps = 0
        self.opened = False

    async def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        errors = []
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with client_session().post(
                    f"{self.url}{route}",
                    data=_dumps(body),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                    headers={"content-type": "application/json"},
                ) as response:
                    status, content = response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}")
                continue
            if status in RETRY_STATUSES:
                errors.append(f"HTTP {status}")
                continue
            try:
                answer = msgspec.json.decode(content) if content else {}
            except msgspec.DecodeError:
                raise RemoteEnvError(
                    f"{self.url}{route}: HTTP {status}, not JSON: {content[:200]!r}"
                ) from None
            if status != 200:
                error = answer.get("error", answer) if isinstance(answer, dict) else answer
                raise RemoteEnvError(f"{self.url}{route}: HTTP {status}: {error}")
            return answer
        raise RemoteEnvError(f"{self.url}{route} failed {self.retries + 1} times: {', '.join(errors)}")

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        self.opened = True
        env_config = {k: v for k, v in self.env_config.items() if k not in CLIENT_KEYS}
        request = {
            "messages": config.messages,
            "data_dict": config.data_dict,
            "uuid": config.uuid,
            "tools": config.tools,
            "images": config.images,
            "audios": config.audios,
            "videos": config.videos,
        }
        answer = await self._post(
            "/reset", {"session_id": self.session_id, "env_config": env_config, "request": request}
        )
        return answer["observation"], answer.get("info") or {}, answer.get("system_message") or ""

    async def step(self, action: Messages) -> tuple[str, float, bool, dict[str, Any]]:
        self.steps += 1
        answer = await self._post(
            "/step", {"session_id": self.session_id, "step": self.steps, "messages": action}
        )
        return answer["observation"], answer["reward"], answer["done"], answer.get("info") or {}

    async def close(self) -> None:
        if self.opened:  # a session that never reset does not exist on the server
            await self._post("/close", {"session_id": self.session_id})


envs["remote"] = RemoteEnv


# ---------------------------------------------------------------------------------------------- server


class BadRequest(ValueError):
    pass


@dataclass
class _Session:
    env: Env
    reset_answer: dict[str, Any]
    step: int = 0
    last_answer: dict[str, Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EnvServer:
    """Serves one registered ``Env`` class: a live env per session, at most ``max_sessions`` at once."""

    def __init__(
        self,
        env_name: str,
        *,
        timeout_s: float = DEFAULT_ENV_TIMEOUT_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self.env_name = env_name
        self.env_cls = env_class(env_name)
        self.timeout_s = timeout_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        self._opening: set[str] = set()

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/reset", self._route(self.reset))
        app.router.add_post("/step", self._route(self.step))
        app.router.add_post("/close", self._route(self.close))
        app.router.add_get("/healthz", self._healthz)
        app.on_shutdown.append(lambda _app: self.close_all())
        return app

    def _route(self, handler: Any) -> Any:
        from aiohttp import web

        async def route(request: Any) -> Any:
            try:
                body = msgspec.json.decode(await request.read())
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                status, answer = await handler(body)
            except (BadRequest, msgspec.DecodeError) as exc:
                status, answer = 400, {"error": str(exc)}
            except EnvError as exc:
                status, answer = 500, {"error": str(exc)}
            return web.Response(body=_dumps(answer), status=status, content_type="application/json")

        return route

    async def _healthz(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"env": self.env_name, "sessions": len(self.sessions)})

    @staticmethod
    def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
        value = body.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise BadRequest(f"field {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
        return value

    async def _call(self, method: Any, *args: Any) -> Any:
        return await call_env(
            method, *args, timeout_s=self.timeout_s, what=f"{self.env_cls.__name__}.{method.__name__}()"
        )

    async def reset(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sid = self._field(body, "session_id", str)
        if sid in self.sessions:  # a retried reset: the first answer
            return 200, self.sessions[sid].reset_answer
        if sid in self._opening:
            return 503, {"error": f"session {sid} is being reset; retry"}
        if len(self.sessions) + len(self._opening) >= self.max_sessions:
            return 503, {"error": f"{self.max_sessions} sessions are live (--max-sessions); retry later"}
        env_config = self._field(body, "env_config", dict)
        raw = self._field(body, "request", dict)
        request = RolloutInferRequest(
            messages=list(raw.get("messages") or []),
            data_dict=dict(raw.get("data_dict") or {}),
            uuid=raw.get("uuid"),
            tools=raw.get("tools"),
            images=list(raw.get("images") or []),
            audios=list(raw.get("audios") or []),
            videos=list(raw.get("videos") or []),
        )
        self._opening.add(sid)
        try:
            try:
                env = self.env_cls({"name": self.env_name, **env_config})
            except Exception as exc:  # noqa: BLE001 - a bad env_config: the client's request is at fault
                raise BadRequest(
                    f"{self.env_cls.__name__}({env_config!r}) raised {type(exc).__name__}: {exc}"
                ) from None
            try:
                observation, info, system_message = await self._call(env.reset, request)
            except EnvError:
                with contextlib.suppress(EnvError):
                    await self._call(env.close)
                raise
            answer = {"observation": observation, "info": info, "system_message": system_message}
            self.sessions[sid] = _Session(env=env, reset_answer=answer, lock=asyncio.Lock())
        finally:
            self._opening.discard(sid)
        return 200, answer

    async def step(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sid = self._field(body, "session_id", str)
        index = self._field(body, "step", int)
        messages = self._field(body, "messages", list)
        session = self.sessions.get(sid)
        if session is None:
            return 404, {"error": f"no session {sid} (reset it first, or it was closed)"}
        async with session.lock:
            if index == session.step and session.last_answer is not None:  # a retried step: the same answer
                return 200, session.last_answer
            if index != session.step + 1:
                return 409, {"error": f"session {sid} is at step {session.step}; got step {index}"}
            observation, reward, done, info = await self._call(session.env.step, messages)
            session.step = index
            session.last_answer = {
                "observation": observation,
                "reward": float(reward),
                "done": bool(done),
                "info": info,
            }
            return 200, session.last_answer

    async def close(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        session = self.sessions.pop(self._field(body, "session_id", str), None)
        if session is None:
            return 200, {"closed": False}  # already closed (a retried close)
        await self._call(session.env.close)
        return 200, {"closed": True}

    async def close_all(self) -> None:
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            with contextlib.suppress(EnvError):
                await self._call(session.env.close)


async def serve(
    spec: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout_s: float = DEFAULT_ENV_TIMEOUT_S,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    stop: asyncio.Event | None = None,
    announce: Any = print,
) -> None:
    """``rollstream env-serve PLUGIN.py:NAME``: load the plugin file (or none, for a built-in ``NAME``),
    serve the env registered as NAME until ``stop`` is set (or the process is signalled)."""
    from aiohttp import web

    path, _, name = spec.rpartition(":")
    if path:
        load_plugins([path])
    server = EnvServer(name, timeout_s=timeout_s, max_sessions=max_sessions)
    runner = web.AppRunner(server.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    announce(f"serving env {name!r} on http://{host}:{bound} (started {time.strftime('%H:%M:%S')})")
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
