"""The CPU-only torchvision workaround (data/vl_compat.py) and the tiny VL model it serves."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from data import vl_compat
from data.loading import SHAPE_COLOURS, load_dataset, shapes_rows


def test_the_hook_is_installed_only_without_torchvision(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not vl_compat._finder])
    monkeypatch.setattr(vl_compat, "NEEDED", False)
    assert vl_compat.apply() is False
    assert vl_compat._finder not in sys.meta_path
    monkeypatch.setattr(vl_compat, "NEEDED", True)
    assert vl_compat.apply() is True
    assert sys.meta_path.count(vl_compat._finder) == 1
    assert vl_compat.apply() is True and sys.meta_path.count(vl_compat._finder) == 1  # idempotent


@pytest.mark.skipif(not vl_compat.NEEDED, reason="torchvision is installed: nothing to work around")
def test_vllm_imports_of_torchvision_modules_get_the_pil_versions():
    stub = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    assert stub.smart_resize is pil.smart_resize
    assert stub.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
    video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    assert video.smart_resize(2, 100, 100, factor=32) == (96, 96)
    with pytest.raises(ImportError, match="torchvision"):
        video.Qwen3VLVideoProcessor()


def test_the_processor_of_the_tiny_vl_model_loads_and_expands_the_image(tiny_vl_model_dir):
    from transformers import AutoProcessor

    from tinymodels.vl import pil_image

    processor = AutoProcessor.from_pretrained(str(tiny_vl_model_dir))
    row = load_dataset("shapes", size=1, seed=3)[0]
    text = processor.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 1
    enc = processor(text=[text], images=[pil_image(row["images"][0])], return_tensors="pt")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 x 56 pixels, 14-pixel patches
    assert int((enc["input_ids"] == pad).sum()) == 4  # one pad per 2 x 2 merged patch
    assert enc["mm_token_type_ids"].sum() == 4
    assert processor.video_processor.patch_size == 14  # the placeholder vLLM reads


def test_tiny_vl_model_is_warm_started_but_not_solved(tiny_vl_model_dir):
    info = json.loads((tiny_vl_model_dir / "rollstream_recipe.json").read_text())
    assert 0.15 <= info["accuracy"] <= 0.8  # GRPO has signal: neither always wrong nor solved
    for name in ("model.safetensors", "preprocessor_config.json", "chat_template.json", "tokenizer.json"):
        assert (tiny_vl_model_dir / name).is_file()


def test_shapes_rows_come_from_the_seed():
    a, b, c = shapes_rows(20, 1), shapes_rows(20, 1), shapes_rows(20, 2)
    assert a == b and a != c
    assert {row["solution"] for row in a} <= set(SHAPE_COLOURS)
    assert all(row["images"][0].startswith(b"\x89PNG") for row in a)
