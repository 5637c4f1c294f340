"""Fill the on-disk cache (:mod:`impasto.data.cache`) and open it for training.

``impasto cache CONFIG`` runs :func:`fill_cache` ahead of time; ``impasto train`` runs it too
before its first step, so a run never trains on a half-filled cache (a filled cache makes that
a scan of file stats and shard headers). Under torchrun the work is split across ranks: each
hashes and encodes every ``world_size``-th missing item and writes its own shards; then all
ranks wait for each other and read every shard.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path

import torch
from tqdm import tqdm

from impasto.config import Config
from impasto.data.buckets import BucketCrop, ImageTransform, apply_bucket_transform
from impasto.data.cache import (
    DTYPES,
    CachedEncodings,
    ImageId,
    ImageIds,
    ShardStore,
    ShardWriter,
    fingerprint,
    latent_key,
    split_for_rank,
    text_key,
    tokenizer_fingerprint,
)
from impasto.data.cache_shards import verify_shards
from impasto.data.captions import caption_tools_from
from impasto.data.folder import ImageRecord
from impasto.data.transforms import IMAGE_LOAD_ERRORS
from impasto.data.video.clip_cache import fill_clip_latents
from impasto.distributed import barrier, gather_to_all
from impasto.models.backbone import Backbone

Bucket = tuple[int, int]


@dataclass
class CacheReport:
    """What a fill did: entries encoded and found, images that could not be read."""

    images: int = 0
    latents_encoded: int = 0
    latents_found: int = 0
    texts_encoded: int = 0
    texts_found: int = 0
    unreadable: list[str] = field(default_factory=list)
    damaged_shards: list[str] = field(default_factory=list)
    unchecked_shards: int = 0
    seconds: float = 0.0

    def format(self) -> str:
        lines = [
            f"cache: {self.images} images; latents {self.latents_encoded} encoded, "
            f"{self.latents_found} already cached; text {self.texts_encoded} encoded, "
            f"{self.texts_found} already cached ({self.seconds:.1f} s)"
        ]
        if self.damaged_shards:
            lines.append(f"cache: set aside {len(self.damaged_shards)} damaged shard(s), "
                         f"re-encoded their entries: {', '.join(self.damaged_shards)}")  # fmt: skip
        if self.unchecked_shards:
            lines.append(f"cache: {self.unchecked_shards} shard(s) were written without checksums "
                         "(an older impasto) and are read unchecked; delete them to encode their "
                         "entries again with checksums")  # fmt: skip
        for name in self.unreadable:
            lines.append(f"cache: unreadable, left out: {name}")
        return "\n".join(lines)


def cache_dir(config: Config) -> Path:
    """``cache.dir``; else ``.impasto-cache`` in the data folder (a manifest's folder) of a
    single local source, else ``$XDG_CACHE_HOME/impasto/encodings`` (``~/.cache/...``):
    entries are content-addressed, so datasets and runs can share one cache."""
    if config.cache.dir:
        return Path(config.cache.dir)
    data = config.data
    if data.path is not None and data.source in ("folder", "manifest"):
        path = Path(data.path)
        return (path if data.source == "folder" else path.parent) / ".impasto-cache"
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "impasto" / "encodings"


def encoder_fingerprint(backbone: Backbone, kind: str, *extra: object) -> str:
    """What cached ``kind`` (latents | text) encodings depend on (``Backbone.cache_identity``:
    weights, dtypes, tokenizers), hashed with ``extra``."""
    identity = [
        tokenizer_fingerprint(part) if hasattr(part, "get_vocab") else part
        for part in backbone.cache_identity(kind)
    ]
    return fingerprint(*identity, *extra)


def training_captions(config: Config, records: Sequence[ImageRecord]) -> list[str]:
    """Every caption text training can use: each record's (or its variants, when the caption
    tools are random), and "" when captions are dropped."""
    data, tools = config.data, caption_tools_from(config.data)
    captions, unused = [], torch.Generator()
    for index, record in enumerate(records):
        if tools.random:
            captions.extend(
                tools.variant(record.caption, config.train.seed, variant, index)
                for variant in range(config.cache.caption_variants)
            )
        else:  # deterministic tools (prefix, suffix) draw nothing
            captions.append(tools.apply(record.caption, unused))
    if data.caption_dropout > 0:
        captions.append("")
    return list(dict.fromkeys(captions))


def identify_images(
    config: Config, records: Sequence[ImageRecord], rank: int = 0, world: int = 1
) -> tuple[list[ImageRecord], list[ImageId | None]]:
    """Every record's content id: memoised ones by file stat, the rest hashed (split across
    ranks, then shared). Returns the records with their sizes filled in (so bucket placement
    opens no file) and the ids (None: unreadable)."""
    ids = ImageIds(cache_dir(config))
    result = [ids.lookup(record) for record in records]
    # Repeated records (repeats, subfolder copies) are one image: hash it once.
    copies: dict[tuple[str, str], list[int]] = {}
    for index, image_id in enumerate(result):
        if image_id is None:
            record = records[index]
            copies.setdefault((str(record.image_path), repr(record.blob)), []).append(index)
    todo = [indices[0] for indices in copies.values()]
    barrier()  # every rank has the same todo list before any rank saves new ids
    mine = {}
    for index in split_for_rank(todo, rank, world):
        try:
            mine[index] = ids.compute(records[index])
        except IMAGE_LOAD_ERRORS + (OSError,):
            mine[index] = None
    ids.save(rank)
    found = {index: image_id for part in gather_to_all(mine) for index, image_id in part.items()}
    for indices in copies.values():
        for index in indices:
            result[index] = found[indices[0]]
    sized = [
        record if image_id is None else replace(record, size=(image_id.height, image_id.width))
        for record, image_id in zip(records, result, strict=True)
    ]
    return sized, result


@dataclass
class CacheFill:
    """One rank's part of filling the cache for a run's config, models and records."""

    config: Config
    backbone: Backbone
    records: Sequence[ImageRecord]
    store: ShardStore
    rank: int
    world: int
    report: CacheReport

    def quiet(self, work: Sequence) -> bool:
        """No progress bar: not rank 0, or nothing to do."""
        return self.rank != 0 or not work

    def writer(self, kind: str) -> ShardWriter:
        cache = self.config.cache
        return ShardWriter(cache_dir(self.config), kind, self.rank, cache.shard_size_mb << 20)

    def missing_latents(
        self, ids: Sequence[ImageId | None], bucket_of: Sequence[Bucket | None] | None,
        key_of: Callable[[int, ImageId, BucketCrop], str],
    ) -> tuple[dict[str, tuple[int, BucketCrop]], list[str]]:  # fmt: skip
        """Every (record, transform outcome) by its key ``key_of(index, id, params)``, and this
        rank's share of the keys not in the cache yet (the found ones are counted)."""
        data, report = self.config.data, self.report
        bucketed = bucket_of is not None
        transform = ImageTransform(data.resolution, data.crop, data.random_flip, bucketed)
        needed: dict[str, tuple[int, BucketCrop]] = {}
        for index, image_id in enumerate(ids):
            bucket = bucket_of[index] if bucketed else None
            if image_id is None or (bucketed and bucket is None):
                continue
            for params in transform.every_params(image_id.height, image_id.width, bucket):
                needed.setdefault(key_of(index, image_id, params), (index, params))
        missing = [key for key in needed if f"{key}.mean" not in self.store]
        report.latents_found += len(needed) - len(missing)
        return needed, split_for_rank(missing, self.rank, self.world)

    def latents(
        self, ids: Sequence[ImageId | None], bucket_of: Sequence[Bucket | None] | None, key_fp: str
    ) -> None:
        """Encode the posterior of every (image, transform outcome) not in the cache yet."""
        cache, report = self.config.cache, self.report

        def key_of(index: int, image_id: ImageId, params: BucketCrop) -> str:
            return latent_key(image_id, params, key_fp, cache.dtype)

        needed, mine = self.missing_latents(ids, bucket_of, key_of)
        mine.sort(key=lambda key: needed[key][1].target_size)  # batches of one size
        writer, dtype = self.writer("latents"), DTYPES[cache.dtype]
        progress = tqdm(total=len(mine), desc="cache latents", unit="img", disable=self.quiet(mine))
        for _, same_size in groupby(mine, key=lambda key: needed[key][1].target_size):
            same_size = list(same_size)
            for start in range(0, len(same_size), cache.batch_size):
                chunk = same_size[start : start + cache.batch_size]
                keys, pixels = [], []
                for key in chunk:
                    index, params = needed[key]
                    try:
                        with self.records[index].open_image() as image:
                            image.load()
                            pixels.append(apply_bucket_transform(image, params))
                        keys.append(key)
                    except IMAGE_LOAD_ERRORS:
                        report.unreadable.append(str(self.records[index].image_path))
                if keys:
                    with torch.no_grad():
                        means, stds = self.backbone.latent_posterior(torch.stack(pixels))
                    for row, key in enumerate(keys):
                        mean, std = means[row].to(dtype), stds[row].to(dtype)
                        writer.add({f"{key}.mean": mean, f"{key}.std": std})
                    report.latents_encoded += len(keys)
                progress.update(len(chunk))
        progress.close()
        writer.flush()

    def text(
        self, captions: Sequence[str], key_fp: str, autocast: Callable[[], AbstractContextManager]
    ) -> None:
        """Encode every caption text not in the cache yet."""
        cache, report = self.config.cache, self.report
        keys = {text_key(caption, key_fp, cache.dtype): caption for caption in captions}
        missing = [key for key in keys if f"{key}.embeds" not in self.store]
        report.texts_found += len(keys) - len(missing)
        mine = split_for_rank(missing, self.rank, self.world)
        writer, dtype = self.writer("text"), DTYPES[cache.dtype]
        progress = tqdm(total=len(mine), desc="cache text", unit="text", disable=self.quiet(mine))
        for start in range(0, len(mine), cache.batch_size):
            chunk = mine[start : start + cache.batch_size]
            with torch.no_grad(), autocast():
                encoded = self.backbone.encode_text([keys[key] for key in chunk])
            for row, key in enumerate(chunk):
                embeds = encoded.prompt_embeds[row].to(dtype)
                pooled = encoded.pooled_prompt_embeds[row].to(dtype)
                writer.add({f"{key}.embeds": embeds, f"{key}.pooled": pooled})
            report.texts_encoded += len(chunk)
            progress.update(len(chunk))
        progress.close()
        writer.flush()


def fill_cache(
    config: Config,
    backbone: Backbone,
    records: Sequence[ImageRecord],
    ids: Sequence[ImageId | None],
    bucket_of: Sequence[Bucket | None] | None,
    autocast: Callable[[], AbstractContextManager],
    precision: str,
    rank: int = 0,
    world: int = 1,
) -> tuple[CachedEncodings, CacheReport]:
    """Encode what the cache lacks for this config's data (``cache.latents`` /
    ``cache.text_embeddings: disk``), then open it for reading. ``ids`` come from
    :func:`identify_images`."""
    started = time.perf_counter()
    root = cache_dir(config)
    root.mkdir(parents=True, exist_ok=True)
    report = CacheReport(images=len(records))
    report.unreadable = [str(r.image_path) for r, i in zip(records, ids, strict=True) if i is None]
    # Damaged shards are set aside first, so that their entries count as missing on every rank.
    damaged = verify_shards(root, rank, world)
    barrier()
    store = ShardStore(root)
    # Every rank splits the missing entries by the same list, so all must scan the shards
    # before any rank writes new ones.
    barrier()
    fill = CacheFill(config, backbone, records, store, rank, world, report)
    latents_fp = text_fp = None
    if config.cache.latents == "disk":
        latents_fp = encoder_fingerprint(backbone, "latents")
        if config.data.video is None:
            fill.latents(ids, bucket_of, latents_fp)
        else:  # every sample a clip, encoded a chunk of frames at a time
            fill_clip_latents(fill, ids, bucket_of, latents_fp)
    if config.cache.text_embeddings == "disk":
        text_fp = encoder_fingerprint(backbone, "text", precision)
        fill.text(training_captions(config, records), text_fp, autocast)
    barrier()
    store.refresh()
    damaged += [path.name for path in store.corrupt]
    report.damaged_shards = sorted({name for part in gather_to_all(damaged) for name in part})
    report.unchecked_shards = len(store.unchecked)
    report.unreadable = sorted(set(report.unreadable))
    report.seconds = time.perf_counter() - started
    channels, downsample = backbone.latent_format()
    video = config.data.video
    encodings = CachedEncodings(
        store=store,
        image_ids=list(ids),
        vae_fingerprint=latents_fp,
        text_fingerprint=text_fp,
        dtype=config.cache.dtype,
        caption_variants=config.cache.caption_variants,
        latent_channels=channels,
        downsample=downsample,
        temporal_compression=1 if video is None else video.temporal_compression,
    )
    return encodings, report
