"""Load an SDXL base single-file checkpoint (SGM / A1111 / ComfyUI layout) as diffusers modules.

The file is checked before any tensor is read: its kind from the safetensors header
(:func:`detect_checkpoint`), then every tensor name and shape against the SGM names of the
target modules (:func:`sgm_state_dict` on parameter-less modules). The weights are then renamed
by diffusers' own converters (``diffusers.loaders.single_file_utils``) and assigned to modules
built from the shipped SDXL configs, or from the configs impasto stored in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
from diffusers.loaders.single_file_utils import (
    convert_ldm_clip_checkpoint,
    convert_ldm_unet_checkpoint,
    convert_ldm_vae_checkpoint,
    convert_open_clip_checkpoint,
)
from torch import Tensor

from impasto.models.components import SDXLComponents
from impasto.models.single_file.configs import (
    CONFIGS_METADATA_KEY,
    ComponentConfigs,
    build_components,
    sdxl_base_configs,
)
from impasto.models.single_file.detect import REFUSED_KINDS, SDXL_BASE, detect_checkpoint
from impasto.models.single_file.file_errors import check_file, open_tensor_file
from impasto.models.single_file.keymap import (
    CLIP_G_PREFIX,
    CLIP_L_PREFIX,
    OPTIONAL_KEYS,
    UNET_PREFIX,
    VAE_PREFIX,
    sgm_state_dict,
)

SETTING = "model.path"
SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth")
EXPECTED_FILE = "expected an SDXL base single-file checkpoint (.safetensors)"
WHOLE_MODEL = "a single file must hold the whole SDXL model (UNet, VAE and both text encoders)"
SDXL_COMPONENTS = (
    ("UNet", UNET_PREFIX),
    ("VAE", VAE_PREFIX),
    ("text encoder 1 (CLIP ViT-L)", CLIP_L_PREFIX),
    ("text encoder 2 (OpenCLIP ViT-bigG)", CLIP_G_PREFIX),
)


def _error(path: Path, problem: str) -> ValueError:
    return ValueError(f"{SETTING} {path}: {problem}")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


@dataclass(frozen=True)
class _Checkpoint:
    """An open checkpoint: tensor shapes and metadata at once, tensors on demand."""

    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]
    get_tensor: Callable[[str], Tensor]


@contextmanager
def _open_safetensors(path: Path) -> Iterator[_Checkpoint]:
    # Plain reads, not safe_open's memory map: the pages of a 7 GB file would stay in the
    # process's resident memory beside the fp32 tensors made from them (issue #17). Missing,
    # unreadable, not safetensors, truncated, corrupt: each its own line (issue #29).
    with open_tensor_file(path, SETTING) as handle:
        yield _Checkpoint(dict(handle.shapes), dict(handle.metadata), handle.read)


def _load_pickle(path: Path, allow_pickle: bool) -> _Checkpoint:
    if not allow_pickle:
        raise _error(
            path,
            "is a pickle checkpoint, which can run code when loaded; set model.allow_pickle: true "
            "to read a pickle checkpoint (only from a trusted source), or convert it to "
            ".safetensors",
        )
    try:
        # weights_only: tensors and plain containers only, no arbitrary objects (DESIGN §6).
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise _error(
            path,
            f"torch.load(weights_only=True) cannot read it ({_first_line(err)}); if it is "
            "corrupt re-download it, else convert it to .safetensors with a tool you trust",
        ) from err
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # Lightning / SGM training checkpoints wrap the weights
    if not isinstance(loaded, dict):
        raise _error(path, f"holds a {type(loaded).__name__}, not a state dict; {EXPECTED_FILE}")
    tensors = {key: value for key, value in loaded.items() if isinstance(value, Tensor)}
    shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
    return _Checkpoint(shapes, {}, tensors.__getitem__)


@contextmanager
def _open_checkpoint(path: Path, allow_pickle: bool) -> Iterator[_Checkpoint]:
    check_file(path, SETTING, EXPECTED_FILE.removeprefix("expected "))
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        with _open_safetensors(path) as checkpoint:
            yield checkpoint
    elif suffix in PICKLE_SUFFIXES:
        yield _load_pickle(path, allow_pickle)
    else:
        raise _error(
            path,
            f"unsupported file type {suffix or '(no suffix)'!r}; {EXPECTED_FILE}, or .ckpt / .pt "
            "with model.allow_pickle: true",
        )


def flux_advice(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What to do with a FLUX file given as an SDXL checkpoint: the family, its variant (the
    guidance embedding's keys), and what else the family needs."""
    from impasto.models.flux.single_file import FOLDER_PARTS, transformer_variant

    variant = transformer_variant(shapes) or "dev or schnell"
    return (
        f"is a Flux checkpoint (a FLUX.1-{variant} transformer), and impasto trains SDXL base "
        "from SDXL files: set model.family: flux, model.path to a diffusers FLUX.1 folder "
        f"({FOLDER_PARTS}) and model.flux.transformer to this file"
    )


def sd3_advice(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What to do with an SD3 file given as an SDXL checkpoint: the family, its release
    (SD3.5 Large or Medium, from the keys), and what else the family needs."""
    from impasto.models.sd3.single_file import FOLDER_PARTS, RELEASES, transformer_variant

    release = RELEASES.get(transformer_variant(shapes) or "unknown", "SD3")
    return (
        f"is a Stable Diffusion 3 checkpoint (an {release} transformer), and impasto trains "
        "SDXL base from SDXL files: set model.family: sd3, model.path to a diffusers SD3.5 "
        f"folder ({FOLDER_PARTS}) and model.sd3.transformer to this file"
    )


def _check_kind(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
    kind = detect_checkpoint(shapes)
    if kind == "flux":
        raise _error(path, flux_advice(shapes))
    if kind == "sd3":
        raise _error(path, sd3_advice(shapes))
    if kind in REFUSED_KINDS:
        raise _error(
            path,
            f"is {REFUSED_KINDS[kind]}; impasto trains SDXL base: use an SDXL base checkpoint "
            "or a fine-tune of it",
        )
    if kind != SDXL_BASE:
        roots = sorted({key.split(".")[0][:40] for key in shapes})[:4]
        raise _error(
            path,
            f"is not a Stable Diffusion checkpoint impasto knows (top-level names: "
            f"{', '.join(roots) or 'none'}); {EXPECTED_FILE}",
        )
    for component, prefix in SDXL_COMPONENTS:
        if not any(key.startswith(prefix) for key in shapes):
            raise _error(path, f"has no {component} (no {prefix}* tensors); {WHOLE_MODEL}")


def _same_shape(key: str, found: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    # Some converters store the VAE attention projections as Linear [C, C], not Conv [C, C, 1, 1].
    vae_attention = key.startswith(VAE_PREFIX) and ".mid.attn_1." in key
    return found == expected or (vae_attention and found == expected[:2])


def _check_tensors(
    path: Path, shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise on the first missing tensor, else on the first one with an unexpected shape."""
    required = [key for key in expected if key not in OPTIONAL_KEYS]
    missing = [key for key in required if key not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _error(
            path,
            f"missing tensor {missing[0]}{more}; the file is incomplete or not an SDXL base "
            "checkpoint: re-download or re-export it",
        )
    for key in required:
        if not _same_shape(key, shapes[key], expected[key]):
            raise _error(
                path,
                f"tensor {key} has shape {list(shapes[key])}, expected {list(expected[key])}; "
                "the file is not an SDXL base checkpoint (or is a variant impasto cannot train)",
            )


def _configs(path: Path, metadata: Mapping[str, str]) -> ComponentConfigs:
    if CONFIGS_METADATA_KEY not in metadata:
        return sdxl_base_configs()
    try:
        return ComponentConfigs.from_json(metadata[CONFIGS_METADATA_KEY])
    except ValueError as err:
        raise _error(path, f"{err}; re-export the file") from err


def read_configs(path: str | Path) -> ComponentConfigs:
    """The architecture :func:`load_single_file` builds for ``path``, from its header alone: the
    configs impasto stored in it, else SDXL 1.0 base's (a pickle, or a file from elsewhere)."""
    path = Path(path)
    if path.suffix.lower() != SAFETENSORS_SUFFIX:
        return sdxl_base_configs()
    with _open_safetensors(path) as checkpoint:
        return _configs(path, checkpoint.metadata)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers on the CPU.

    The loaded tensors are then assigned (``load_state_dict(assign=True)``) rather than copied
    into random ones: one copy of the weights in memory and no initialisation time. Buffers
    stay real since non-persistent ones (CLIP's ``position_ids``) are not in the file. This is
    accelerate's ``init_empty_weights(include_buffers=False)``, which impasto does not depend on.
    """
    register_parameter = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Tensor | None) -> None:
        register_parameter(module, name, param)
        if param is not None:
            meta = module._parameters[name].to("meta")
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter


def _assign(path: Path, module: torch.nn.Module, converted: Mapping[str, Tensor]) -> None:
    """Assign ``converted`` to ``module``'s parameters, adding or dropping ``text_model.``."""
    state = {}
    for key in module.state_dict():
        tensor = converted.get(key, converted.get(f"text_model.{key}"))
        if tensor is None:
            raise _error(path, f"no tensor converts to {type(module).__name__}.{key}")
        state[key] = tensor
    module.load_state_dict(state, strict=True, assign=True)
    module.eval()
    tensors = chain(module.named_parameters(), module.named_buffers())
    left_on_meta = [name for name, tensor in tensors if tensor.is_meta]
    if left_on_meta:
        raise RuntimeError(f"{type(module).__name__}.{left_on_meta[0]} was not loaded")


def _to_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


NETWORK_PREFIXES = {
    "unet": UNET_PREFIX,
    "vae": VAE_PREFIX,
    "text_encoder": CLIP_L_PREFIX,
    "text_encoder_2": CLIP_G_PREFIX,
}


def _convert(
    path: Path, components: SDXLComponents, name: str, tensors: Mapping[str, Tensor]
) -> None:
    """Rename the SGM tensors of network ``name`` with diffusers' converter and assign them."""
    module = getattr(components, name)
    if name == "unet":
        converted = convert_ldm_unet_checkpoint(tensors, module.config)
    elif name == "vae":
        converted = convert_ldm_vae_checkpoint(tensors, module.config)
    elif name == "text_encoder":
        converted = convert_ldm_clip_checkpoint(tensors)
    else:
        converted = convert_open_clip_checkpoint(module, tensors, prefix=CLIP_G_PREFIX)
    _assign(path, module, converted)


def load_single_file(
    path: str | Path,
    *,
    allow_pickle: bool = False,
    configs: ComponentConfigs | None = None,
    networks: tuple[str, ...] = tuple(NETWORK_PREFIXES),
    dtype: torch.dtype = torch.float32,
) -> SDXLComponents:
    """Load the SDXL base single-file checkpoint ``path`` as diffusers/transformers modules in
    ``dtype`` (float32, as training needs; an export may read a network in its own dtype).

    ``.safetensors`` is read lazily (header first); ``.ckpt`` / ``.pt`` / ``.pth`` only with
    ``allow_pickle=True``, through ``torch.load(weights_only=True)``. The architecture is
    ``configs`` if given, else the one :func:`save_single_file` stored in the file's metadata,
    else SDXL 1.0 base's. Tokenizers are impasto's bundled CLIP tokenizers. Every problem
    (missing or unreadable file, another model family, a missing component or tensor, a wrong
    shape) raises a one-line ``ValueError`` naming the file. ``networks``: read only these
    (``unet``, ``vae``, ``text_encoder``, ``text_encoder_2``); the others keep their parameters
    on the meta device, so that an export can load one network at a time.
    """
    path = Path(path)
    prefixes = tuple(NETWORK_PREFIXES[name] for name in networks)
    with _open_checkpoint(path, allow_pickle) as checkpoint:
        _check_kind(path, checkpoint.shapes)
        configs = configs or _configs(path, checkpoint.metadata)
        with parameters_on_meta():
            components = build_components(configs)
        expected = {key: tuple(t.shape) for key, t in sgm_state_dict(components).items()}
        _check_tensors(path, checkpoint.shapes, expected)
        tensors = {
            key: _to_dtype(checkpoint.get_tensor(key), dtype)
            for key in expected
            if key.startswith(prefixes) and key in checkpoint.shapes and key not in OPTIONAL_KEYS
        }
    for name in networks:
        _convert(path, components, name, tensors)
    return components
