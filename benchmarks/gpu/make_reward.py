"""Write a randomly initialised CLIPModel folder with PickScore v1's architecture (OpenCLIP
ViT-H/14: what ``configs/sdxl-draftp.yaml`` scores with), for timing the DRaFT+ step where the
real weights cannot be downloaded (the lent GPU reaches no network). The scores are
meaningless; the time and memory of scoring are PickScore's.

    python benchmarks/gpu/make_reward.py OUT_DIR [--tiny]

``--tiny``: a 2-layer CLIP of the same layout (the CPU dry run of ``run.sh``).
"""

from __future__ import annotations

import argparse
import json
from importlib.resources import as_file, files
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTokenizer, CLIPVisionConfig

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def pickscore_config(tiny: bool) -> CLIPConfig:
    """PickScore v1 (yuvalkirstain/PickScore_v1, fine-tuned laion/CLIP-ViT-H-14): text 24 x 1024,
    vision 32 x 1280 at 224 px in 14 px patches, projection 1024."""
    text = CLIPTextConfig(
        hidden_size=32 if tiny else 1024,
        intermediate_size=64 if tiny else 4096,
        num_hidden_layers=2 if tiny else 24,
        num_attention_heads=2 if tiny else 16,
        hidden_act="gelu",
    )
    vision = CLIPVisionConfig(
        hidden_size=32 if tiny else 1280,
        intermediate_size=64 if tiny else 5120,
        num_hidden_layers=2 if tiny else 32,
        num_attention_heads=2 if tiny else 16,
        image_size=224,
        patch_size=14,
        hidden_act="gelu",
    )
    config = CLIPConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        projection_dim=32 if tiny else 1024,
        logit_scale_init_value=4.6052,  # PickScore's trained scale: ln(100)
    )
    return config


def write_reward_folder(out: Path, tiny: bool) -> Path:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not a minute of CPU
        model = CLIPModel(pickscore_config(tiny))
    model.save_pretrained(out)
    with as_file(files("impasto") / "assets" / "clip") as clip_dir:
        tokenizer = CLIPTokenizer(str(clip_dir / "vocab.json"), str(clip_dir / "merges.txt"))
    tokenizer.save_pretrained(out)
    preprocessor = {
        "crop_size": {"height": 224, "width": 224},
        "size": {"shortest_edge": 224},
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "resample": 3,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    folder = write_reward_folder(args.out, args.tiny)
    print(f"wrote a random PickScore-shaped CLIPModel to {folder}")


if __name__ == "__main__":
    main()
