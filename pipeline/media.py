"""Images on the wire: content-addressed bytes stored once per prompt group, records carry keys only.

The feeder stores a prompt's images through the transport (``put_blob``: Redis ``rollstream:{run}:blob:<key>``
with ``transport.blob_ttl_s``, or the memory transport's dict) and puts their keys in the ``PromptTask``;
the rollout and the learner fetch them by key. A group of G requests thus moves each image once, not G
times, and an image shared by many prompts is stored once. A key is ``sha256:<hex digest of the bytes>``,
checked again on every fetch, so corrupted or substituted bytes are an error, never a silent wrong image.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

KEY_PREFIX = "sha256:"


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
