"""The tiny image-prompt (VL) models: random Qwen2-VL / Qwen2.5-VL / Qwen3-VL of ~0.6-0.75 M parameters
warm-started on the built-in ``shapes`` task (data/loading.py: "What colour is
the square?" over a picture of a square and a circle).

The build mirrors tinymodels/text.py (cached under the recipe's hash, written to a temp dir and renamed):

1. a byte-level BPE tokenizer with Qwen2's pipeline and the vision special tokens (ids 0-8), whose chat
   template renders ``{"type": "image"}`` as ``<|vision_start|><|image_pad|><|vision_end|>``;
2. the model (fp32, untied) and its image processor, saved as parts (``Qwen2VLProcessor.save_pretrained``
   needs torchvision): preprocessor_config.json + tokenizer files + chat_template.json;
3. a supervised warm start on the task, then a calibration phase on targets that are right only with
   probability ``calibrate_correct_prob``, so that sampling at temperature 1 answers right some of the
   time and GRPO has signal from the first step (as the text tiny model).
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import time
from pathlib import Path
from typing import Any

from data import vl_compat
from data.loading import SHAPE_COLOURS, SHAPE_NAMES, load_dataset, shapes_question
from rewards.builtin import answer_matches
from tinymodels.recipes import (
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN2_REGEX,
    RECIPE_FILE,
    VL_ARCHS,
    Progress,
    VLTinyModelRecipe,
    recipe_hash,
    warm_start_loop,
)

VL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
IMAGE_PAD = "<|image_pad|>"
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)




def patch_size(recipe: VLTinyModelRecipe) -> int:
    return 16 if recipe.arch == "qwen3_vl" else 14


# ---------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(recipe: VLTinyModelRecipe) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    corpus = []
    for shape in SHAPE_NAMES:
        for colour in SHAPE_COLOURS:
            corpus.append(f"<|im_start|>user\n{shapes_question(shape)}<|im_end|>\n<|im_start|>assistant\n{colour}<|im_end|>\n")
    corpus.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    trainer = trainers.BpeTrainer(vocab_size=recipe.vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(VL_SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(corpus * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = VL_CHAT_TEMPLATE
    return fast


# ------------------------------------------------------------------------------------------ model


def make_config(recipe: VLTinyModelRecipe, tokenizer: Any) -> Any:
    """The tiny configs (text tower as the text tiny model's; mrope sections sum to head_dim / 2)."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    head_dim = recipe.hidden_size // recipe.num_attention_heads
    text = {
        "vocab_size": len(tokenizer), "hidden_size": recipe.hidden_size, "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_hidden_layers, "num_attention_heads": recipe.num_attention_heads,
        "num_key_value_heads": recipe.num_key_value_heads, "head_dim": head_dim,
        "max_position_embeddings": recipe.max_position_embeddings, "tie_word_embeddings": False,
        "eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN], "bos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
    }
    w = recipe.vision_width
    if recipe.arch == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        vision = {"depth": recipe.vision_depth, "embed_dim": w, "num_heads": 2, "mlp_ratio": 2,
                      "hidden_size": recipe.hidden_size, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    elif recipe.arch == "qwen2_5_vl":
        cls = transformers.Qwen2_5_VLConfig
        vision = {"depth": recipe.vision_depth, "hidden_size": w, "intermediate_size": 2 * w, "num_heads": 2,
                      "out_hidden_size": recipe.hidden_size, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [recipe.vision_depth - 1]}
    elif recipe.arch == "qwen3_vl":
        cls = transformers.Qwen3VLConfig
        text["rope_parameters"]["mrope_interleaved"] = True
        vision = {"depth": recipe.vision_depth, "hidden_size": w, "intermediate_size": 2 * w, "num_heads": 2,
                      "out_hidden_size": recipe.hidden_size, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    else:
        raise ValueError(f"unknown VL architecture {recipe.arch!r}; choose one of {', '.join(VL_ARCHS)}")
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=False,
               image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN])  # pyright: ignore[reportCallIssue]  (config kwargs)


def model_class(recipe: VLTinyModelRecipe) -> Any:
    import transformers

    return {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
            "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[recipe.arch]


def make_image_processor(recipe: VLTinyModelRecipe) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch = patch_size(recipe)
    return Qwen2VLImageProcessorPil(size={"shortest_edge": (2 * patch) ** 2, "longest_edge": 224 * 224},
                                    patch_size=patch, temporal_patch_size=2, merge_size=2)


# ------------------------------------------------------------------------------------------- build


def build(out: Path, recipe: VLTinyModelRecipe, say: Progress) -> None:
    """Write the model, tokenizer, image processor and chat template to ``out`` (a fresh directory)."""
    import torch
    from transformers import GenerationConfig


    vl_compat.apply()
    started = time.monotonic()
    say(f"building the VL model {recipe_hash(recipe)} ({recipe.arch}) in {out.parent} ...")
    tokenizer = train_tokenizer(recipe)
    config = make_config(recipe, tokenizer)
    image_processor = make_image_processor(recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.sft_threads)
    try:
        torch.manual_seed(recipe.seed)
        model = model_class(recipe)(config).float()
        data = _SFTData(tokenizer, image_processor, config, recipe)
        warm_start(model, data, recipe, say)
        model.eval()
        accuracy = sample_accuracy(model, data, n=recipe.eval_prompts, seed=recipe.seed + 1)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(eos_token_id=config.text_config.eos_token_id,
                                               pad_token_id=config.text_config.pad_token_id, do_sample=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": VL_CHAT_TEMPLATE}) + "\n")
    path = out / "tokenizer_config.json"
    data_cfg = json.loads(path.read_text())
    data_cfg["chat_template"] = VL_CHAT_TEMPLATE
    path.write_text(json.dumps(data_cfg, indent=2) + "\n")
    elapsed = time.monotonic() - started
    info = {"hash": recipe_hash(recipe), "recipe": dataclasses.asdict(recipe), **accuracy,
            "build_seconds": round(elapsed, 1)}
    (out / RECIPE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    say(f"VL model built in {elapsed:.0f}s: accuracy at temperature 1 = {accuracy['accuracy']:.2f} "
        f"(greedy {accuracy['greedy_accuracy']:.2f})")


def pil_image(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    return image.convert("RGB")


class _SFTData:
    """The task's prompts with their images, processed once per drawn row."""

    def __init__(self, tokenizer: Any, image_processor: Any, config: Any, recipe: VLTinyModelRecipe) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        self.pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        self.image_token = config.image_token_id
        self.rows = load_dataset("shapes", size=512, seed=recipe.seed + 7)  # not the demo's rows (its seed is 42)
        self.colours = list(SHAPE_COLOURS)
        self.answers = {c: tokenizer.encode(c, add_special_tokens=False) + [self.eos] for c in self.colours}

    def prompt(self, row: dict[str, Any]) -> tuple[list[int], Any]:
        """Expanded prompt ids (one pad per merged patch) and the processed image."""
        text = self.tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pixels = self.image_processor(images=[pil_image(row["images"][0])], return_tensors="pt")
        count = int(pixels["image_grid_thw"].prod()) // 4
        at = ids.index(self.image_token)
        return ids[:at] + [self.image_token] * count + ids[at + 1:], pixels

    def batch(self, rng: random.Random, size: int, correct_prob: float) -> dict[str, Any]:
        import torch

        rows = []
        for _ in range(size):
            row = self.rows[rng.randrange(len(self.rows))]
            answer = row["solution"]
            if correct_prob < 1.0 and rng.random() >= correct_prob:
                answer = rng.choice([c for c in self.colours if c != answer])
            ids, pixels = self.prompt(row)
            rows.append((ids, self.answers[answer], pixels))
        width = max(len(p) + len(c) for p, c, _ in rows)
        ids = torch.full((size, width), self.pad, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        labels = torch.full((size, width), -100, dtype=torch.long)
        for i, (p, c, _) in enumerate(rows):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p): len(seq)] = torch.tensor(c)
        return {
            "input_ids": ids, "attention_mask": mask, "labels": labels,
            "pixel_values": torch.cat([px["pixel_values"] for _, _, px in rows]),
            "image_grid_thw": torch.cat([px["image_grid_thw"] for _, _, px in rows]),
            "mm_token_type_ids": (ids == self.image_token).long(),
        }


def warm_start(model: Any, data: _SFTData, recipe: VLTinyModelRecipe, say: Progress) -> list[float]:
    """SFT on the right colour, then calibration on targets right with probability calibrate_correct_prob."""
    return warm_start_loop(model, data.batch, recipe, say, reports=5)


def sample_accuracy(model: Any, data: _SFTData, *, n: int, seed: int) -> dict[str, float]:
    """Accuracy of sampled (temperature 1) and greedy answers on ``n`` task prompts (one at a time)."""
    import torch

    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    right = {"accuracy": 0, "greedy_accuracy": 0}
    with torch.no_grad():
        for _ in range(n):
            row = data.rows[rng.randrange(len(data.rows))]
            ids, pixels = data.prompt(row)
            for key, temperature in (("accuracy", 1.0), ("greedy_accuracy", 0.0)):
                seq = torch.tensor([ids])
                out: list[int] = []
                for _ in range(4):
                    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), use_cache=False,
                                   mm_token_type_ids=(seq == data.image_token).long(), **pixels).logits[0, -1]
                    if temperature > 0:
                        nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
                    else:
                        nxt = int(logits.argmax())
                    out.append(nxt)
                    if nxt == data.eos:
                        break
                    seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
                text = data.tokenizer.decode(out, skip_special_tokens=True)
                right[key] += answer_matches(text, row["solution"])
    return {k: v / n for k, v in right.items()}
