"""The server engine: OpenAI-compatible ``vllm serve`` processes, started separately, asked for token ids
and logprobs over HTTP (``rollout.engine = "server"``).

New weights reach the servers from a file (``/collective_rpc``) or, under ``weight_transport = "broadcast"``,
over the learner's one weights group: each server's vLLM workers are ranks of that group themselves (their
own rank offsets, from the member's), and the rollout worker only drives them through their dev-mode routes.
A server takes broadcasts when started with ``SERVER_FLAGS`` and rollstream installed in its environment
(the ``vllm.general_plugins`` entry point, ``engines/vllm_plugin.py``, registers the backend there).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engines.base import ENGINE_START_TIMEOUT_S, WEIGHT_LOAD_TIMEOUT_S, EngineBase, Sample
from engines.weight_loader import WORKER_EXTENSION, weights_file
from pipeline import metrics
from pipeline.errors import SetupError
from pipeline.stage import FatalStageError
from weights import transfer

SERVER_FLAGS = (
    f"VLLM_SERVER_DEV_MODE=1 vllm serve ... --weight-transfer-config '{{\"backend\": \"{transfer.BACKEND}\"}}'"
)
"""How a server must be started to take weights by broadcast (with rollstream installed beside vLLM)."""
GONE_GRACE_S = 10.0  # how long a member whose server went away stays silent before it says so itself


class ServerError(RuntimeError):
    """Every configured vLLM server failed one request (the worker retries or redelivers the prompt)."""


class ServerNotReady(SetupError):
    """A server cannot take weights by broadcast: it was not started for it (the message names the flags)."""


class ServerGone(FatalStageError):
    """Under broadcast, a server of this worker went away (connection refused or dropped): its ranks are
    out of every group, so the worker cannot take weights any more. It fails (as an in-process engine's death
    fails it); restarted, it waits for its servers and rejoins at the next version."""


class ServerEngine(EngineBase):
    """OpenAI-compatible ``vllm serve`` processes, started separately (README: server mode).

    A turn is ``POST /v1/completions`` with the prompt as token ids, asking for the sampled tokens' ids
    and logprobs. Requests go round-robin; a connection error, a 5xx or a timeout retries the request on
    the next server (same seed, so the same sample), and only when every server failed does it raise.
    New weights go to every server through the dev-mode routes (``/collective_rpc`` with
    ``RLWeights.reload_file``, ``/reset_prefix_cache``, ``/update_weight_version``), or by broadcast
    (``prepare_broadcast``, then ``join_broadcast`` / ``receive_broadcast`` / ``commit_broadcast``, the
    contract of ``VLLMEngine``'s; every server at once).
    """

    def __init__(self, urls: list[str], model_name: str, tokenizer: Any, model_dir: Path, timeout_s: float) -> None:
        import httpx

        super().__init__(tokenizer, model_dir)
        self.urls = [u.rstrip("/") for u in urls]
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self._closed = False  # shutdown() closes the client once
        self.retries = 0  # requests moved to another server (also counted in the metric)
        self.labels: tuple[str, str, str] | None = None
        self._next = 0
        # Broadcast: each server's ranks (vLLM workers), whether all run on CUDA, each one's weight label
        # as last seen, the version staged and on which servers, the servers with a vLLM update session open.
        self.world_sizes: dict[str, int] = {}
        self._cuda = False
        self._server_versions: dict[str, str] = {}
        self._staged: tuple[int, list[str]] | None = None
        self._sessions: set[str] = set()
        self._gone: str | None = None  # a server that went away under broadcast, and how
        self._probe: asyncio.Task | None = None  # the heartbeat's look at the servers (broadcast)

    @classmethod
    async def start(cls, urls: list[str], model_dir: str | Path, *, timeout_s: float = 300.0,
                    start_timeout_s: float = ENGINE_START_TIMEOUT_S) -> ServerEngine:
        """Wait until at least one server answers /health; its /v1/models names the model to ask for."""
        import httpx
        from transformers import AutoTokenizer

        deadline = time.monotonic() + start_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                for url in urls:
                    try:
                        if (await client.get(f"{url.rstrip('/')}/health")).status_code == 200:
                            models = (await client.get(f"{url.rstrip('/')}/v1/models")).json()["data"]
                            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
                            engine = cls(urls, models[0]["id"], tokenizer, Path(model_dir), timeout_s)
                            engine.max_model_len = models[0].get("max_model_len")  # the server's context
                            return engine
                    except httpx.TransportError:
                        pass
                if time.monotonic() > deadline:
                    raise ServerError(f"no vLLM server answered /health within {start_timeout_s:.0f} s: {', '.join(urls)}")
                await asyncio.sleep(0.5)  # polling a server that is still starting

    async def generate(self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                       repetition_penalty: float = 1.0, stop: list[str] | None = None, priority: int = 0,
                       gated: bool = True, images: list[Any] | None = None) -> Sample:
        # priority: the servers' own scheduling policy decides (start them with --scheduling-policy priority).
        if images:
            raise ValueError("image prompts need rollout.engine = \"async\" (the server engine sends token ids only)")
        body = {
            "model": self.model_name, "prompt": list(prompt_ids), "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else -1, "min_p": min_p,
            "repetition_penalty": repetition_penalty, "seed": seed, "stop": stop or None,
            "logprobs": 1, "return_token_ids": True, "request_id": request_id,
            **({"priority": priority} if priority else {}),
        }
        async with self.running("pause") if gated else contextlib.nullcontext():
            started_at = self.version
            choice = await self._post_with_failover("/v1/completions", body)
        token_ids = list(choice["token_ids"])
        logprobs = list(choice["logprobs"]["token_logprobs"])[: len(token_ids)]
        return Sample(token_ids, logprobs, choice.get("finish_reason") or "stop", started_at, self.version)

    async def _post_with_failover(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        errors = []
        first, self._next = self._next, self._next + 1  # round-robin start; then every other server once
        for attempt in range(len(self.urls)):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                response = await self.client.post(f"{url}{route}", json=body)
                if response.status_code < 500:
                    response.raise_for_status()  # a 4xx is our request's fault: no other server will take it
                    return response.json()["choices"][0]
                errors.append(f"{url}: HTTP {response.status_code}")
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                errors.append(f"{url}: {type(exc).__name__}")
            if attempt + 1 < len(self.urls):
                self.retries += 1
                if self.labels:
                    metrics.SERVER_RETRIES.labels(*self.labels).inc()
        raise ServerError(f"every vLLM server failed {route}: {'; '.join(errors)}")

    async def _reload(self, path: Path, version: int) -> None:
        if path == transfer.STAGED:  # received by broadcast: the servers that staged it load it
            await self._commit_staged(version)
            return
        await self._reload_file(path, version)

    async def _reload_file(self, path: Path, version: int) -> None:
        """Every server reloads at once (one after another, N servers took N times as long, and a hung one
        held back all behind it); the version is loaded when each has answered or failed."""
        import httpx

        file = weights_file(path)
        results = await asyncio.gather(*(self._reload_one(url, file, version) for url in self.urls),
                                       return_exceptions=True)
        for url, result in zip(self.urls, results, strict=True):
            if isinstance(result, httpx.HTTPStatusError):
                raise ServerError(
                    f"{url}: weight reload refused ({result.response.status_code}); start the server with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}"
                ) from None
            if isinstance(result, BaseException) and not isinstance(result, httpx.TransportError):
                raise result
        # A dead server (TransportError) gets no requests that succeed either; it reloads when restarted.
        if all(isinstance(result, BaseException) for result in results):
            raise ServerError(f"no vLLM server took weights version {version}: {', '.join(self.urls)}")

    async def _reload_one(self, url: str, file: Path, version: int) -> None:
        r = await self.client.post(f"{url}/collective_rpc", json={"method": "reload_file", "args": [str(file)]},
                                   timeout=WEIGHT_LOAD_TIMEOUT_S)
        r.raise_for_status()
        (await self.client.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"})
         ).raise_for_status()
        (await self.client.post(f"{url}/update_weight_version", json={"new_version": str(version)})
         ).raise_for_status()

    # ------------------------------------------------------------------ weights by broadcast

    async def prepare_broadcast(self, start_timeout_s: float = ENGINE_START_TIMEOUT_S) -> int:
        """Check that every server can join a weights group (dev-mode routes, our weight-transfer backend) and
        learn its ranks (``/get_world_size``); returns them all together, this member's world size. A server
        not started for it is a ServerNotReady naming the flags, at the worker's start, never a hang later."""
        results = await asyncio.gather(*(self._check_server(url, start_timeout_s) for url in self.urls),
                                       return_exceptions=True)
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        if errors:
            raise ServerNotReady(
                f'rollout.weight_transport = "broadcast" with rollout.engine = "server": {"; ".join(errors)}. '
                f"Start each server as {SERVER_FLAGS} with rollstream installed in the server's environment "
                f"(its vllm.general_plugins entry point registers the backend), or use weight_transport = \"file\""
            )
        checked = [r for r in results if not isinstance(r, BaseException)]  # all of them, by now
        self.world_sizes = {url: size for url, (size, _) in zip(self.urls, checked, strict=True)}
        self._cuda = all(cuda for _, cuda in checked)
        return sum(self.world_sizes.values())

    async def _check_server(self, url: str, start_timeout_s: float) -> tuple[int, bool]:
        """(this server's ranks, whether it runs on CUDA), once it answers /health."""
        import httpx

        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                if (await self.client.get(f"{url}/health", timeout=5.0)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"{url} did not answer /health within {start_timeout_s:.0f} s")
            await asyncio.sleep(0.5)  # polling a server that is still starting
        response = await self.client.get(f"{url}/get_world_size", params={"include_dp": "true"})
        if response.status_code == 404:
            raise ServerError(f"{url} has no dev-mode routes (GET /get_world_size: 404): it was started without "
                              "VLLM_SERVER_DEV_MODE=1")
        response.raise_for_status()
        world_size = int(response.json()["world_size"])
        # The server's own config (the first call gathers its environment: ~2 s, once).
        info = await self.client.get(f"{url}/server_info", params={"config_format": "json"}, timeout=60.0)
        info.raise_for_status()
        config = info.json()["vllm_config"]
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != transfer.BACKEND:
            raise ServerError(f"{url} has weight_transfer_config backend {backend!r}, not "
                              f"{transfer.BACKEND!r}: it was started without --weight-transfer-config "
                              f"'{{\"backend\": \"{transfer.BACKEND}\"}}'")
        return world_size, (config.get("device_config") or {}).get("device") == "cuda"

    def check_alive(self) -> None:
        """Raise ServerGone once a server this worker takes broadcasts with went away (the worker's heartbeat
        looks every second; the failed round or join has told the learner already)."""
        if self._gone is None and self.world_sizes and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_servers())
        if self._gone is not None:
            raise ServerGone(
                f"vLLM server {self._gone} went away: its workers were ranks of the weights group, so this "
                f"rollout worker cannot take weights by broadcast without it. Restart the server; this worker, "
                f"restarted, waits for it and rejoins at the next version"
            )

    async def _probe_servers(self) -> None:
        """GET /health of every server: one that refuses or drops the connection is gone (found here, its
        worker fails before the learner's next round counts on it). A slow answer is not a death: a server
        that runs its engine in its API process answers nothing while its worker receives a round."""
        import httpx

        async def probe(url: str) -> None:
            try:
                await self.client.get(f"{url}/health", timeout=5.0)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                self._went(url, "/health", exc)
            except httpx.TransportError:
                pass  # slow or busy: the next heartbeat looks again

        await asyncio.gather(*(probe(url) for url in self.urls))

    def _went(self, url: str, route: str, exc: Exception) -> None:
        self._gone = f"{url} ({route}: {type(exc).__name__}: {exc})"

    async def _silent_if_gone(self) -> None:
        """After a failure: when a server went away, answer nothing (the worker fails at its next heartbeat,
        which cancels this wait): an answer would keep this member in the learner's next epoch, which it
        cannot join. Bounded: without a heartbeat (a bare engine) it raises after GONE_GRACE_S."""
        if self._gone is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=GONE_GRACE_S)
        self.check_alive()

    joins_broadcast = True

    def broadcast_backends(self) -> list[str]:
        """NCCL when every server runs on CUDA, gloo always (``prepare_broadcast`` first)."""
        return ["nccl", "gloo"] if self._cuda else ["gloo"]

    async def join_broadcast(self, epoch: Any, me: Any, local_address: str) -> None:
        """Every server joins the epoch's group at its own rank offset (the member's first rank, then each
        server after the previous one's ranks, in ``server_urls`` order); returns once every rank is connected."""
        if me.world_size != sum(self.world_sizes.values()):
            raise ServerError(f"the epoch gives this member {me.world_size} ranks, its servers have "
                              f"{sum(self.world_sizes.values())} (prepare_broadcast first)")
        await self._end_sessions()
        self._staged = None
        inits, rank = {}, me.rank_offset
        for url in self.urls:
            inits[url] = transfer.RollstreamInitInfo(
                address=epoch.address, port=epoch.port, rank_offset=rank, world_size=epoch.world_size,
                backend=epoch.backend, epoch=epoch.epoch, timeout_s=epoch.timeout_s, chunk_bytes=epoch.chunk_bytes,
                local_address=server_address(url, local_address), names=list(epoch.names),
                dtype_names=list(epoch.dtypes), shapes=[list(s) for s in epoch.shapes],
                bucket_bytes=epoch.bucket_bytes,
            )
            rank += self.world_sizes[url]
        try:
            await self._on_every_server("join", {url: self._join_one(url, init, epoch.timeout_s * 2)
                                                 for url, init in inits.items()})
        except ServerError:
            await self._silent_if_gone()
            raise

    async def _join_one(self, url: str, init: Any, timeout_s: float) -> None:
        from dataclasses import asdict

        await self._post(url, "/init_weight_transfer_engine", {"init_info": asdict(init)}, timeout_s)
        # Its weights' label now: a server restarted since (the model's own weights) takes the next round
        # whole even when this worker holds that version.
        response = await self.client.get(f"{url}/weight_info")
        response.raise_for_status()
        self._server_versions[url] = str(response.json().get("weight_version"))

    async def receive_broadcast(self, epoch: int, version: int, timeout_s: float, load: bool | None = None) -> None:
        """Take part in one round: every server receives ``version`` whole into its staging buffer (its
        weights do not change). ``load`` False (by default: a version this worker holds already) receives and
        drops it, except on a server whose weights are not that version (restarted since)."""
        load = version > self.version if load is None else load
        loads = {url: load or self._server_versions.get(url) != str(self.version) for url in self.urls}
        self._staged = None
        await self._end_sessions()  # one left open by a round that failed on another server
        try:
            await self._on_every_server("round", {
                url: self._receive_one(url, epoch, version, loads[url], timeout_s * 4) for url in self.urls})
        except Exception:
            await self._end_sessions()  # the servers that received it: drop it, end their update session
            await self._silent_if_gone()
            raise
        staged = [url for url in self.urls if loads[url]]
        self._staged = (version, staged) if staged else None

    async def _receive_one(self, url: str, epoch: int, version: int, load: bool, timeout_s: float) -> None:
        await self._post(url, "/start_weight_update", {}, timeout_s)
        self._sessions.add(url)
        try:
            await self._post(url, "/update_weights",
                             {"update_info": {"epoch": epoch, "version": version, "load": load}}, timeout_s)
        except ServerError:
            self._sessions.discard(url)  # vLLM ends the session when an update fails
            raise
        if not load:
            await self._post(url, "/finish_weight_update", {}, WEIGHT_LOAD_TIMEOUT_S)  # loads nothing
            self._sessions.discard(url)

    async def commit_broadcast(self, version: int, mode: str) -> float:
        """Load the received ``version`` as a file is loaded: under ``mode``'s gate, on every server that
        staged it, prefix cache reset, version tagged. Returns its seconds (0 when there was nothing)."""
        if self._staged is None or self._staged[0] != version:
            return 0.0
        async with self._load_lock:
            # A restarted learner's version may be no newer than this worker's: it replaces it all the same.
            self.version = min(self.version, version - 1)
        seconds = await self.load_weights(transfer.STAGED, version, mode=mode)
        if self._staged is not None:  # not loaded (a newer version came meanwhile): drop it
            self._staged = None
            await self._end_sessions()
        return seconds

    async def _commit_staged(self, version: int) -> None:
        if self._staged is None or self._staged[0] != version:
            raise ServerError(f"version {version} was not received (staged: {self._staged})")
        _, urls = self._staged
        self._staged = None
        await self._on_every_server("load", {url: self._commit_one(url, version) for url in urls})

    async def _commit_one(self, url: str, version: int) -> None:
        await self._post(url, "/finish_weight_update", {}, WEIGHT_LOAD_TIMEOUT_S)
        self._sessions.discard(url)
        self._server_versions[url] = ""  # unknown until labelled: a failure below leaves it to be sent again
        # The cached KV came from the old weights (vLLM's finish does not reset the prefix cache).
        await self._post(url, "/reset_prefix_cache?reset_running_requests=true", None, WEIGHT_LOAD_TIMEOUT_S)
        await self._post(url, "/update_weight_version", {"new_version": str(version)}, WEIGHT_LOAD_TIMEOUT_S)
        self._server_versions[url] = str(version)

    async def _end_sessions(self) -> None:
        """End every open vLLM update session (drop what it staged): best effort, a server that fails it is
        in no state a later round can trust anyway, and its next join starts it over."""
        async def end(url: str) -> None:
            with contextlib.suppress(Exception):
                await self._post(url, "/update_weights", {"update_info": {"epoch": 0, "version": 0, "drop": True}},
                                 WEIGHT_LOAD_TIMEOUT_S)
            with contextlib.suppress(Exception):
                await self._post(url, "/finish_weight_update", {}, WEIGHT_LOAD_TIMEOUT_S)

        urls, self._sessions = sorted(self._sessions), set()
        await asyncio.gather(*(end(url) for url in urls))

    async def _on_every_server(self, step: str, calls: dict[str, Any]) -> None:
        """Run one call per server at once; any failure raises with every server's error."""
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        errors = [f"{url}: {r}" for url, r in zip(calls, results, strict=True) if isinstance(r, BaseException)]
        if errors:
            raise ServerError(f"weights {step} failed on {len(errors)} of {len(calls)} servers: {'; '.join(errors)}")

    async def _post(self, url: str, route: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST a dev-mode route; an error answer raises ServerError with the server's own message."""
        import httpx

        try:
            response = await self.client.post(f"{url}{route}", json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            raise ServerError(f"{route} took over {timeout_s:.0f} s") from None
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
                self._went(url, route, exc)  # refused or dropped: not there
            raise ServerError(f"{route}: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 400:
            try:
                error = response.json().get("error")
                message = error.get("message") if isinstance(error, dict) else error or response.text
            except ValueError:
                message = response.text
            raise ServerError(f"{route}: HTTP {response.status_code}: {str(message)[:500]}")
        return response

    def shutdown(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if not self._closed:
            self._closed = True
            try:
                asyncio.get_running_loop().create_task(self.client.aclose())
            except RuntimeError:
                pass



def server_address(url: str, local_address: str) -> str:
    """The address a server's workers bind their end of the weights group to: ``local_address`` (this
    host's address towards the learner) for a server on this host (a loopback URL), else the server's own
    address as its URL names it (the learner must reach it there)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    try:
        address = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return local_address
    return local_address if ipaddress.ip_address(address).is_loopback else address
