"""A content-addressed, on-disk cache of VAE posteriors and text-encoder outputs.

An entry's key is a hash of everything its value depends on, so a changed input can never
return a stale value, and an unchanged one is never encoded twice:

- latents: the image's content (sha256 of its bytes), the VAE's weights fingerprint and dtype,
  and every transform parameter (original size, resize, crop offsets, flip, target size,
  filter); the value is the posterior's mean and std (training draws the latent, as on the fly);
  a video run's: the clip's content (a video's bytes, a frame folder's frames), its decoded
  frame indices and the same, the value ``[z, t, h, w]`` (:mod:`impasto.data.video.clip_cache`);
- text: the caption text after the caption tools, and the fingerprint of both text encoders,
  both tokenizers and the precision they ran in; the value is SDXL's prompt embeddings and the
  pooled embedding.

Layout of the cache folder (``cache.dir``)::

    shards/latents-<stamp>-r<rank>-<uuid>.safetensors   "<key>.mean", "<key>.std"
    shards/text-<stamp>-r<rank>-<uuid>.safetensors      "<key>.embeds", "<key>.pooled"
    shards/<shard>.verified                             the shard was whole at this size and mtime
    shards/<shard>.corrupt                              a damaged shard, set aside
    images/ids-<stamp>-r<rank>-<uuid>.jsonl              content ids by file stat

Shards are immutable: written to a hidden temporary file, flushed to disk, then renamed into
place, so a crash leaves no half-written shard under a shard's name, and any number of ranks can
read them while others add new ones. Every entry carries a crc32 (the shard's metadata): a fill
checks each shard it does not know to be whole, and sets a damaged one (truncated, overwritten
in place, rotten) aside as ``*.corrupt`` so that its entries are encoded again; training checks
each entry it reads and skips, and reports, one that does not match (a text embedding is
encoded on the fly instead, and reported as re-encoded), for the next fill to re-encode
(:mod:`impasto.data.cache_shards` tells the whole story).

Hashing every image at every start would read the whole dataset, so content ids are memoised
by ``(path, size, mtime_ns)`` (a record read through a ``blob`` by the blob's identity): a file
that changes gets a new id, hence new keys.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor

from impasto.data.buckets import BucketCrop
from impasto.data.cache_shards import (
    SHARD_ERRORS,
    DamagedEntry,
    ShardStore,
    stamped_name,
    write_atomically,
)
from impasto.data.cache_shards import ShardWriter as ShardWriter  # re-exported
from impasto.data.folder import ImageRecord
from impasto.data.skips import error_reason
from impasto.data.video.content import clip_sha256, clip_stat_identity

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
"""Part of every key: raise it when what an entry means changes."""

REENCODED = "re-encoded on the fly (the image is still trained on)"
"""What training does with a damaged cached text embedding."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def fingerprint(*parts: torch.nn.Module | object) -> str:
    """sha256 of modules' weights (name, dtype, shape, bytes) and of other parts' ``repr``."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.nn.Module):
            for name, tensor in sorted(part.state_dict().items()):
                tensor = tensor.detach().cpu().contiguous()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """What a CLIP tokenizer's output depends on: vocabulary, merges, length and pad token."""
    vocab = sorted(tokenizer.get_vocab().items())
    merges = getattr(tokenizer, "bpe_ranks", {})
    settings = (tokenizer.model_max_length, tokenizer.pad_token, tokenizer.__class__.__name__)
    return fingerprint(vocab, sorted(merges.items()), settings)


def _hash(*parts: object) -> str:
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:40]


@dataclass(frozen=True)
class ImageId:
    """An image's content hash (sha256 of its file bytes) and its ``(height, width)``."""

    sha256: str
    height: int
    width: int


def latent_key(image: ImageId, params: BucketCrop, vae_fingerprint: str, dtype: str) -> str:
    """The key of one image's posterior under one transform."""
    return _hash(
        "latents", CACHE_VERSION, image.sha256, vae_fingerprint, dtype, params.original_size,
        params.resize_to, params.crop_top_left, params.target_size, params.flip, params.resample,
    )  # fmt: skip


def clip_latent_key(
    clip: ImageId, frames: Sequence[int], params: BucketCrop, vae_fingerprint: str, dtype: str
) -> str:
    """The key of one clip sample's posterior: the clip's content, its decoded frame indices
    (an image in a video run: ``(0,)``) and one transform of every frame."""
    return _hash(
        "clip-latents", CACHE_VERSION, clip.sha256, tuple(frames), vae_fingerprint, dtype,
        params.original_size, params.resize_to, params.crop_top_left, params.target_size,
        params.flip, params.resample,
    )  # fmt: skip


def text_key(caption: str, text_fingerprint: str, dtype: str) -> str:
    """The key of one caption's SDXL text conditioning."""
    return _hash("text", CACHE_VERSION, text_fingerprint, dtype, caption)


def record_identity(record: ImageRecord) -> str:
    """What says a record's bytes are unchanged: the file's stat; for a blob, its identity
    (file, offset, row ...) plus the stat of the local shard, Parquet file or dataset folder it
    reads from (a remote shard is trusted to stay the same); for a video or frame folder, its
    size and time or its listing (:func:`~impasto.data.video.content.clip_stat_identity`)."""
    if record.blob is None and record.clip is not None:
        return clip_stat_identity(record)
    if record.blob is None:
        return f"file|{_stat(record.image_path)}"
    container = getattr(record.blob, "path", None)
    return f"blob|{record.blob!r}|{'' if container is None else _container_stat(container)}"


@functools.lru_cache(maxsize=1024)
def _container_stat(path: str) -> str:
    """The stat of a shard or Parquet file, or of a dataset folder's files; once per process."""
    folder = Path(path)
    if not folder.is_dir():
        return _stat(folder)
    return "|".join(_stat(child) for child in sorted(folder.rglob("*")) if child.is_file())


def _stat(path: str | Path) -> str:
    path = Path(path)
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def compute_image_id(record: ImageRecord) -> ImageId:
    """Read the image's bytes: their sha256, and the size from the header (a clip record:
    the hash of its frames, :func:`~impasto.data.video.content.clip_sha256`, and the probed
    size).

    Raises the errors of :data:`~impasto.data.transforms.IMAGE_LOAD_ERRORS` when unreadable.
    """
    if record.clip is not None:
        info = record.clip.info
        return ImageId(clip_sha256(record), info.height, info.width)
    data = record.read_bytes()
    if not data:
        raise ValueError("zero-size file")
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImageId(hashlib.sha256(data).hexdigest(), height, width)


class ImageIds:
    """Memoised content ids of images (``images/*.jsonl`` in the cache folder)."""

    def __init__(self, root: Path) -> None:
        self.folder = Path(root) / "images"
        self.known: dict[str, ImageId] = {}
        self.new: dict[str, ImageId] = {}
        for path in sorted(self.folder.glob("ids-*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.known[row["identity"]] = ImageId(
                        row["sha256"], row["height"], row["width"]
                    )
                except (json.JSONDecodeError, KeyError, TypeError):
                    logger.warning("cache: ignoring a bad line in %s", path)

    def lookup(self, record: ImageRecord) -> ImageId | None:
        """The record's id if it was computed before (the file unchanged since), else None."""
        try:
            identity = record_identity(record)
        except OSError:
            return None
        return self.known.get(identity) or self.new.get(identity)

    def compute(self, record: ImageRecord) -> ImageId:
        """Compute (and remember) the record's id; raises when the image is unreadable."""
        identity = record_identity(record)
        image_id = compute_image_id(record)
        self.new[identity] = image_id
        return image_id

    def save(self, rank: int) -> None:
        """Write the ids computed since loading (one new file per call)."""
        if not self.new:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        lines = [
            json.dumps({"identity": identity, **image_id.__dict__})
            for identity, image_id in self.new.items()
        ]
        path = self.folder / stamped_name("ids", rank, ".jsonl")
        write_atomically(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
        self.known.update(self.new)
        self.new = {}


@dataclass
class CachedEncodings:
    """What a dataset needs to read encodings from the cache.

    Attributes:
        store: the shards.
        image_ids: each record's content id (None: unreadable when the cache was filled).
        vae_fingerprint: set when latents are cached.
        text_fingerprint: set when text embeddings are cached.
        dtype: the storage dtype name.
        caption_variants: with text cached and random caption tools, epoch ``e`` uses variant
            ``e % caption_variants`` of each caption (the variants the fill encoded).
        latent_channels: the VAE's latent channels (to catch mismatched entries).
        downsample: the VAE's spatial downsampling (8 for SDXL).
        temporal_compression: a video run's frames per latent frame after the first (a clip
            entry of ``T`` frames holds ``1 + (T − 1) / temporal_compression`` latent frames).
    """

    store: ShardStore
    image_ids: list[ImageId | None]
    vae_fingerprint: str | None
    text_fingerprint: str | None
    dtype: str
    caption_variants: int = 1
    latent_channels: int = 4
    downsample: int = 8
    temporal_compression: int = 1

    def posterior(
        self, image_id: ImageId, params: BucketCrop, frames: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor] | str:
        """``(mean, std)`` ``[C, h, w]`` of the image under ``params``, or why there is none;
        with ``frames``, ``[C, t, h, w]`` of those frames of a clip
        (:func:`clip_latent_key`)."""
        if frames is None:
            key = latent_key(image_id, params, self.vae_fingerprint, self.dtype)
        else:
            key = clip_latent_key(image_id, frames, params, self.vae_fingerprint, self.dtype)
        try:
            mean, std = self.store.get(f"{key}.mean"), self.store.get(f"{key}.std")
        except KeyError:
            return "not in the cache (run `impasto cache CONFIG`)"
        except DamagedEntry as error:
            return f"{error}; left out, the next cache fill encodes it again"
        except SHARD_ERRORS as error:
            return f"cache shard unreadable ({error_reason(error)})"
        height, width = params.target_size
        factor = self.downsample
        expected = (self.latent_channels, height // factor, width // factor)
        if frames is not None:
            latent_frames = 1 + (len(frames) - 1) // self.temporal_compression
            expected = (expected[0], latent_frames, *expected[1:])
        if tuple(mean.shape) != expected or mean.shape != std.shape:
            return f"cache entry has shape {tuple(mean.shape)}, expected {expected}"
        return mean, std

    def prompt(self, caption: str) -> tuple[Tensor, Tensor] | str | None:
        """``(prompt_embeds [77, D], pooled [P])`` of ``caption``; None if it is not cached; or,
        when its entry is damaged (or its shard does not read), why: the caption is then
        encoded on the fly all the same (the image is trained on), and the next fill encodes
        it again. The reason is one line for the bad-data report."""
        key = text_key(caption, self.text_fingerprint, self.dtype)
        try:
            return self.store.get(f"{key}.embeds"), self.store.get(f"{key}.pooled")
        except KeyError:
            return None
        except DamagedEntry as error:
            return f"damaged: {error}; {REENCODED}, the next `impasto cache` fill encodes it again"
        except SHARD_ERRORS as error:
            return (
                f"damaged: cache shard unreadable ({error_reason(error)}); {REENCODED}, the "
                "next `impasto cache` fill checks the shard again"
            )


def split_for_rank(items: Sequence, rank: int, world_size: int) -> list:
    """Rank ``rank``'s share of ``items``: every ``world_size``-th, from ``rank``."""
    return list(items[rank::world_size])
