"""Full-model exports one network at a time, for machines with less memory than the model
(issue #17).

Rebuilding a whole SDXL run in fp32 (:func:`~impasto.checkpoint.trained.load_trained`) holds
14 GB before anything is written (2.6 B UNet, 0.8 B text-encoder and 0.08 B VAE parameters).
When the run's base model is one impasto can read a network at a time from (a ``.safetensors``
single file or a diffusers folder), the full-model exports instead build each network alone,
the largest first: its base weights in fp32, the checkpoint's weights copied over a fully
trained part, the run's adapters loaded and merged; then cast it in place to the export dtype
before building the next. The peak is the fp32 UNet plus the fp16 rest, and the result equals
the whole-model path's bit for bit (the same loads, merges and casts, in another order).

Other runs (a preset, another run's checkpoint as ``model.path``, a pickle, a sharded
checkpoint, LoHa/LoKr adapters) and the ``ema`` / ``merge_lora`` options take the whole-model
path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import peft
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from impasto.checkpoint.sharded import is_sharded
from impasto.checkpoint.trained import copy_from_file, is_run_checkpoint, read_weights
from impasto.config import Config
from impasto.export.lora import adapter_parts
from impasto.models import SDXLComponents, load_clip_tokenizers
from impasto.models.io import TRANSFORMERS_DTYPE_KWARG, load_component, load_tokenizer
from impasto.models.parts import ADAPTER_NAME, Part, load_part, peft_config
from impasto.models.single_file import load_single_file
from impasto.models.single_file.file_errors import open_tensor_file
from impasto.models.single_file.load import parameters_on_meta
from impasto.models.tokenizers import TOKENIZER_2_PAD_TOKEN, TOKENIZER_PAD_TOKEN
from impasto.models.vae_swap import load_vae

NETWORKS_LARGEST_FIRST = ("unet", "text_encoder_2", "text_encoder", "vae")
_DIFFUSERS_CLASSES = {
    "unet": UNet2DConditionModel,
    "vae": AutoencoderKL,
    "text_encoder": CLIPTextModel,
    "text_encoder_2": CLIPTextModelWithProjection,
}
_MERGEABLE_KINDS = ("lora", "dora")  # adapters found from their lora_A / lora_B names


def loads_by_network(checkpoint: Path, config: Config, ema: bool, merge_lora: bool) -> bool:
    """Whether :func:`load_by_network` can rebuild the run of ``checkpoint``."""
    if ema or merge_lora or config.model.path is None or is_sharded(checkpoint):
        return False
    if adapter_parts(config) and config.lora.kind not in _MERGEABLE_KINDS:
        return False
    path = Path(config.model.path)
    if is_run_checkpoint(path):
        return False
    return path.suffix.lower() == ".safetensors" or (path / "model_index.json").is_file()


def _diffusers_model(root: Path, name: str, dtype: torch.dtype) -> nn.Module | None:
    """The UNet or VAE of a diffusers folder in ``dtype``, its weights read with plain reads (see
    :class:`~impasto.models.single_file.TensorFile`: ``from_pretrained`` maps the file, whose
    pages then count beside the fp32 copy); None when the folder's weights are not one file
    under the module's own names (sharded, or an older layout ``from_pretrained`` converts)."""
    model_class = _DIFFUSERS_CLASSES[name]
    weights = root / name / "diffusion_pytorch_model.safetensors"
    if not weights.is_file():
        return None
    with parameters_on_meta():
        module = model_class.from_config(model_class.load_config(root / name))
    label = f"model.path {root}: {name}/{weights.name}"  # unreadable, truncated: say which
    with open_tensor_file(weights, "model.path", label) as handle:
        if set(handle.keys()) != set(module.state_dict()):
            return None
        state = {key: handle.read(key).to(dtype) for key in handle.keys()}  # noqa: SIM118
    module.load_state_dict(state, strict=True, assign=True)
    module.register_to_config(_name_or_path=str(root))  # as from_pretrained records it
    return module


def _base_network(path: Path, name: str, dtype: torch.dtype) -> nn.Module:
    """Network ``name`` of the base model at ``path``, alone, in ``dtype`` (fp32: as
    ``load_model`` loads it for training); a diffusers folder's text encoders in fp32."""
    if not path.is_dir():
        return getattr(load_single_file(path, networks=(name,), dtype=dtype), name)
    module = _diffusers_model(path, name, dtype) if name in ("unet", "vae") else None
    if module is None:  # fp32: transformers records the dtype it loads in in the config
        kwarg = "torch_dtype" if name in ("unet", "vae") else TRANSFORMERS_DTYPE_KWARG
        module = load_component(_DIFFUSERS_CLASSES[name], path, name, **{kwarg: torch.float32})
    return module


def _merged_adapters(config: Config, checkpoint: Path, name: str, module: nn.Module) -> None:
    """Inject the run's adapters into ``module`` (the layers the checkpoint holds weights for,
    as ``prepare_parts`` chose them), load them and merge them into the weights."""
    state = read_weights(checkpoint, {name}).get(name)
    if state is None:
        raise ValueError(
            f"checkpoint {checkpoint}: no {name}.safetensors; it was not written by this run"
        )
    targets = sorted({key.partition(".lora_")[0] for key in state})
    peft.inject_adapter_in_model(peft_config(config.lora, targets), module, ADAPTER_NAME)
    part = Part(name, module, config.lora.kind, lr=0.0)
    try:
        load_part(part, state)
    except ValueError as error:
        raise ValueError(f"checkpoint {checkpoint}: {error}") from None
    _merge_in_place(module)


def _merge_in_place(module: nn.Module) -> None:
    """``merge_adapters`` without peft's safe merge, which adds each delta to a copy of the
    weight and keeps the copy: the freed originals fragment the heap by gigabytes on SDXL.
    The arithmetic is the same (``W += delta``); the finiteness check is done here."""
    for name, child in list(module.named_modules()):
        if isinstance(child, BaseTunerLayer):
            child.merge(safe_merge=False)
            base = child.get_base_layer()
            if not torch.isfinite(base.weight).all():
                raise ValueError(f"export: merging the adapter of {name} gave non-finite weights")
            parent_name, _, attribute = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attribute, base)


def _network(config: Config, checkpoint: Path, name: str, dtype: torch.dtype) -> nn.Module:
    """Network ``name`` as the run trained it, adapters merged, in ``dtype``.

    Only a network with adapters is built in fp32 (the merge adds the deltas at the precision
    the run trained in); a frozen one is read in ``dtype``, and a fully trained one too, its
    base weights then overwritten by the checkpoint's, cast as they are read. Casting a value
    once or through fp32 gives the same bits.
    """
    mode = config.parts.mode(name) if name != "vae" else "frozen"
    module = _base_network(
        Path(config.model.path), name, torch.float32 if mode == "lora" else dtype
    )
    if mode == "full":
        part = Part(name, module, mode, lr=0.0)
        copy_from_file(part, checkpoint / f"{name}.safetensors", f"checkpoint {checkpoint}")
    elif mode == "lora":
        _merged_adapters(config, checkpoint, name, module)
    elif name == "vae" and config.model.vae is not None:
        module = load_vae(config.model.vae, module)
    return module.to(dtype).requires_grad_(False).eval()  # in place, tensor by tensor


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``): the fp32 copies
    a network was built in are freed by then, but most SDXL tensors are smaller than glibc's
    mmap threshold, so their memory stays in the heap, resident, until trimmed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load_by_network(checkpoint: Path, config: Config, dtype: torch.dtype) -> SDXLComponents:
    """The run's model with its adapters merged, every network in ``dtype``, built one network
    at a time (see the module docstring); check :func:`loads_by_network` first."""
    networks = {}
    for name in NETWORKS_LARGEST_FIRST:
        networks[name] = _network(config, checkpoint, name, dtype)
        _return_freed_memory()
    base = Path(config.model.path)
    if base.is_dir():
        tokenizers = (
            load_tokenizer(base, "tokenizer", TOKENIZER_PAD_TOKEN),
            load_tokenizer(base, "tokenizer_2", TOKENIZER_2_PAD_TOKEN),
        )
    else:
        tokenizers = load_clip_tokenizers()
    return SDXLComponents(**networks, tokenizer=tokenizers[0], tokenizer_2=tokenizers[1])
