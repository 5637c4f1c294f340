"""Local Hugging Face datasets, loaded offline (docs/data-sources.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from impasto.data.folder import ImageRecord, Scan
from impasto.data.skips import SCANNED, Skipped, UnreadableSource, error_reason
from impasto.data.sources._common import _image_size


@contextmanager
def _hf_offline() -> Iterator[None]:
    """Offline mode for ``datasets`` and ``huggingface_hub`` while loading: both read their
    ``HF_*_OFFLINE`` variables at import, so the flags are set on their config modules."""
    import datasets.config
    import huggingface_hub.constants

    flags = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),  # older datasets read this one
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]
    saved = [
        (module, name, getattr(module, name)) for module, name in flags if hasattr(module, name)
    ]
    for module, name, _ in saved:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _pick_split(splits: list[str], split: str | None, path: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split not in splits:
        raise ValueError(f"data: {path} has no split {split!r}; its splits: {', '.join(splits)}")
    return split


def _load_hf_dataset(path: str, split: str | None) -> tuple[Any, list[Skipped]]:
    """The split of a ``save_to_disk`` folder, or of a folder ``load_dataset`` reads, offline,
    and the data files left out because they do not decode (the others still load). A plain
    saved ``Dataset`` has no splits: ``split`` is ignored for it."""
    import datasets

    folder = Path(path)
    saved = (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()
    with _hf_offline():
        if saved:
            try:
                loaded = datasets.load_from_disk(path)
            except (pa.ArrowException, OSError):  # a damaged or missing Arrow file
                return _load_saved_files(folder, split)
        else:
            try:
                loaded = datasets.load_dataset(path)
            except (FileNotFoundError, ValueError) as error:
                raise ValueError(
                    f"data: {path} is neither a save_to_disk folder nor a dataset folder "
                    f"load_dataset reads ({error_reason(error)})"
                ) from None
            except datasets.exceptions.DatasetGenerationError as error:
                return _load_good_data_files(path, split, error)
    if isinstance(loaded, datasets.Dataset):
        return loaded, []
    return loaded[_pick_split(list(loaded), split, path)], []


def _load_saved_files(folder: Path, split: str | None) -> tuple[Any, list[Skipped]]:
    """A ``save_to_disk`` split from the Arrow files that open, one by one."""
    import datasets

    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        folder = folder / _pick_split(splits, split, str(folder))
    state = json.loads((folder / "state.json").read_text())
    parts, skipped = [], []
    for entry in state["_data_files"]:
        file = folder / entry["filename"]
        try:
            parts.append(datasets.Dataset.from_file(str(file)))
        except (pa.ArrowException, OSError) as error:
            reason = f"Arrow file does not load ({error_reason(error)})"
            skipped.append(Skipped(SCANNED, str(file), reason))
    if not parts:
        raise UnreadableSource(str(folder), f"no Arrow file loads; {skipped[0].reason}")
    return datasets.concatenate_datasets(parts), skipped


def _data_file_problem(file: str) -> str | None:
    """Why a Parquet or Arrow data file cannot be read, or None (other formats: not checked)."""
    try:
        if file.endswith(".parquet"):
            pq.read_table(file)
        elif file.endswith(".arrow"):
            with pa.memory_map(file) as source:
                pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as error:
        return f"data file does not load ({error_reason(error)})"
    return None


def _load_good_data_files(
    path: str, split: str | None, error: Exception
) -> tuple[Any, list[Skipped]]:
    """``load_dataset`` failed: load the split again from its data files that read, or raise
    ``error`` as one line when no file is to blame."""
    import datasets

    builder = datasets.load_dataset_builder(path)
    files = builder.config.data_files
    split = _pick_split(list(files), split, path)
    good, skipped = [], []
    for file in map(str, files[split]):
        problem = _data_file_problem(file)
        if problem is None:
            good.append(file)
        else:
            skipped.append(Skipped(SCANNED, file, problem))
    if not skipped:
        raise ValueError(f"data: {path}: load_dataset failed ({error_reason(error)})") from None
    if not good:
        raise UnreadableSource(path, f"no data file of split {split!r} loads; {skipped[0].reason}")
    loaded = datasets.load_dataset(builder.name, data_files={split: good})
    return loaded[split], skipped


def _image_column(dataset, column: str, where: str, other_columns: Sequence[str] = ()):
    """``dataset`` with ``column`` read as undecoded images ``{"bytes", "path"}``, and
    ``other_columns``."""
    import datasets

    for name in (column, *other_columns):
        if name not in dataset.column_names:
            names = ", ".join(dataset.column_names)
            raise ValueError(f"data: {where} has no column {name!r}; its columns: {names}")
    try:
        selected = dataset.select_columns([column, *other_columns])
        return selected.cast_column(column, datasets.Image(decode=False))
    except (TypeError, ValueError, pa.ArrowException) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"data: {where} column {column!r} does not hold images ({reason})"
        ) from None


# One loaded dataset per (process, path, split, column); loaded lazily in each loader worker.
_HF_IMAGES: dict[tuple[int, str, str | None, str], Any] = {}


def _hf_images(path: str, split: str | None, column: str):
    key = (os.getpid(), path, split, column)
    if key not in _HF_IMAGES:
        dataset, _ = _load_hf_dataset(path, split)  # the files the main process kept
        _HF_IMAGES[key] = _image_column(dataset, column, path)
    return _HF_IMAGES[key]


def _hf_image_file(value: dict[str, Any] | None) -> bytes | str | None:
    """An undecoded image value's bytes, or else its local file (an image folder's rows)."""
    return (value.get("bytes") or value.get("path")) if value else None


@dataclass(frozen=True)
class HFRowBlob:
    """The image bytes of ``dataset[index][column]`` of a local Hugging Face dataset."""

    path: str
    split: str | None
    index: int
    column: str

    def read(self) -> bytes:
        image_file = _hf_image_file(
            _hf_images(self.path, self.split, self.column)[self.index][self.column]
        )
        if image_file is None:
            raise OSError(f"{self.path} index {self.index}: no image bytes or path")
        return image_file if isinstance(image_file, bytes) else Path(image_file).read_bytes()


def hf_dataset_records(
    path: str | Path,
    split: str | None = "train",
    image_column: str = "image",
    caption_column: str | None = "text",
) -> list[ImageRecord]:
    """:func:`hf_dataset_scan`'s records; each row or file left out is logged as a warning."""
    return hf_dataset_scan(path, split, image_column, caption_column).logged_records()


def hf_dataset_scan(
    path: str | Path,
    split: str | None = "train",
    image_column: str = "image",
    caption_column: str | None = "text",
) -> Scan:
    """The rows of a local Hugging Face dataset, in index order, without touching the network.

    Args:
        path: a local folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``,
            or one ``datasets.load_dataset(path)`` reads (Parquet files, an image folder).
        split: the split to read; ``None`` takes the only one. Ignored for a plain ``Dataset``.
        image_column: the images (``datasets.Image``, or bytes or paths castable to it).
        caption_column: the caption strings; ``None`` gives every image the empty caption.

    Returns:
        The records, and what was left out with the reason: a row without an image or whose
        caption is not a string (named ``folder/split/index``), a data file that does not
        load (named by its path; the other files' rows still train).

    Raises:
        ValueError: not a local folder, no such split or column, or no usable rows;
            :class:`~impasto.data.skips.UnreadableSource` when no data file loads.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"data: Hugging Face dataset {path} is not a local folder; download it first "
            "(huggingface-cli download --repo-type dataset NAME --local-dir DIR) and pass DIR"
        )
    resolved = str(folder.resolve())
    where = resolved if split is None else f"{resolved} split {split!r}"
    dataset, skipped_files = _load_hf_dataset(resolved, split)
    other_columns = [caption_column] if caption_column is not None else []
    rows = _image_column(dataset, image_column, where, other_columns)
    # The blobs of this process (a loader without workers) reuse the dataset loaded here.
    _HF_IMAGES[(os.getpid(), resolved, split, image_column)] = rows.select_columns([image_column])
    prefix = folder.name if split is None else f"{folder.name}/{split}"
    scan, index = Scan(skipped=list(skipped_files)), 0
    for batch in rows.iter(batch_size=256):
        images = batch[image_column]
        captions = batch[caption_column] if caption_column is not None else [""] * len(images)
        for image, caption in zip(images, captions, strict=True):
            name, blob = f"{prefix}/{index}", HFRowBlob(resolved, split, index, image_column)
            index += 1
            image_file = _hf_image_file(image)
            if caption is not None and not isinstance(caption, str):
                scan.skip(name, f"the caption is {type(caption).__name__}, not a string")
            elif image_file is None:
                scan.skip(name, "no image")
            else:
                caption = (caption or "").strip()
                scan.records.append(
                    ImageRecord(name, caption, blob=blob, size=_image_size(image_file))
                )
    if not scan.records:
        first = f" ({scan.skipped[0].name}: {scan.skipped[0].reason})" if scan.skipped else ""
        raise ValueError(f"data: {where} has no usable rows{first}")
    return scan
