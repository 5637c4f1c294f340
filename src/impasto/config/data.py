"""Config sections of the data path: sources, buckets, captions (``data``) and the encoding
cache (``cache``); docs/data.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from impasto.config.section import (
    MAX_BATCH,
    MAX_REPEATS,
    MAX_RESOLUTION,
    MAX_WORKERS,
    Float,
    Int,
    PathStr,
    Resolution,
    Section,
)
from impasto.config.video import VideoConfig


class SubfolderConfig(Section):
    repeats: Int = Field(1, ge=1, le=MAX_REPEATS, description="times each image appears per epoch")
    weight: Float = Field(1.0, gt=0, description="loss weight of its images")


SourceKind = Literal["folder", "manifest", "webdataset", "hf"]


class SourceConfig(Section):
    """One source of images and captions; ``data.sources`` lists several to mix."""

    source: SourceKind = Field(
        "folder",
        description="folder (sidecar captions), manifest (JSONL/CSV/Parquet file), webdataset "
        "(tar shard URLs with brace patterns), hf (a local Hugging Face dataset folder)",
    )
    path: PathStr
    repeats: Int = Field(
        1, ge=1, le=MAX_REPEATS, description="times each of its images appears per epoch"
    )
    loss_weight: Float = Field(1.0, gt=0, description="loss weight of its images")
    subfolders: dict[str, SubfolderConfig] = Field(
        default_factory=dict, description="folder: top-level subfolder → repeats and weight"
    )
    folder_repeats: bool = Field(
        True,
        description="folder: a top-level subfolder named N_name (kohya's habit) repeats its "
        "images N times unless subfolders sets it; false: every subfolder once",
    )
    split: str | None = Field("train", description="hf: the split")
    image_column: str = Field("image", description="hf: the image column")
    caption_column: str | None = Field("text", description="hf: the caption column (null: none)")

    @model_validator(mode="after")
    def _subfolders_need_a_folder(self) -> SourceConfig:
        if self.subfolders and self.source != "folder":
            raise ValueError(
                "subfolders: repeats and weights apply to source: folder; give a manifest's "
                "rows a weight (or list an image twice) instead"
            )
        return self


MAX_PACK_TOKENS = 2**22  # tokens per pack; NeMo's longest video samples hold 74k


class DataConfig(Section):
    """Images with captions: one source (``source``, ``path``) or several (``sources``)."""

    source: SourceKind = "folder"
    path: PathStr | None = None
    prompts: PathStr | None = Field(
        None,
        description="a prompt file instead of images, for methods that generate (draftp): "
        ".txt (one prompt per line) or .jsonl (a prompt, caption or text field per line)",
    )
    subfolders: dict[str, SubfolderConfig] = Field(
        default_factory=dict, description="folder: top-level subfolder → repeats and weight"
    )
    folder_repeats: bool = Field(
        True,
        description="folder: a top-level subfolder named N_name (kohya's habit) repeats its "
        "images N times unless subfolders sets it; false: every subfolder once",
    )
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="several sources mixed (each with repeats and loss_weight); instead of path",
    )
    index_dir: PathStr | None = Field(
        None, description="webdataset: where shard indexes live (default ~/.cache/impasto/shards)"
    )
    missing_captions: Literal["skip", "empty"] = Field(
        "skip",
        description="images without a caption: skip (counted and listed) or train them with "
        "the empty caption (plus caption_prefix/suffix)",
    )
    generate_demo: bool = Field(
        False, description="write the built-in demo dataset to `path` if it does not exist"
    )
    demo_num_images: Int = Field(
        16, ge=1, le=100_000, description="generate_demo: images (with video: clips) to write"
    )
    demo_num_stills: Int = Field(
        0,
        ge=0,
        le=100_000,
        description="generate_demo with video: the image demo's images to write beside the "
        "clips, one-frame samples (docs/video.md)",
    )
    demo_sizes: list[tuple[Resolution, Resolution]] | None = Field(
        None,
        description="generate_demo: (height, width) of the images in turn, for a dataset of "
        "several aspect ratios (pair it with buckets: generated); default: resolution squares",
    )
    resolution: Resolution = Field(64, description="square side, a multiple of 8")
    crop: Literal["center", "random"] = "center"
    random_flip: bool = False
    buckets: Literal["none", "sdxl", "generated"] = Field(
        "none",
        description="aspect-ratio buckets: none (resolution² squares), sdxl (the SDXL paper's "
        "40, needs resolution 1024) or generated (area resolution², sides bucket_min_side.."
        "bucket_max_side in steps of bucket_step)",
    )
    bucket_step: Int = Field(
        64, ge=8, le=MAX_RESOLUTION, description="generated buckets: side step"
    )
    bucket_min_side: Int | None = Field(
        None, ge=8, le=MAX_RESOLUTION, description="default: resolution / 2"
    )
    bucket_max_side: Int | None = Field(
        None, ge=8, le=MAX_RESOLUTION, description="default: 2 * resolution"
    )
    bucket_no_upscale: bool = Field(False, description="only buckets an image fills unscaled")
    caption_dropout: Float = Field(
        0.0, ge=0, le=1, description="probability of the empty caption (for CFG at sampling)"
    )
    shuffle_tags: bool = Field(False, description="shuffle comma-separated tags after keep_tags")
    keep_tags: Int = Field(0, ge=0, le=10_000, description="leading tags never shuffled or dropped")
    tag_dropout: Float = Field(0.0, ge=0, lt=1, description="drop each other tag with this p")
    caption_prefix: str = Field("", description='added before the caption, e.g. "sks, "')
    caption_suffix: str = Field("", description="added after the caption")
    tag_separator: str = Field(",", min_length=1)
    tag_frequency_weighting: bool = Field(
        False, description="per-image loss weight from how rare its tags are (mean 1)"
    )
    tag_weight_min: Float = Field(0.5, gt=0, le=1)
    tag_weight_max: Float = Field(2.0, ge=1, le=1e6)
    batch_size: Int = Field(4, ge=1, le=MAX_BATCH)
    pack_tokens: Int | None = Field(
        None,
        ge=128,
        le=MAX_PACK_TOKENS,
        multiple_of=128,
        description="pack images of different buckets into one sequence of this many tokens "
        "per micro-batch (families that pack: the diffusion transformer; batch_size then does not "
        "apply)",
    )
    num_workers: Int = Field(0, ge=0, le=MAX_WORKERS)
    max_bad_fraction: Float = Field(
        0.05, ge=0, le=1, description="stop with an error if more images than this are unreadable"
    )
    validation_split: Float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="a seeded fraction of the images held out of training for the validation "
        "loss (eval.every_steps); 0: none",
    )
    video: VideoConfig | None = Field(
        None,
        description="train on clips: videos, frame folders and images (one-frame clips) from "
        "the sources, cut as this section says (docs/video.md); null: images only",
    )

    @model_validator(mode="after")
    def _one_way_to_name_the_data(self) -> DataConfig:
        named = [self.path is not None, bool(self.sources), self.prompts is not None]
        if sum(named) != 1:
            raise ValueError(
                "set exactly one of path (one source), sources (several) and prompts (a prompt "
                "file, for draftp)"
            )
        if self.generate_demo and self.path is None:
            raise ValueError("generate_demo writes the demo dataset to path; set path")
        if self.demo_num_stills and not (self.generate_demo and self.video is not None):
            raise ValueError(
                "demo_num_stills: stills go beside the video demo's clips; set "
                "generate_demo: true and video, or remove demo_num_stills"
            )
        self.source_list()  # a single source's checks now
        return self

    def source_list(self) -> list[SourceConfig]:
        """The sources: ``sources``, or the one that ``source``, ``path`` and ``subfolders``
        describe."""
        if self.sources:
            return list(self.sources)
        if self.prompts is not None:
            return []
        return [
            SourceConfig(
                source=self.source,
                path=self.path,
                subfolders=self.subfolders,
                folder_repeats=self.folder_repeats,
            )
        ]

    @model_validator(mode="after")
    def _valid_buckets(self) -> DataConfig:
        if self.buckets == "sdxl" and self.resolution != 1024:
            raise ValueError(
                "buckets: sdxl is SDXL's list around 1024x1024; set data.resolution: 1024, or "
                "use buckets: generated for other sizes"
            )
        if self.buckets == "generated":
            if self.bucket_step % 8:
                raise ValueError(f"bucket_step must be a multiple of 8, got {self.bucket_step}")
            self._check_bucket_sides()  # now, not at the first batch
        return self

    def bucket_sides(self) -> tuple[int, int, int]:
        """``(min_side, max_side, step)`` of generated buckets, defaults filled in."""
        step = self.bucket_step
        low = self.bucket_min_side or max(step, self.resolution // 2 // step * step)
        high = self.bucket_max_side or self.resolution * 2 // step * step
        return low, high, step

    def _check_bucket_sides(self) -> None:
        # The rules of impasto.data.buckets.generate_buckets, restated so that loading a
        # config imports no data code (torch, PIL); they guarantee a non-empty bucket list.
        low, high, step = self.bucket_sides()
        if low % step or high % step:
            raise ValueError(
                f"bucket_min_side ({low}) and bucket_max_side ({high}) must be multiples of "
                f"bucket_step ({step})"
            )
        if low > high:
            raise ValueError(f"bucket_min_side {low} is larger than bucket_max_side {high}")
        if low > self.resolution:
            raise ValueError(
                f"bucket_min_side {low} is above resolution {self.resolution} (buckets hold at "
                "most resolution² pixels)"
            )


class CacheConfig(Section):
    """Encodings by the frozen VAE and text encoders, kept after their first computation.

    ``memory`` keeps them in RAM for the rest of the run: text embeddings per distinct caption,
    VAE posteriors per image (only when images are deterministic: center crop, no flip).
    ``disk`` keeps them in a content-addressed cache folder shared by runs and ranks
    (:mod:`impasto.data.cache`), filled by ``impasto cache CONFIG`` or at the start of
    ``impasto train``.
    """

    latents: Literal["none", "memory", "disk"] = "none"
    text_embeddings: Literal["none", "memory", "disk"] = "none"
    dir: PathStr | None = Field(
        None, description="disk: the cache folder (default: .impasto-cache in the data folder)"
    )
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="disk: storage dtype of the cached tensors"
    )
    caption_variants: Int = Field(
        4,
        ge=1,
        le=1024,
        description="disk text with tag shuffle/dropout: augmented variants cached per caption; "
        "epoch e trains with variant e mod this",
    )
    batch_size: Int = Field(
        8, ge=1, le=MAX_BATCH, description="disk: images or captions encoded at once"
    )
    shard_size_mb: Int = Field(256, ge=1, le=65536, description="disk: size of each cache file")

    @property
    def on_disk(self) -> bool:
        return "disk" in (self.latents, self.text_embeddings)
