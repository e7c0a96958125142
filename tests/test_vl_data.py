"""Image rows (ms-swift's multimodal forms), their errors, and images stored once by content key."""

from __future__ import annotations

import json

import pytest
from fake_context import FakeContext

from data.loading import DatasetError, load_dataset, prompt_key, shapes_image
from data.media import ImageCache, MediaError, image_key, put_images
from pipeline.transport.memory import MemoryTransport


def png(colour="red", at=0):
    return shapes_image((colour, at), ("blue" if colour != "blue" else "red", (at + 1) % 4))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_placeholder_strings_with_an_images_column_of_paths(tmp_path):
    (tmp_path / "a.png").write_bytes(png("red"))
    (tmp_path / "b.png").write_bytes(png("green"))
    rows = load_dataset(str(write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "<image>Which? <image> or this"},
                      {"role": "assistant", "content": "red"}], "images": ["a.png", str(tmp_path / "b.png")]},
    ])))
    row = rows[0]
    assert row["messages"] == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Which? "}, {"type": "image"}, {"type": "text", "text": " or this"}]}]
    assert row["images"] == [png("red"), png("green")]  # relative paths resolve against the dataset's directory
    assert row["solution"] == "red"


def test_content_lists_and_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    table = pa.Table.from_pylist([{"messages": json.loads(json.dumps(messages)), "images": [{"bytes": png(), "path": None}],
                                   "solution": "red"}])
    pq.write_table(table, tmp_path / "d.parquet")
    row = load_dataset(str(tmp_path / "d.parquet"))[0]
    assert row["messages"][0]["content"][0] == {"type": "image"}
    assert row["images"] == [png()]


def test_text_rows_are_unchanged():
    row = load_dataset("arithmetic", size=1, seed=0)[0]
    assert isinstance(row["messages"][0]["content"], str) and "images" not in row


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": [{"role": "user", "content": "<image><image>x"}], "images": ["a.png"], "solution": "1"},
     "row 0 has 2 image placeholder.* but 1 image"),
    ({"messages": [{"role": "user", "content": "x"}], "images": ["a.png"], "solution": "1"},
     "row 0 has 0 image placeholder"),
    ({"messages": [{"role": "user", "content": "<image>x"}], "images": ["missing.png"], "solution": "1"},
     "row 0, image 0: cannot read 'missing.png'"),
    ({"messages": [{"role": "user", "content": "<image>x"}], "images": ["bad.png"], "solution": "1"},
     "row 0, image 0: not a readable image"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}], "solution": "1"},
     "row 0: a content part must be"),
])
def test_bad_image_rows_are_errors_naming_the_row(tmp_path, row, message):
    (tmp_path / "a.png").write_bytes(png())
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DatasetError, match=message):
        load_dataset(str(write_jsonl(tmp_path / "d.jsonl", [row])))


def test_image_size_limit(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "<image>x"}],
                                               "images": ["a.png"], "solution": "1"}])
    with pytest.raises(DatasetError, match="row 0, image 0: .* bytes is over data.max_image_bytes = 100"):
        load_dataset(str(path), max_image_bytes=100)


def test_same_text_other_image_is_another_prompt():
    rows = load_dataset("shapes", size=50, seed=0)
    texts = {json.dumps(r["messages"]) for r in rows}
    assert len({prompt_key(r) for r in rows}) > len(texts)


async def test_images_are_stored_once_by_content_and_checked_on_fetch():
    transport = MemoryTransport()
    ctx = FakeContext(transport=transport)
    keys = await put_images(ctx, [png("red"), png("red"), png("green")], ttl_s=60)
    assert keys[0] == keys[1] == image_key(png("red")) and keys[2] != keys[0]
    assert transport.blobs_stored == 2
    cache = ImageCache(max_items=1)
    assert await cache.get(ctx, keys) == [png("red"), png("red"), png("green")]
    assert cache.fetched == 2  # the repeated key came from the cache
    with pytest.raises(MediaError, match="over data.max_image_bytes"):
        await put_images(ctx, [png()], ttl_s=60, max_bytes=10)
    with pytest.raises(MediaError, match="not in the store"):
        await ImageCache().get(ctx, [image_key(b"never stored")])
    transport._blobs[keys[2]] = png("blue")  # corrupted
    with pytest.raises(MediaError, match="do not match"):
        await ImageCache().get(ctx, [keys[2]])


async def test_redis_blobs_are_run_scoped_with_a_ttl(redis_url):
    from pipeline.transport.redis import RedisTransport

    transport = await RedisTransport.connect(redis_url, run="vl-blob-test")
    try:
        await transport.delete_run()
        key = image_key(png())
        assert await transport.put_blob(key, png(), 120) is True
        assert await transport.put_blob(key, png(), 120) is False
        assert await transport.get_blob(key) == png()
        ttl = await transport._client.ttl(f"rollstream:vl-blob-test:blob:{key}")
        assert 0 < ttl <= 120
        assert await transport.delete_run() >= 1
        assert await transport.get_blob(key) is None
    finally:
        await transport.close()
