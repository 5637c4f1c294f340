"""Image sources that are not a folder of files: webdataset tar shards, Parquet manifests and
local Hugging Face datasets (docs/data-sources.md).

Each source returns ``list[ImageRecord]`` in a fixed order (its ``*_scan`` twin returns a
:class:`~impasto.data.folder.Scan`, which also names each item left out and why). Images that
are not plain files get a small frozen ``blob`` that reads their bytes on demand: training
shuffles, so every image is read by its own position (a byte range, a Parquet row, a dataset
index), never by streaming. Blobs are picklable and open their files lazily, once per process,
in the loader's workers.
"""

from impasto.data.sources.hf import HFRowBlob, hf_dataset_records, hf_dataset_scan
from impasto.data.sources.parquet import (
    LARGE_ROW_GROUP_BYTES,
    ParquetRowBlob,
    parquet_records,
    parquet_scan,
)
from impasto.data.sources.shards import (
    HEADER_BYTES,
    INDEX_VERSION,
    NUM_INDEX_THREADS,
    RANGE_BLOBS,
    SHARD_CAPTION_SUFFIXES,
    SHARD_CLIP_SUFFIXES,
    SHARD_IMAGE_SUFFIXES,
    SHARD_VIDEO_SUFFIXES,
    FileRangeBlob,
    FsspecRangeBlob,
    expand_urls,
    shard_index,
    webdataset_records,
    webdataset_scan,
)

__all__ = [
    "HEADER_BYTES",
    "INDEX_VERSION",
    "LARGE_ROW_GROUP_BYTES",
    "NUM_INDEX_THREADS",
    "RANGE_BLOBS",
    "SHARD_CAPTION_SUFFIXES",
    "SHARD_CLIP_SUFFIXES",
    "SHARD_IMAGE_SUFFIXES",
    "SHARD_VIDEO_SUFFIXES",
    "FileRangeBlob",
    "FsspecRangeBlob",
    "HFRowBlob",
    "ParquetRowBlob",
    "expand_urls",
    "hf_dataset_records",
    "hf_dataset_scan",
    "parquet_records",
    "parquet_scan",
    "shard_index",
    "webdataset_records",
    "webdataset_scan",
]
