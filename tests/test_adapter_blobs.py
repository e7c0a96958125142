"""LoRA adapters over Redis (data/media.py): a published adapter's files travel as one content-addressed
blob, unpacked on the rollout host exactly; a blob that is gone, altered, or names a path outside its
directory is an error that says so. (The two-host run is tests/test_two_hosts.py.)"""

from __future__ import annotations

import uuid

import msgspec
import pytest

from data.media import MediaError, fetch_adapter, image_key, put_adapter
from pipeline.transport import connect


@pytest.fixture
async def redis(redis_url):
    transport = await connect("redis", run=f"adapters-{uuid.uuid4().hex[:6]}", url=redis_url)
    yield transport
    await transport.delete_run()
    await transport.close()


def adapter_dir(tmp_path, tag: bytes):
    directory = tmp_path / f"v-{tag.decode()}"
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(tag * 1000)
    return directory


async def test_an_adapter_travels_whole_and_the_cache_keeps_only_the_newest(redis, tmp_path):
    cache = tmp_path / "cache"
    first, _ = await put_adapter(redis, adapter_dir(tmp_path, b"a"))
    second, _ = await put_adapter(redis, adapter_dir(tmp_path, b"b"))
    assert first != second
    got = await fetch_adapter(redis, first, version=1, cache_dir=cache)
    assert (got / "adapter_model.safetensors").read_bytes() == b"a" * 1000
    assert (got / "adapter_config.json").read_text() == '{"r": 8}'
    newer = await fetch_adapter(redis, second, version=2, cache_dir=cache)
    assert (newer / "adapter_model.safetensors").read_bytes() == b"b" * 1000
    assert [p.name for p in cache.iterdir()] == [newer.name]  # the engine holds what it loaded


async def test_a_missing_altered_or_escaping_adapter_is_an_error(redis, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(MediaError, match="version 3: its LoRA adapter .* is not in Redis any more"):
        await fetch_adapter(redis, image_key(b"never stored"), version=3, cache_dir=cache)
    data = msgspec.msgpack.encode({"adapter_model.safetensors": b"x"})
    await redis.put_blob(image_key(b"other bytes"), data, 60)
    with pytest.raises(MediaError, match="does not match its key"):
        await fetch_adapter(redis, image_key(b"other bytes"), version=4, cache_dir=cache)
    escaping = msgspec.msgpack.encode({"../outside": b"x"})
    await redis.put_blob(image_key(escaping), escaping, 60)
    with pytest.raises(MediaError, match="names a file '../outside'"):
        await fetch_adapter(redis, image_key(escaping), version=5, cache_dir=cache)
    assert not (tmp_path / "outside").exists()
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]
