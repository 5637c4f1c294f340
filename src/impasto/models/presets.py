"""Model presets: named builders of SDXL-architecture components.

``tiny`` follows the recipe of diffusers' own SDXL pipeline tests
(``tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py::get_dummy_components``):
the real SDXL wiring (two CLIP encoders, ``text_time`` added conditioning, linear-projection
transformers, an 8x-downsampling VAE) at widths that run on a CPU in milliseconds. Its UNet and
text encoders are randomly initialised; its VAE is the demo VAE shipped in the package, trained
on the demo shapes (:mod:`impasto.vae`, docs/demo-vae.md), so images decode for real.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from diffusers import UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from impasto.models.components import SDXLComponents
from impasto.models.tokenizers import load_clip_tokenizers
from impasto.models.vae_files import load_demo_vae

CLIP_VOCAB_SIZE = 49408
CLIP_BOS_TOKEN_ID = 49406  # "<|startoftext|>"
CLIP_EOS_TOKEN_ID = 49407  # "<|endoftext|>", also tokenizer 1's pad token
TOKENIZER_2_PAD_TOKEN_ID = 0  # "!"
NUM_TIME_IDS = 6  # (orig_h, orig_w, crop_top, crop_left, target_h, target_w)

TINY_TEXT_HIDDEN_SIZE = 32
TINY_PROJECTION_DIM = 32
TINY_ADDITION_TIME_EMBED_DIM = 8
# The demo preset's random text encoders stand in for pretrained ones. At CLIP's default
# initialisation (std 0.02) their prompts differ little (pooled cosine similarity 0.82 on average
# between the demo's colour prompts); 10x larger initial weights make words distinct (0.47), as
# pretrained encoders' are, and the demo learns colours faster (factor 3 helps less, 30
# diverges). Not the tiny default: the larger activations of a *random* UNet turn float
# rounding into visible differences, which the tests against diffusers cannot tolerate.
DEMO_TEXT_INITIALIZER_FACTOR = 10.0


def _tiny_text_config(
    num_hidden_layers: int, pad_token_id: int, hidden_act: str, initializer_factor: float
) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=TINY_TEXT_HIDDEN_SIZE,
        intermediate_size=4 * TINY_TEXT_HIDDEN_SIZE,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act=hidden_act,
        projection_dim=TINY_PROJECTION_DIM,
        bos_token_id=CLIP_BOS_TOKEN_ID,
        eos_token_id=CLIP_EOS_TOKEN_ID,
        pad_token_id=pad_token_id,
        initializer_factor=initializer_factor,
    )


def _tiny_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8,  # latents of 64x64 images
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=2,
        transformer_layers_per_block=1,  # diffusers' dummy has (1, 2); 1 trains 20 % faster
        attention_head_dim=(
            2,
            4,
        ),  # diffusers' name for the number of heads (as SDXL's (5, 10, 20))
        norm_num_groups=8,
        use_linear_projection=True,
        cross_attention_dim=2 * TINY_TEXT_HIDDEN_SIZE,  # D1 + D2
        addition_embed_type="text_time",
        addition_time_embed_dim=TINY_ADDITION_TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=NUM_TIME_IDS * TINY_ADDITION_TIME_EMBED_DIM
        + TINY_PROJECTION_DIM,
    )


def tiny_text_encoders(
    initializer_factor: float = 1.0,
) -> tuple[CLIPTextModel, CLIPTextModelWithProjection]:
    """Tiny random CLIP-L and bigG stand-ins (hidden 32, projection 32), built from the global
    RNG in this order; ``initializer_factor`` scales their initial weights."""
    return (
        CLIPTextModel(_tiny_text_config(2, CLIP_EOS_TOKEN_ID, "quick_gelu", initializer_factor)),
        CLIPTextModelWithProjection(
            _tiny_text_config(3, TOKENIZER_2_PAD_TOKEN_ID, "gelu", initializer_factor)
        ),
    )


def build_tiny(seed: int = 0, text_initializer_factor: float = 1.0) -> SDXLComponents:
    """Tiny SDXL for tests and CPU smoke runs: random UNet and text encoders, trained VAE.

    The random initialisation depends only on ``seed``; the VAE is the shipped demo VAE for
    every seed. ``text_initializer_factor`` scales the text encoders' initial weights (CLIP's
    ``initializer_factor``). The global torch RNG is left as it was.
    """
    vae = load_demo_vae()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = _tiny_unet()
        text_encoder, text_encoder_2 = tiny_text_encoders(text_initializer_factor)
    tokenizer, tokenizer_2 = load_clip_tokenizers()
    for module in (unet, vae, text_encoder, text_encoder_2):
        module.eval()
    return SDXLComponents(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
    )


def build_demo(seed: int = 0) -> SDXLComponents:
    """The CPU demo's model: ``tiny`` with distinct random text encoders (see above)."""
    return build_tiny(seed, text_initializer_factor=DEMO_TEXT_INITIALIZER_FACTOR)


def build_sdxl(seed: int = 0) -> SDXLComponents:
    """SDXL 1.0 base's architecture, randomly initialised (benchmarks; 3.5 B parameters)."""
    from impasto.models.single_file.configs import build_components, sdxl_base_configs

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = build_components(sdxl_base_configs())
    for module in (components.unet, components.vae, components.text_encoder):
        module.eval()
    components.text_encoder_2.eval()
    return components


PRESETS: dict[str, Callable[[int], SDXLComponents]] = {
    "tiny": build_tiny,
    "demo": build_demo,
    "sdxl": build_sdxl,
}


@contextlib.contextmanager
def reusing_preset_builds() -> Iterator[None]:
    """Within the block, each preset is built once per seed; later builds return deep copies.

    ``impasto bench`` builds the same random model for every variant and round: SDXL's 3.5 B
    parameters take over a minute to initialise on a 2-core CPU (the random fill is CPU-bound)
    and a copy a few seconds. The copies are independent (nothing shares storage), and equal to
    a fresh build with the same seed. ``PRESETS`` is restored when the block ends."""
    built: dict[tuple[str, int], SDXLComponents] = {}
    builders = dict(PRESETS)

    def reuse(name: str) -> Callable[[int], SDXLComponents]:
        def build(seed: int) -> SDXLComponents:
            if (name, seed) not in built:
                built[name, seed] = builders[name](seed)
            return copy.deepcopy(built[name, seed])

        return build

    PRESETS.update({name: reuse(name) for name in builders})
    try:
        yield
    finally:
        PRESETS.clear()
        PRESETS.update(builders)


def build_preset(name: str, seed: int = 0) -> SDXLComponents:
    """Build the preset called ``name`` with initialisation seed ``seed``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name](seed)
