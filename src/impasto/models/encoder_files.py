"""Text encoders from the single files people download beside a transformer file (issue #33):
``clip_l.safetensors`` (CLIP-L), ``clip_g.safetensors`` (OpenCLIP bigG), ``t5xxl_fp16`` /
``t5xxl_fp8_e4m3fn`` (T5-XXL) and ``umt5_xxl_fp16`` (umT5-XXL), loaded into a family's
architecture (``model.path``'s or a preset's, built on the meta device when every network
comes from a file).

What a file is comes from its keys, with any prefix a whole checkpoint puts before them
(``text_encoders.clip_l.transformer.``, ``conditioner.embedders.1.model.`` ...):

- ``clip``: transformers' CLIP text model (``text_model.encoder.layers.0.self_attn.q_proj``,
  ComfyUI's and Stability's files), with or without the ``text_model.`` level;
- ``open_clip``: OpenCLIP's own text tower (``transformer.resblocks.0.attn.in_proj_weight``),
  renamed by diffusers' ``convert_open_clip_checkpoint``;
- ``t5``: transformers' T5 / umT5 encoder (``encoder.block.0.layer.0.SelfAttention.q``);
- ``vae`` and ``transformer``: another network's file, named in the error.

The tensors are read one at a time into float32 and must fill the architecture exactly (every
tensor, each shape); a wrong file is one line naming the setting, what the file is and what the
setting takes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
from torch import Tensor, nn

from impasto.models.single_file.file_errors import open_tensor_file
from impasto.models.transformer_families import first_line

MARKERS: dict[str, re.Pattern[str]] = {
    "clip": re.compile(r"^(.*?)(text_model\.)?encoder\.layers\.0\.self_attn\.q_proj\.weight$"),
    "open_clip": re.compile(r"^(.*?)transformer\.resblocks\.0\.attn\.in_proj_weight$"),
    "t5": re.compile(r"^(.*?)encoder\.block\.0\.layer\.0\.SelfAttention\.q\.weight$"),
}
"""File kind → the pattern of one key every such file has (group 1: the file's prefix)."""

OTHER_NETWORKS: dict[str, str] = {
    "encoder.down.0.block.0.conv1.weight": "a VAE (original layout)",
    "encoder.down_blocks.0.resnets.0.conv1.weight": "a VAE (diffusers layout)",
    "encoder.downsamples.0.residual.0.gamma": "a Wan VAE",
    "double_blocks.0.img_attn.qkv.weight": "a FLUX transformer",
    "joint_blocks.0.x_block.attn.qkv.weight": "an SD3 transformer",
    "blocks.0.self_attn.q.weight": "a Wan transformer",
    "blocks.0.attn.q.weight": "umT5 in Wan-AI's own layout (use ComfyUI's umt5_xxl_fp16)",
}
"""A key fragment of another network's file → what to call it in the error."""

IGNORED = re.compile(
    r"(^|\.)(position_ids|logit_scale|lm_head\.weight)$|^decoder\.|^text_projection\."
)
"""Tensors a file may hold that the encoder does not read: buffers, heads (T5's decoder and LM
head, CLIP's logit scale), CLIP-L's projection where the family takes the pooled state."""

KIND_NAMES = {
    "clip": "a CLIP text encoder",
    "open_clip": "an OpenCLIP text encoder",
    "t5": "a T5 encoder",
    "unknown": "not a CLIP, OpenCLIP or T5 text encoder",
}

ENCODER_KINDS = {"CLIPTextModel": ("clip", "open_clip"),
                 "CLIPTextModelWithProjection": ("clip", "open_clip"),
                 "T5EncoderModel": ("t5",), "UMT5EncoderModel": ("t5",)}  # fmt: skip
"""transformers class → the file kinds that load into it."""


def file_kind(keys: list[str], prefer: str = "") -> tuple[str, str]:
    """(kind, prefix) of a file with ``keys``; kind ``unknown`` or another network's name. In
    a whole checkpoint holding several encoders, the one whose prefix starts with ``prefer``
    (``text_encoders.clip_g.``) is taken."""
    found = [
        (kind, match.group(1))
        for kind, pattern in MARKERS.items()
        for match in map(pattern.match, keys)
        if match
    ]
    preferred = [entry for entry in found if prefer and entry[1].startswith(prefer)]
    if preferred or found:
        return (preferred or found)[0]
    for fragment, name in OTHER_NETWORKS.items():
        if any(key.endswith(fragment) for key in keys):
            return name, ""
    return "unknown", ""


def describe(module: nn.Module) -> str:
    """``CLIPTextModel (768 wide, 12 layers)``: what a setting takes."""
    config = module.config
    width = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
    return f"{type(module).__name__} ({width} wide, {layers} layers)"


def _module_key(key: str, expected: dict[str, Tensor]) -> str:
    """``key`` with or without CLIP's ``text_model.`` level, as ``expected`` names it
    (transformers 5 dropped it from ``CLIPTextModel``; files and 4.x keep it)."""
    if key in expected:
        return key
    bare = key.removeprefix("text_model.")
    return bare if bare in expected else f"text_model.{key}"


def _converted(kind: str, prefix: str, names: list[str], read, module: nn.Module) -> dict:
    """The file's tensors under the module's names (float32)."""
    if kind == "open_clip":
        tensors = {name: read(name) for name in names if name.startswith(prefix)}
        state = convert_open_clip_checkpoint(module, tensors, prefix=prefix)
    else:
        state = {name[len(prefix) :]: read(name) for name in names if name.startswith(prefix)}
    expected = module.state_dict()
    return {_module_key(key, expected): value for key, value in state.items()}


def _check(label: str, state: dict[str, Tensor], module: nn.Module, what: str) -> dict:
    expected = module.state_dict()
    if "shared.weight" in expected:  # T5: the embedding is stored once, under either name
        for one, other in (("shared.weight", "encoder.embed_tokens.weight"),) * 2:
            state.setdefault(one, state.get(other))
            state.setdefault(other, state.get(one))
    state = {key: value for key, value in state.items() if value is not None}
    for key, tensor in expected.items():
        found = state.get(key)
        if found is not None and tuple(found.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{label}: {key} has shape {tuple(found.shape)}, {what} takes "
                f"{tuple(tensor.shape)}; is it another encoder's file?"
            )
    missing = [key for key in expected if key not in state and not key.endswith("position_ids")]
    extra = [key for key in state if key not in expected and not IGNORED.search(key)]
    if missing or extra:
        problem = f"{len(missing)} tensors missing (e.g. {missing[0]})" if missing else ""
        problem = problem or f"{len(extra)} tensors {what} lacks (e.g. {extra[0]})"
        raise ValueError(f"{label}: {problem}; is it another encoder's file?")
    return {key: state[key] for key in expected if key in state}


def load_encoder_file(
    path: str | Path, setting: str, module: nn.Module, prefer: str = ""
) -> nn.Module:
    """Load the text encoder file ``path`` (module docstring) into ``module`` (its parameters may
    be on the meta device), float32, eval mode; ``setting`` names it in errors, ``prefer`` picks
    the encoder of a whole checkpoint (:func:`file_kind`)."""
    path = Path(path)
    label = f"{setting} {path}"
    what = describe(module)
    with open_tensor_file(path, setting) as file:
        names = file.keys()
        kind, prefix = file_kind(names, prefer)
        takes = ENCODER_KINDS[type(module).__name__]
        if kind not in takes:
            found = KIND_NAMES.get(kind, kind)
            raise ValueError(f"{label}: {found}, but {setting} takes a {what}; check the file")
        if any(name.endswith(".scale_weight") for name in names):
            raise ValueError(
                f"{label}: a scaled-fp8 file (ComfyUI's *_scaled); use the fp16 or plain "
                "fp8_e4m3fn file"
            )
        state = _converted(kind, prefix, names, lambda name: file.read(name).float(), module)
    state = _check(label, state, module, what)
    module.load_state_dict(state, strict=False, assign=True)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    tensors = [*module.named_parameters(), *module.named_buffers()]
    left = [name for name, tensor in tensors if tensor.is_meta]
    if left:  # a module built with its buffers on meta too (not parameters_on_meta)
        raise ValueError(f"{label}: {left[0]} was not restored; report this as a bug")
    return module.float().eval()


def load_text_files(components: Any, options: Any, family: str, parts: Mapping[str, str]) -> None:
    """Each text encoder of ``parts`` (the part → the prefix it has in a whole checkpoint) whose
    setting ``model.<family>.<part>`` names a file, loaded into ``components`` in place."""
    for part, prefer in parts.items():
        path = getattr(options, part)
        if path is not None:
            module = getattr(components, part)
            setting = f"model.{family}.{part}"
            setattr(components, part, load_encoder_file(path, setting, module, prefer))


def load_tokenizer_folder(
    path: str | Path, setting: str, tokenizer_class: Any, text_length: int, release: str
) -> Any:
    """A tokenizer from the folder ``path`` (``setting``), padding to ``text_length`` tokens;
    ``release`` says where the folder comes from (``tokenizer_2/ of a FLUX.1 release``)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{setting} {root}: not a folder; set it to {release}")
    try:
        tokenizer = tokenizer_class.from_pretrained(str(root), local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{setting} {root}: cannot load it as a tokenizer ({first_line(error)}); copy "
            f"{release} there"
        ) from None
    tokenizer.model_max_length = text_length
    return tokenizer
