"""Shared fixtures: the real redis-server, the tiny model, and ONE vLLM engine for the whole session
(it takes ~8-25 s to start on this CPU)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

import data.vl_compat  # noqa: F401  (CPU-only torchvision workaround, before transformers loads)

_SCRATCH = Path(tempfile.mkdtemp(prefix="rollstream-tests-"))
# vLLM and inductor leave caches and IPC sockets behind: keep them in a scratch dir.
os.environ.setdefault("VLLM_CACHE_ROOT", str(_SCRATCH / "vllm-cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SCRATCH / "inductor"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REDIS_URL = os.environ.get("ROLLSTREAM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_answers(host: str = "127.0.0.1", port: int = 6379) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _redis_answers():
        pytest.fail(
            "redis-server does not answer on 127.0.0.1:6379; start it: "
            'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no'
        )
    return REDIS_URL


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from tinymodels.text import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A one-layer random Qwen2 (vocabulary of 64 words t0..t63, word-level tokenizer): the learner tests'."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", unk_token="t0").save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_vl_model_dir() -> Path:
    """The tiny Qwen2-VL model (built on first use, ~1 min, then cached)."""
    from tinymodels.text import model_path

    return model_path("tiny-vl")


@pytest.fixture(scope="session")
def tiny_agent_model_dir() -> Path:
    """The tiny tool-use model, "tiny-agent" (built on first use, ~70 s, then cached)."""
    from tinymodels.text import model_path

    return model_path("tiny-agent")


@pytest.fixture(scope="session")
async def vllm_vl_engine(tiny_vl_model_dir):
    """ONE vLLM engine on the tiny VL model for every VL test."""
    from engines.vllm_engine import VLLMEngine

    engine = await VLLMEngine.start(tiny_vl_model_dir, max_model_len=256, kv_cache_gib=1,
                                    limit_mm_per_prompt={"image": 2})  # 2: the multi-turn test adds one
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
async def vllm_engine(tiny_model_dir):
    from engines.vllm_engine import VLLMEngine

    # One engine thread, as the pipeline's default on this machine (rollout.engine_threads): the tests'
    # learners run in this process and keep the other core.
    engine = await VLLMEngine.start(tiny_model_dir, max_model_len=256, kv_cache_gib=1, cpu_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
async def vllm_lora_engine(tiny_model_dir):
    """A second, LoRA-enabled engine (max_lora_rank 8): only the LoRA tests start it."""
    from engines.vllm_engine import VLLMEngine

    engine = await VLLMEngine.start(tiny_model_dir, max_model_len=256, kv_cache_gib=1, max_lora_rank=8)
    yield engine
    engine.shutdown()
