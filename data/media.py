"""Bulk bytes on the wire: content-addressed, stored once, records carry keys only (images; LoRA adapters).

The feeder stores a prompt's images through the transport (``put_blob``: Redis ``rollstream:{run}:blob:<key>``
with ``transport.blob_ttl_s``, or the memory transport's dict) and puts their keys in the ``PromptTask``;
the rollout and the learner fetch them by key. A group of G requests thus moves each image once, not G
times, and an image shared by many prompts is stored once. A key is ``sha256:<hex digest of the bytes>``,
checked again on every fetch, so corrupted or substituted bytes are an error, never a silent wrong image.

A LoRA run over Redis (``weight_transport = "lora"``) also stores each published adapter this way
(``put_adapter``: its directory's files packed into one blob, ``WeightsPublished.blob``): a rollout host that
does not see the learner's ``output_dir`` fetches it (``fetch_adapter``) instead of needing a shared filesystem.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec

KEY_PREFIX = "sha256:"
ADAPTER_TTL_S = 900
"""How long a published adapter's blob lives in Redis: a rollout worker fetches it when the announcement
arrives; the learner renews the newest one (for a worker that starts later) every ADAPTER_TTL_S / 3 while it
runs. Older ones expire, so Redis holds about ADAPTER_TTL_S worth of versions, not the whole run."""
ADAPTER_MAX_BYTES = 512 * 2**20  # Redis' largest string


class MediaError(RuntimeError):
    """An image that cannot be stored (over the size limit) or fetched (expired, missing, corrupted)."""


def image_key(data: bytes) -> str:
    return KEY_PREFIX + hashlib.sha256(data).hexdigest()


async def put_images(ctx: Any, images: list[bytes], *, ttl_s: int, max_bytes: int | None = None,
                     where: str = "") -> list[str]:
    """Store each image once (content-addressed) and return their keys, in order."""
    keys = []
    for k, data in enumerate(images):
        if max_bytes is not None and len(data) > max_bytes:
            raise MediaError(
                f"{where}image {k}: {len(data):,} bytes is over data.max_image_bytes = {max_bytes:,}"
            )
        key = image_key(data)
        await ctx.put_blob(key, data, ttl_s)
        keys.append(key)
    return keys


class ImageCache:
    """A bounded in-process cache of fetched images by key (a group's G requests, the learner's mini-batches
    and its reference pass all ask for the same image): at most ``max_items`` most recently used."""

    def __init__(self, max_items: int = 256) -> None:
        self.max_items = max_items
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.fetched = 0  # transport reads (cache misses)

    async def get(self, ctx: Any, keys: list[str]) -> list[bytes]:
        out = []
        for key in keys:
            data = self._items.get(key)
            if data is None:
                data = await ctx.get_blob(key)
                self.fetched += 1
                if data is None:
                    raise MediaError(
                        f"image {key} is not in the store: expired (transport.blob_ttl_s) or never stored"
                    )
                if image_key(data) != key:
                    raise MediaError(f"image {key}: the stored bytes do not match their key")
                self._items[key] = data
                while len(self._items) > self.max_items:
                    self._items.popitem(last=False)
            else:
                self._items.move_to_end(key)
            out.append(data)
        return out


def image_bytes(image: Any) -> bytes:
    """An image as file bytes: bytes as they are, a path read, a PIL image encoded as PNG (what a multi-turn
    scheduler may put in ``infer_request.images``)."""
    import io
    from pathlib import Path

    if isinstance(image, bytes | bytearray):
        return bytes(image)
    if isinstance(image, str | Path):
        return Path(image).expanduser().read_bytes()
    if hasattr(image, "save"):
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise MediaError(f"an image must be bytes, a file path or a PIL image, got {type(image).__name__}")


def pil_images(images: list[Any]) -> list[Any]:
    """Decoded RGB PIL images (what vLLM's multi_modal_data and the HF image processors take)."""
    import io

    from PIL import Image

    out = []
    for item in images:
        if hasattr(item, "convert"):  # already a PIL image
            out.append(item.convert("RGB"))
            continue
        with Image.open(io.BytesIO(image_bytes(item))) as image:
            out.append(image.convert("RGB"))
    return out


def pack_adapter(directory: Path) -> bytes:
    """The files of an adapter snapshot (adapter_config.json, adapter_model.safetensors, ...) as one blob."""
    files = {f.name: f.read_bytes() for f in sorted(Path(directory).iterdir()) if f.is_file()}
    data = msgspec.msgpack.encode(files)
    if len(data) > ADAPTER_MAX_BYTES:
        raise MediaError(
            f"LoRA adapter {directory}: {len(data):,} bytes is over Redis' {ADAPTER_MAX_BYTES:,}-byte limit for "
            "one blob; give the rollout workers the learner's run.output_dir (a shared filesystem)"
        )
    return data


async def put_adapter(ctx: Any, directory: Path, ttl_s: int = ADAPTER_TTL_S) -> tuple[str, bytes]:
    """Store an adapter snapshot's files once (content-addressed); returns its key and the blob."""
    data = await asyncio.to_thread(pack_adapter, directory)
    key = image_key(data)
    await ctx.put_blob(key, data, ttl_s)
    return key, data


async def readable_here(ctx: Any, record: Any) -> Any:
    """A ``WeightsPublished`` whose snapshot this host reads: ``record`` itself, or (LoRA over Redis, the
    learner's output_dir not seen here) a copy pointing at its adapter's blob unpacked locally. MediaError
    when that blob is gone."""
    if not record.blob or Path(record.path).exists():
        return record
    local = await fetch_adapter(ctx, record.blob, version=record.version)
    return msgspec.structs.replace(record, path=str(local))


async def fetch_adapter(ctx: Any, key: str, *, version: int, cache_dir: Path | None = None) -> Path:
    """The adapter stored under ``key``, unpacked into ``cache_dir/<digest>`` (once; atomically; default: a
    directory of this worker's under the system's temp dir). Older adapters there are removed: the engine
    holds what it loaded in memory."""
    if cache_dir is None:
        cache_dir = Path(tempfile.gettempdir()) / "rollstream-adapters" / f"{ctx.run}-{ctx.worker}"
    digest = key.removeprefix(KEY_PREFIX)
    target = Path(cache_dir) / digest
    if not target.is_dir():
        data = await ctx.get_blob(key)
        if data is None:
            raise MediaError(
                f"weights version {version}: its LoRA adapter ({key}) is not in Redis any more (each lives "
                f"{ADAPTER_TTL_S} s; the learner renews only the newest): the next version's follows. If none "
                "does, the learner is gone: restart it with --resume"
            )
        if image_key(data) != key:
            raise MediaError(f"weights version {version}: the stored adapter does not match its key {key}")
        try:
            files = msgspec.msgpack.decode(data, type=dict[str, bytes])
        except msgspec.DecodeError as exc:
            raise MediaError(f"weights version {version}: the stored adapter {key} does not decode: {exc}") from None
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".incoming-"))
        for name, content in files.items():
            if not name or name != os.path.basename(name) or name in (".", ".."):  # names crossed a process boundary
                shutil.rmtree(staging, ignore_errors=True)
                raise MediaError(f"weights version {version}: the stored adapter {key} names a file {name!r}")
            (staging / name).write_bytes(content)
        os.replace(staging, target)
    for old in Path(cache_dir).iterdir():
        if old != target and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return target
