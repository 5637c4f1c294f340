"""CLIP rewards from local Hugging Face ``CLIPModel`` folders: ``clip_score`` (PickScore v1,
OpenAI or LAION CLIP) and ``aesthetic`` (the LAION improved-aesthetic-predictor).

``clip_score`` is r = exp(logit_scale) · cos(image embedding, text embedding) per row: PickScore's
README (Kirstain et al. 2023, arXiv:2305.01569, ``model.logit_scale.exp() * (image_embs @
text_embs.T)`` after L2 normalisation) and NeMo-Aligner's ``PickscoreRewardModel.get_reward``.
``aesthetic`` is the MLP of github.com/christophschuhmann/improved-aesthetic-predictor
(``simple_inference.py``) on L2-normalised CLIP ViT-L/14 image embeddings. Both are frozen,
in eval mode, and differentiable in the images (pixels are preprocessed in torch,
:mod:`impasto.rewards.preprocess`).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import AutoTokenizer, CLIPModel

from impasto.rewards import register_reward
from impasto.rewards.preprocess import ClipPreprocess, clip_preprocess, read_clip_preprocess

if TYPE_CHECKING:
    from impasto.config.draftp import RewardConfig

REWARD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PICKSCORE_HINT = (
    "download PickScore with `huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir "
    "DIR` on a machine with internet and copy it here (docs/draftp.md)"
)
VIT_L14_HINT = (
    "download CLIP ViT-L/14 with `huggingface-cli download openai/clip-vit-large-patch14 "
    "--local-dir DIR` on a machine with internet and copy it here (docs/draftp.md)"
)
HEAD_HINT = (
    "download sac+logos+ava1-l14-linearMSE.pth from "
    "github.com/christophschuhmann/improved-aesthetic-predictor and set reward.head to it "
    "(docs/draftp.md)"
)
CLIP_SCORE_OPTIONS = {"text_cache_size": 1024}
"""clip_score's ``reward.options`` and defaults: prompts whose text embeddings are kept."""


def clip_folder(path: str | None, hint: str) -> Path:
    """``reward.path`` as a checked Hugging Face ``CLIPModel`` folder (config.json with
    ``model_type: clip``), else a one-line ``ValueError`` ending in ``hint``."""
    if not path:
        raise ValueError(f"reward.path is unset; set it to a local CLIPModel folder: {hint}")
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ValueError(f"reward.path: {folder} does not exist; {hint}")
    if not folder.is_dir():
        raise ValueError(f"reward.path: {folder} is a file, not a folder; {hint}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"reward.path: {folder} is not a CLIPModel folder (no config.json); {hint}"
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"reward.path: {config_file} is unreadable ({error}); {hint}") from None
    if model_type != "clip":
        raise ValueError(
            f"reward.path: {folder} holds a {model_type!r} model, not a CLIPModel "
            f"(model_type 'clip'); {hint}"
        )
    return folder


def load_clip_model(folder: Path, hint: str) -> CLIPModel:
    """The frozen, eval-mode fp32 ``CLIPModel`` in ``folder`` (on the CPU; local files only)."""
    try:
        model = CLIPModel.from_pretrained(str(folder), local_files_only=True)
    except OSError as error:  # no or broken weights file
        message = str(error).splitlines()[0]
        raise ValueError(
            f"reward.path: {folder} has no readable weights ({message}); {hint}"
        ) from None
    return model.requires_grad_(False).eval()


def reward_options(config: RewardConfig, defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` updated by ``reward.options``; an unknown key is a one-line error."""
    unknown = sorted(set(config.options) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "none"
        raise ValueError(
            f"reward.options: unknown {unknown} for kind {config.kind}; valid: {valid}"
        )
    return {**defaults, **config.options}


class ClipImageEncoder(nn.Module):
    """Images ``[B, 3, H, W]`` in [0, 1] → L2-normalised CLIP image embeddings ``[B, D]``
    float32: torch preprocessing, the vision tower's pooled output, ``visual_projection``."""

    def __init__(self, model: CLIPModel, preprocess: ClipPreprocess) -> None:
        super().__init__()
        self.vision_model = model.vision_model
        self.visual_projection = model.visual_projection
        self.preprocess = preprocess

    @property
    def embedding_dim(self) -> int:
        return self.visual_projection.out_features

    def forward(self, images: Tensor) -> Tensor:
        weight = self.visual_projection.weight
        pixels = clip_preprocess(images, self.preprocess).to(weight.device, weight.dtype)
        pooled = self.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.visual_projection(pooled).float(), dim=-1)


class ClipScoreReward(nn.Module):
    """r = exp(logit_scale) · cos(image, text) per (image, prompt) row: ``[B]`` float32.

    Text embeddings are computed without gradients (the model is frozen; gradients flow to
    the images only) and the last ``text_cache_size`` prompts' are kept: training repeats
    prompts. Embeddings made under ``torch.inference_mode`` are not kept, since inference
    tensors cannot join a later autograd graph.
    """

    def __init__(
        self,
        model: CLIPModel,
        tokenizer: Any,
        preprocess: ClipPreprocess,
        text_cache_size: int,
    ) -> None:
        super().__init__()
        self.image_encoder = ClipImageEncoder(model, preprocess)
        self.text_model = model.text_model
        self.text_projection = model.text_projection
        self.tokenizer = tokenizer
        self.max_length = min(
            model.config.text_config.max_position_embeddings, tokenizer.model_max_length
        )
        # A Python float, read before any cast to bf16 (exp(bf16(log 100)) is 98.9, not 100).
        self.logit_scale_exp = math.exp(float(model.logit_scale))
        self.text_cache_size = text_cache_size
        self._text_cache: OrderedDict[str, Tensor] = OrderedDict()

    @torch.no_grad()
    def encode_text(self, prompts: list[str]) -> Tensor:
        """L2-normalised text embeddings ``[N, D]`` float32 of ``prompts``, padded and
        truncated to the model's maximum length (77 for CLIP)."""
        device = self.text_projection.weight.device
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        pooled = self.text_model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
        ).pooler_output
        return F.normalize(self.text_projection(pooled).float(), dim=-1)

    def text_embeddings(self, prompts: list[str]) -> Tensor:
        """``[B, D]`` text embeddings of ``prompts``, from the cache where possible."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._text_cache]
        found = dict(zip(missing, self.encode_text(missing), strict=True)) if missing else {}
        for prompt in prompts:
            if prompt in self._text_cache:
                self._text_cache.move_to_end(prompt)
                found[prompt] = self._text_cache[prompt]
        if self.text_cache_size > 0 and not torch.is_inference_mode_enabled():
            for prompt in missing:
                self._text_cache[prompt] = found[prompt]
            while len(self._text_cache) > self.text_cache_size:
                self._text_cache.popitem(last=False)
        return torch.stack([found[p] for p in prompts])

    def forward(self, images: Tensor, prompts: list[str]) -> Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"clip_score got {images.shape[0]} images but {len(prompts)} prompts")
        image_embeds = self.image_encoder(images)
        text_embeds = self.text_embeddings(list(prompts))
        return self.logit_scale_exp * (image_embeds * text_embeds).sum(dim=-1)

    def embed(self, images: Tensor) -> Tensor:
        return self.image_encoder(images)


def aesthetic_mlp(input_size: int) -> nn.Sequential:
    """The improved-aesthetic-predictor MLP (``simple_inference.py``: no activations, as
    released); keys ``0.weight`` … ``7.bias`` (``layers.`` in the released state dict)."""
    return nn.Sequential(
        nn.Linear(input_size, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )


def read_head_state_dict(path: str | None) -> dict[str, Tensor]:
    """The tensors of ``reward.head`` (.safetensors, or .pth/.pt read with
    ``weights_only=True``), keys without any ``layers.`` prefix."""
    if not path:
        raise ValueError(f"reward.head is unset; {HEAD_HINT}")
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(f"reward.head: {file} does not exist; {HEAD_HINT}")
    if file.is_dir():
        raise ValueError(f"reward.head: {file} is a folder, not a file; {HEAD_HINT}")
    try:
        if file.suffix == ".safetensors":
            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except PermissionError:
        raise ValueError(
            f"reward.head: {file}: cannot read it (permission denied); check its permissions"
        ) from None
    except Exception as error:  # noqa: BLE001  (pickle, zip and safetensors errors differ)
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"reward.head: {file} is unreadable ({message}); {HEAD_HINT}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning checkpoint of the MLP
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"reward.head: {file} holds no state dict of tensors; {HEAD_HINT}")
    return {key.split("layers.", 1)[-1]: value for key, value in state.items()}


def load_aesthetic_head(path: str | None, embedding_dim: int) -> nn.Sequential:
    """The frozen, eval-mode fp32 aesthetic MLP of ``reward.head`` for ``embedding_dim``-d
    CLIP embeddings; a file of another shape is a one-line error."""
    state = read_head_state_dict(path)
    first = state.get("0.weight")
    input_size = first.shape[-1] if first is not None and first.ndim == 2 else embedding_dim
    expected = {key: value.shape for key, value in aesthetic_mlp(input_size).state_dict().items()}
    found = {key: value.shape for key, value in state.items()}
    if found != expected:
        wrong = sorted({key for key, _ in set(expected.items()) ^ set(found.items())})
        raise ValueError(
            f"reward.head: {path} is not the improved-aesthetic-predictor MLP "
            f"(mismatched {wrong[:3]}); {HEAD_HINT}"
        )
    if input_size != embedding_dim:
        raise ValueError(
            f"reward.head: its MLP takes {input_size}-d embeddings but the CLIP at reward.path "
            f"projects to {embedding_dim}; use the CLIP the head was trained on (ViT-L/14: 768)"
        )
    head = aesthetic_mlp(input_size)
    head.load_state_dict({key: value.float() for key, value in state.items()})
    return head.requires_grad_(False).eval()


class AestheticReward(nn.Module):
    """The LAION aesthetic score (about 1–10) of each image ``[B]`` float32; prompts ignored.

    The head stays fp32 with bf16 CLIP weights: it is 0.9M parameters, and bf16 would round
    scores near 6 to steps of 0.03.
    """

    def __init__(self, image_encoder: ClipImageEncoder, head: nn.Sequential) -> None:
        super().__init__()
        self.image_encoder = image_encoder
        self.head = head

    def forward(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.head(self.image_encoder(images)).squeeze(-1)

    def embed(self, images: Tensor) -> Tensor:
        return self.image_encoder(images)


def _tokenizer(folder: Path) -> Any:
    """The tokenizer saved beside the model in ``folder`` (local files only)."""
    if not (folder / "tokenizer.json").is_file() and not (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    ):
        raise ValueError(
            f"reward.path: {folder} has no tokenizer (tokenizer.json, or vocab.json and "
            f"merges.txt); {PICKSCORE_HINT}"
        )
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _preprocess(model: CLIPModel, folder: Path) -> ClipPreprocess:
    """The pixel preprocessing of the model in ``folder``, errors prefixed by the config key."""
    try:
        return read_clip_preprocess(folder, model.config.vision_config.image_size)
    except ValueError as error:
        raise ValueError(f"reward.path: {error}") from None


@register_reward("clip_score")
def build_clip_score(config: RewardConfig, device: torch.device) -> ClipScoreReward:
    """PickScore-style CLIP score from the ``CLIPModel`` folder ``reward.path``."""
    options = reward_options(config, CLIP_SCORE_OPTIONS)
    folder = clip_folder(config.path, PICKSCORE_HINT)
    tokenizer = _tokenizer(folder)
    model = load_clip_model(folder, PICKSCORE_HINT)
    preprocess = _preprocess(model, folder)
    reward = ClipScoreReward(model, tokenizer, preprocess, int(options["text_cache_size"]))
    reward.to(device=device, dtype=REWARD_DTYPES[config.dtype])
    return reward.requires_grad_(False).eval()


@register_reward("aesthetic")
def build_aesthetic(config: RewardConfig, device: torch.device) -> AestheticReward:
    """The LAION improved-aesthetic-predictor: the MLP ``reward.head`` on the CLIP ViT-L/14
    image embeddings of ``reward.path`` (only its vision tower is kept)."""
    reward_options(config, {})
    folder = clip_folder(config.path, VIT_L14_HINT)
    model = load_clip_model(folder, VIT_L14_HINT)
    image_encoder = ClipImageEncoder(model, _preprocess(model, folder))
    head = load_aesthetic_head(config.head, image_encoder.embedding_dim)
    image_encoder.to(dtype=REWARD_DTYPES[config.dtype])
    return AestheticReward(image_encoder, head).to(device).requires_grad_(False).eval()


__all__ = [
    "AestheticReward",
    "ClipImageEncoder",
    "ClipScoreReward",
    "aesthetic_mlp",
    "build_aesthetic",
    "build_clip_score",
    "clip_folder",
    "load_aesthetic_head",
    "load_clip_model",
    "read_head_state_dict",
]
