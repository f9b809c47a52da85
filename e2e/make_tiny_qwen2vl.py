"""Writes a tiny random-weight Qwen2-VL that `vllm serve` can load, with no model hub.

    python e2e/make_tiny_qwen2vl.py --out build/serve_test/tiny-qwen2vl

What it writes (all made here, from fixed seeds, so two runs give the same model):

* ``config.json`` + ``model.safetensors``: ``Qwen2VLForConditionalGeneration`` with random
  weights, two text layers (hidden 128, 2 query and 2 key/value heads of 64: one of each per
  rank at TP=2, a head size the CPU attention backend takes) and one vision block (embed 64,
  2 heads); ``--heads 4`` doubles the widths for TP=4 (the two-node serve test); mrope
  sections [8, 12, 12] (half the head size, as Qwen2-VL's [16, 24, 24] is for
  128); float32 (this CPU has no bf16 instructions).
* ``tokenizer.json`` & co.: a byte-level BPE trained here with ``tokenizers`` on generated
  text, holding Qwen2-VL's special tokens (``<|im_start|>``, ``<|image_pad|>``, ...) and a
  Qwen2-VL-style chat template; the config's token ids point at them, and the model's vocabulary
  is exactly the tokenizer's (no id the tokenizer cannot decode).
* ``preprocessor_config.json`` (Qwen2-VL image processor): ``max_pixels`` = ``MAX_PIXELS``
  (1344 x 1344), so the test images keep their size (a 1024 x 1024 image becomes 1036 x 1036,
  the next multiple of 28) instead of being shrunk to the default 1280 * 28 * 28.

Skips the work when ``--out`` already holds a model made by this exact file (a hash of it is
recorded there), unless ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys

#: Largest image the processor keeps at full size (pixels); the serve test's images fit.
MAX_PIXELS = 1344 * 1344
MIN_PIXELS = 56 * 56
SEED = 1234

# Qwen2-VL's special tokens, in its order.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's template, reduced to what the test sends: string or list content, images and
# videos as vision_start/pad/vision_end, a generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an image picture photo shows describe what is in this of and with on to red green "
    "blue yellow black white grey square circle line stripe pattern noise colour color left "
    "right top bottom middle large small bright dark tensor arena shared memory worker engine "
    "request token model vision language assistant user system hello world please answer "
    "question yes no one two three four five six seven eight nine ten"
).split()


def _corpus(n_lines: int, rng: random.Random) -> list[str]:
    """Generated sentences (no data set is reachable): words, digits and punctuation."""
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10_000)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(out: str):
    """Trains a byte-level BPE with Qwen2-VL's special tokens; returns the fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=768,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is a token: any text encodes, any id decodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=8192,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(out: str, tok, heads: int = 2) -> dict:
    """Random-weight Qwen2-VL pointing at ``tok``'s special tokens; returns its config.
    ``heads``: query (and key/value) heads of 64 in the text layers and heads of 32 in the
    vision block, so that the tensor-parallel size may be up to ``heads``."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tok)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 64 * heads,
            "intermediate_size": 128 * heads,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 8192,
            "max_window_layers": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [8, 12, 12],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32 * heads,
            "hidden_size": 64 * heads,
            "mlp_ratio": 2,
            "num_heads": heads,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    return {"vocab_size": vocab, "parameters": n_params, "special_token_ids": ids}


def build_processor(out: str, tok) -> None:
    """The Qwen2-VL processor (image processor with ``max_pixels`` = MAX_PIXELS)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    improc = Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(size=size)
    except ImportError:
        video = None
    proc = Qwen2VLProcessor(
        image_processor=improc, tokenizer=tok, video_processor=video, chat_template=CHAT_TEMPLATE
    )
    proc.save_pretrained(out)


def self_check(out: str) -> dict:
    """Loads what was written as vLLM will (Auto classes) and runs one image through the
    processor: the prompt must expand to the image's tokens and the grid must be unshrunk."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(out)
    proc = AutoProcessor.from_pretrained(out)
    img = Image.fromarray(np.zeros((1024, 1024, 3), dtype=np.uint8))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
    enc = proc(text=[prompt], images=[img], return_tensors="pt")
    t, h, w = (int(x) for x in enc["image_grid_thw"][0])
    n_image_tokens = int((enc["input_ids"] == cfg.image_token_id).sum())
    if (h * 14, w * 14) != (1036, 1036) or n_image_tokens != t * h * w // 4:
        raise SystemExit(
            f"make_tiny_qwen2vl: self-check failed: grid {(t, h, w)}, "
            f"{n_image_tokens} image tokens in the prompt"
        )
    return {"grid_thw_1024": [t, h, w], "image_tokens_1024": n_image_tokens}


def _this_file_hash() -> str:
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> int:
    """Builds the model directory (or keeps the one there if this file made it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="model directory to write")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument(
        "--heads",
        type=int,
        default=2,
        help="attention heads (text and vision): the largest tensor-parallel size it serves",
    )
    args = ap.parse_args()
    if args.heads < 1:
        ap.error("--heads must be at least 1")
    stamp = os.path.join(args.out, ".made_by_sha256")
    want = _this_file_hash() + ("" if args.heads == 2 else f" heads={args.heads}")
    if not args.force and os.path.exists(stamp) and open(stamp).read().strip() == want:
        print(f"make_tiny_qwen2vl: {args.out} is up to date")
        return 0
    tmp = args.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok = build_tokenizer(tmp)
    info = build_model(tmp, tok, args.heads)
    build_processor(tmp, tok)
    info.update(self_check(tmp))
    with open(os.path.join(tmp, "serve_test_model_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    with open(os.path.join(tmp, ".made_by_sha256"), "w") as f:
        f.write(want + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp, args.out)
    print(
        f"make_tiny_qwen2vl: wrote {args.out} ({info['parameters']:,} parameters, vocabulary "
        f"{info['vocab_size']}, a 1024x1024 image -> grid {info['grid_thw_1024']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
