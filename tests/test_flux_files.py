"""FLUX.1 from the single files people download, without a diffusers folder (issue #33): the
transformer (``model.flux.transformer``), ``ae.safetensors`` (``model.vae``, Black Forest Labs'
layout), ``clip_l.safetensors`` (``model.flux.text_encoder``) and ``t5xxl_fp16.safetensors``
(``model.flux.text_encoder_2``), each written here from a tiny random network in its original
key layout; loaded, every weight equals the original, the model samples as the original does,
and a wrong file is one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_flux_single_file import to_original

from impasto.config import build_config
from impasto.models.backbone import build_backbone
from impasto.models.encoder_files import file_kind
from impasto.models.flux.components import build_tiny, tiny_clip
from impasto.models.flux.files import load_t5_tokenizer, load_text_files
from impasto.models.flux.options import FluxOptions
from impasto.models.flux.sampling import generate_flux_latents
from impasto.models.single_file.keymap import VAE_PREFIX, _vae_sgm, clip_text_model_key

TEXT_LENGTH = 16


def write(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> Path:
    save_file({k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in state.items()},
              str(path))  # fmt: skip
    return path


def original_files(components: Any, folder: Path, t5_dtype: torch.dtype) -> dict[str, Path]:
    """The four files in their downloads' layouts: BFL's transformer and ``ae``, ComfyUI's
    ``clip_l`` (transformers' names with ``text_model.``), ``t5xxl`` (transformers' names, the
    tied embedding once as ``shared.weight``, as ``save_pretrained`` stores it)."""
    vae = {k.removeprefix(VAE_PREFIX): v for k, v in _vae_sgm(components.vae).items()}
    clip = {clip_text_model_key(k): v for k, v in components.text_encoder.state_dict().items()}
    t5 = dict(components.text_encoder_2.state_dict())
    del t5["encoder.embed_tokens.weight"]
    return {
        "transformer": write(folder / "flux1-dev.safetensors",
                             to_original(components.transformer.state_dict())),
        "vae": write(folder / "ae.safetensors", vae),
        "text_encoder": write(folder / "clip_l.safetensors", clip),
        "text_encoder_2": write(folder / "t5xxl_fp16.safetensors", t5, t5_dtype),
    }  # fmt: skip


def files_config(files: dict[str, Path], **flux: Any) -> Any:
    options = {"text_length": TEXT_LENGTH, "transformer": str(files["transformer"]),
               "text_encoder": str(files["text_encoder"]),
               "text_encoder_2": str(files["text_encoder_2"]), **flux}  # fmt: skip
    raw = {
        "config_version": 1,
        "model": {"family": "flux", "preset": "tiny", "init_seed": 7, "flux": options,
                  "vae": str(files["vae"])},
        "objective": {"prediction_type": "flow"},
        "data": {"path": "synthetic"},
        "train": {"output_dir": "unused", "max_steps": 1},
    }  # fmt: skip
    return build_config(raw)


@pytest.fixture(scope="module")
def original():
    return build_tiny(0, TEXT_LENGTH)


@pytest.mark.parametrize("t5_dtype", [torch.float32, torch.float16])
def test_files_alone_load_every_weight(original, tmp_path, t5_dtype):
    files = original_files(original, tmp_path, t5_dtype)
    backbone = build_backbone(files_config(files))  # init_seed 7: nothing of it survives
    loaded = backbone.components
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert want.keys() == got.keys(), name
        for key, tensor in want.items():
            expected = tensor.to(t5_dtype).float() if name == "text_encoder_2" else tensor
            assert torch.equal(got[key], expected), f"{name}.{key}"
            assert got[key].dtype == torch.float32 and not got[key].is_meta
    shared = loaded.text_encoder_2.shared.weight
    assert loaded.text_encoder_2.encoder.embed_tokens.weight.data_ptr() == shared.data_ptr()


def test_a_model_from_files_samples_as_the_original(original, tmp_path):
    from impasto.models.flux.backbone import FluxBackbone

    backbone = build_backbone(files_config(original_files(original, tmp_path, torch.float32)))
    reference = FluxBackbone(original, FluxOptions(text_length=TEXT_LENGTH))
    call = {"prompts": ["a red circle"], "num_steps": 2, "height": 64, "width": 64, "seed": 1}
    torch.testing.assert_close(
        generate_flux_latents(backbone, **call), generate_flux_latents(reference, **call),
        rtol=0, atol=0,
    )  # fmt: skip


def test_file_kinds_come_from_the_keys(original):
    clip = {clip_text_model_key(k) for k in original.text_encoder.state_dict()}
    assert file_kind(sorted(clip)) == ("clip", "")
    sd3 = sorted(f"text_encoders.clip_l.transformer.{k}" for k in clip)
    assert file_kind(sd3) == ("clip", "text_encoders.clip_l.transformer.")
    assert file_kind(sorted(original.text_encoder_2.state_dict())) == ("t5", "")
    assert file_kind(["first_stage_model.encoder.down.0.block.0.conv1.weight"])[0] == (
        "a VAE (original layout)"
    )
    assert file_kind(["double_blocks.0.img_attn.qkv.weight"])[0] == "a FLUX transformer"


def test_wrong_files_are_one_line(original, tmp_path):
    files = original_files(original, tmp_path, torch.float32)
    swapped = files | {"text_encoder_2": files["text_encoder"]}
    with pytest.raises(ValueError, match=r"^model.flux.text_encoder_2 .*clip_l.safetensors: a "
                       r"CLIP text encoder, but model.flux.text_encoder_2 takes a "
                       r"T5EncoderModel \(32 wide, 2 layers\); check the file$"):  # fmt: skip
        build_backbone(files_config(swapped))
    with pytest.raises(ValueError, match=r"^model.flux.text_encoder .*ae.safetensors: a VAE "):
        build_backbone(files_config(files | {"text_encoder": files["vae"]}))
    wider = tiny_clip().state_dict()
    wider["embeddings.token_embedding.weight"] = torch.zeros(49408, 48)
    path = write(tmp_path / "clip_g.safetensors", wider)
    with pytest.raises(ValueError, match=r"token_embedding.weight has shape \(49408, 48\), "
                       r"CLIPTextModel \(32 wide, 2 layers\) takes \(49408, 32\)"):  # fmt: skip
        build_backbone(files_config(files | {"text_encoder": path}))
    with pytest.raises(ValueError, match=r"^model.flux.text_encoder .*: does not exist"):
        build_backbone(files_config(files | {"text_encoder": tmp_path / "none.safetensors"}))


def test_t5s_tokenizer_comes_from_a_folder(original, tmp_path):
    original.tokenizer_2.save_pretrained(str(tmp_path / "tokenizer_2"))
    tokenizer = load_t5_tokenizer(tmp_path / "tokenizer_2", 9)
    prompt = "a red circle"
    assert tokenizer(prompt, padding="max_length", max_length=9).input_ids == (
        original.tokenizer_2(prompt, padding="max_length", max_length=9).input_ids
    )
    assert tokenizer.model_max_length == 9
    with pytest.raises(ValueError, match=r"^model.flux.tokenizer_2 .*: not a folder"):
        load_t5_tokenizer(tmp_path / "missing", 9)
    files = original_files(original, tmp_path, torch.float32)
    options = FluxOptions(text_encoder_2=str(files["text_encoder_2"]))
    model = SimpleNamespace(path=None, preset="dev")  # a full-size preset: a real vocabulary
    with pytest.raises(ValueError, match=r"^model.flux.tokenizer_2: not set; "):
        load_text_files(build_tiny(0, TEXT_LENGTH), model, options)
