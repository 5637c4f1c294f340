"""The DiT conditioned by one transformers text encoder from a folder (issue #31): a tiny T5
(and tiny CLIPs) built in code and saved with a tokenizer, then read by ``model.text_encoder``
(docs/dit.md, "Text encoders")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from impasto.cli import main
from impasto.config import build_config
from impasto.data.demo import DEMO_BACKGROUNDS, DEMO_COLORS, DEMO_SHAPES
from impasto.models import build_backbone
from impasto.models.tokenizers import TOKENIZER_PAD_TOKEN, load_clip_tokenizer
from impasto.train.trainer import train

T5_WIDTH = 24  # d_model: unlike the tiny CLIPs' 32, so a wrong width shows


def _t5_tokenizer(max_length: int = 512) -> PreTrainedTokenizerFast:
    """A word-level stand-in for T5's SentencePiece tokenizer: pad 0, eos 1 appended, unk 2."""
    words = ["<pad>", "</s>", "<unk>", "a", "on", *DEMO_COLORS, *DEMO_SHAPES, *DEMO_BACKGROUNDS]
    vocab = {word: index for index, word in enumerate(dict.fromkeys(words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_length,
    )  # fmt: skip


def _t5_folder(path: Path, layout: str = "transformers", seed: int = 0) -> Path:
    """A tiny random T5 encoder and its tokenizer, saved in one folder (``transformers``) or
    as text_encoder/ + tokenizer/ (``diffusers``)."""
    tokenizer = _t5_tokenizer()
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer), d_model=T5_WIDTH, d_kv=6, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
    )  # fmt: skip
    encoder = T5EncoderModel(config)
    model_dir = path / "text_encoder" if layout == "diffusers" else path
    tokenizer_dir = path / "tokenizer" if layout == "diffusers" else path
    encoder.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    return path


def _clip_folder(path: Path, projection: bool) -> Path:
    """A tiny random CLIP text encoder (with a 16-wide projection or none) and the bundled CLIP
    tokenizer, as text_encoder/ + tokenizer/."""
    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=16,
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    )  # fmt: skip
    model_class = CLIPTextModelWithProjection if projection else CLIPTextModel
    model_class(config).save_pretrained(path / "text_encoder")
    load_clip_tokenizer(TOKENIZER_PAD_TOKEN).save_pretrained(path / "tokenizer")
    return path


def _raw(tiny_raw, folder: Path | None, **dit) -> dict:
    tiny_raw["model"] = {"family": "dit", "preset": "tiny", "dit": {"block": "cross", **dit}}
    if folder is not None:
        tiny_raw["model"]["text_encoder"] = str(folder)
    tiny_raw["objective"] = {"prediction_type": "flow"}
    return tiny_raw


def _perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Move every weight off its (partly zero) init, so every layer reaches the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


def test_a_t5_folder_gives_its_last_hidden_state_with_zero_padding(tiny_raw, tmp_path):
    folder = _t5_folder(tmp_path / "t5")
    backbone = build_backbone(build_config(_raw(tiny_raw, folder, text_length=12)))
    components = backbone.components
    assert list(backbone.parts()) == ["transformer", "text_encoder"]
    config = components.transformer.config
    assert (config.text_dim, config.pooled_dim) == (T5_WIDTH, T5_WIDTH)
    prompts = ["a red circle on a white background", ""]
    with torch.no_grad():
        embeds = backbone.encode_text(prompts)
        assert embeds.prompt_embeds.shape == (2, 12, T5_WIDTH)
        encoder, tokenizer = components.text_encoder, components.tokenizer
        for row, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt").input_ids  # unpadded: eos only for ""
            length = ids.shape[1]
            direct = encoder(input_ids=ids).last_hidden_state[0]
            # the prompt's tokens are the encoder's, whatever the padding (it sees the mask)
            torch.testing.assert_close(embeds.prompt_embeds[row, :length], direct)
            assert torch.equal(
                embeds.prompt_embeds[row, length:], torch.zeros(12 - length, T5_WIDTH)
            )
            torch.testing.assert_close(embeds.pooled_prompt_embeds[row], direct.mean(dim=0))
    # the prompt reaches the prediction; the zero padding carries nothing of the prompt
    _perturb(components.transformer)
    x_t, timesteps = torch.randn(2, 4, 8, 8), torch.tensor([500.0, 500.0])
    condition = backbone.sampling_condition(prompts, 64, 64)
    with torch.no_grad():
        prediction = backbone.forward(x_t, timesteps, condition)
    assert (prediction[0] - prediction[1]).abs().max() > 1e-4


@pytest.mark.parametrize("projection", [False, True])
def test_a_clip_folder_in_the_diffusers_layout_pools_as_the_model_does(
    tiny_raw, tmp_path, projection
):
    folder = _clip_folder(tmp_path / "clip", projection)
    backbone = build_backbone(build_config(_raw(tiny_raw, folder)))
    components = backbone.components
    assert components.tokenizer.model_max_length == 77  # its own length, under the 256 cap
    assert components.transformer.config.pooled_dim == (16 if projection else 32)
    with torch.no_grad():
        embeds = backbone.encode_text(["a blue square"])
        tokens = components.tokenizer(
            ["a blue square"], padding="max_length", max_length=77, return_tensors="pt"
        )
        output = components.text_encoder(**tokens)
    pooled = output.text_embeds if projection else output.pooler_output
    torch.testing.assert_close(embeds.pooled_prompt_embeds, pooled)
    real = int(tokens.attention_mask.sum())
    torch.testing.assert_close(embeds.prompt_embeds[0, :real], output.last_hidden_state[0, :real])
    assert not embeds.prompt_embeds[0, real:].any()


def test_gradients_reach_the_transformer_and_the_t5_through_a_step(tiny_raw, tmp_path):
    folder = _t5_folder(tmp_path / "t5", layout="diffusers")
    backbone = build_backbone(build_config(_raw(tiny_raw, folder, text_length=16)))
    transformer, encoder = backbone.components.transformer, backbone.components.text_encoder
    _perturb(transformer)
    encoder.requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    x_0, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8)
    t = torch.tensor([0.3, 0.8])
    x_t = (1 - t)[:, None, None, None] * x_0 + t[:, None, None, None] * noise
    text = backbone.encode_text(["a red circle", "a green triangle on a black background"])
    condition = backbone.condition(text, batch=None)
    loss = torch.nn.functional.mse_loss(backbone.forward(x_t, t * 1000, condition), noise - x_0)
    loss.backward()
    assert torch.isfinite(loss)
    silent = [name for name, p in transformer.named_parameters() if not p.grad.abs().sum() > 0]
    assert silent == []
    assert encoder.encoder.block[-1].layer[0].SelfAttention.q.weight.grad.abs().sum() > 0


def test_a_t5_run_trains_a_lora_on_the_encoder(tiny_raw, tmp_path):
    folder = _t5_folder(tmp_path / "t5")
    raw = _raw(tiny_raw, folder, text_length=16)
    raw["train"]["max_steps"] = 3
    raw["checkpoint"]["every_steps"] = 3
    raw["parts"] = {"transformer": "full", "text_encoder": "lora"}
    raw["lora"] = {"rank": 4, "targets": "attention"}
    result = train(build_config(raw))
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]
    assert len(losses) == 3 and all(np.isfinite(losses))
    adapters = load_file(str(result.last_checkpoint / "text_encoder.safetensors"))
    layers = {key.split(".lora_")[0].rsplit(".", 1)[1] for key in adapters}
    assert layers == {"q", "k", "v", "o"}  # T5's attention projections
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)
    start = build_backbone(build_config(raw)).denoiser().state_dict()
    trained = load_file(str(result.last_checkpoint / "transformer.safetensors"))
    assert any(not torch.equal(start[key], trained[key]) for key in start)


def test_a_t5_dit_exports_and_samples_back_exactly(tiny_raw, tmp_path):
    """With the text cache on, 300 tokens (over the 256 default cap: kept as saved)."""
    folder = _t5_folder(tmp_path / "t5")
    raw = _raw(tiny_raw, folder, text_length=300)
    raw["train"]["max_steps"] = 2
    raw["checkpoint"]["every_steps"] = 2
    raw["optim"]["lr"] = 1e-2
    raw["cache"] = {"text_embeddings": "disk", "dir": str(tmp_path / "cache")}
    run = train(build_config(raw)).run_dir
    out = tmp_path / "exported"
    assert main(["export", str(run), "--format", "folder", "--out", str(out),
                 "--dtype", "fp32"]) == 0  # fmt: skip
    assert (out / "text_encoder" / "config.json").is_file() and (out / "tokenizer").is_dir()
    assert not (out / "text_encoder_2").exists()
    flags = ["--prompt", "a red circle", "--steps", "2", "--cfg", "3", "--seed", "1"]
    images = []
    for source in (run, out):
        target = tmp_path / f"samples-{len(images)}"
        assert main(["sample", str(source), *flags, "--out", str(target)]) == 0
        with Image.open(next(target.iterdir())) as image:
            images.append(np.asarray(image))
    assert np.array_equal(images[0], images[1])
    loaded = build_backbone(build_config({**raw, "model": {"family": "dit", "path": str(out)}}))
    assert list(loaded.parts()) == ["transformer", "text_encoder"]
    assert loaded.components.tokenizer.model_max_length == 300
    original = build_backbone(build_config(raw)).components.text_encoder.state_dict()
    got = loaded.components.text_encoder.state_dict()
    assert all(torch.equal(original[key], got[key]) for key in original)


def test_the_text_cache_keys_on_the_encoder_and_its_length(tiny_raw, tmp_path):
    from impasto.data.cache_fill import encoder_fingerprint

    def key(folder: Path, length: int) -> str:
        raw = _raw(dict(tiny_raw), folder, text_length=length)
        return encoder_fingerprint(build_backbone(build_config(raw)), "text")

    first, other = _t5_folder(tmp_path / "a"), _t5_folder(tmp_path / "b", seed=1)
    assert key(first, 12) == key(first, 12)
    assert len({key(first, 12), key(first, 13), key(other, 12)}) == 3


def test_an_sdxl_folder_still_gives_sdxl_conditioning(tiny_raw, tmp_path):
    from impasto.models.components import encode_prompts
    from impasto.models.presets import tiny_text_encoders
    from impasto.models.tokenizers import load_clip_tokenizers

    folder = tmp_path / "sdxl"
    for name, part in zip(
        ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
        (*tiny_text_encoders(), *load_clip_tokenizers()),
        strict=True,
    ):
        part.save_pretrained(folder / name)
    backbone = build_backbone(build_config(_raw(tiny_raw, folder)))
    assert list(backbone.parts()) == ["transformer", "text_encoder", "text_encoder_2"]
    assert backbone.components.transformer.config.text_dim == 64
    with torch.no_grad():
        got = backbone.encode_text(["a red circle"])
        want = encode_prompts(backbone.components, ["a red circle"])
    assert torch.equal(got.prompt_embeds, want.prompt_embeds)


def _error(raw: dict) -> str:
    with pytest.raises(ValueError) as caught:
        build_backbone(build_config(raw))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_bad_text_folder_is_a_one_line_error(tiny_raw, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no text encoder there; point it at a folder holding one" in _error(
        _raw(tiny_raw, empty)
    )
    no_weights = tmp_path / "no-weights"
    _t5_tokenizer().save_pretrained(no_weights)
    (no_weights / "config.json").write_text("{}")
    assert "no model.safetensors; save the text encoder" in _error(_raw(tiny_raw, no_weights))
    no_tokenizer = _t5_folder(tmp_path / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    assert "no tokenizer files; save the encoder" in _error(_raw(tiny_raw, no_tokenizer))
    clip = _clip_folder(tmp_path / "clip", projection=False)
    assert "at most 77" in _error(_raw(tiny_raw, clip, text_length=100))
    assert "SDXL's CLIP pair encodes 77 tokens" in _error(_raw(tiny_raw, None, text_length=100))
    raw = _raw(tiny_raw, clip)
    raw["parts"] = {"text_encoder_2": "full"}
    assert "parts.text_encoder_2: this DiT has one text encoder" in _error(raw)
