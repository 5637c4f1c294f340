"""What a run's data holds, counted once at start-up: images and repeats per group, and the
tags of each group's captions (issue #17).

A *group* is a folder source's top-level subfolder (``3_cat``: kohya's ``N_name`` dataset
directory) or, for images outside subfolders and for other sources, the source's name
(:func:`~impasto.data.records.group_of`). The counts feed the start-up summary and
``dataset.json``, written into every checkpoint: the ``ss_tag_frequency`` that kohya-style
LoRA metadata carries, so a LoRA's tags can be read back from the file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from impasto.data.folder import ImageRecord

DATASET_FILE = "dataset.json"
"""The file every checkpoint holds (:func:`dataset_json`)."""


@dataclass(frozen=True)
class DataGroup:
    """One group's training examples: ``num_images`` distinct images, ``num_examples`` per
    epoch (repeats counted)."""

    name: str
    num_images: int
    num_examples: int

    @property
    def repeats(self) -> float:
        """Times each image appears per epoch (a whole number unless one image is listed a
        different number of times than another)."""
        return self.num_examples / self.num_images


def training_records(
    records: Sequence[ImageRecord], bucket_of: Sequence[object] | None
) -> list[ImageRecord]:
    """The records an epoch trains on: every one, less those no bucket takes."""
    if bucket_of is None:
        return list(records)
    return [record for record, bucket in zip(records, bucket_of, strict=True) if bucket is not None]


def data_groups(records: Sequence[ImageRecord], groups: Mapping[str, str]) -> list[DataGroup]:
    """Each group's images and examples, in the order the records first name the groups;
    an image ``groups`` does not name counts in the group ``data``."""
    examples: Counter[str] = Counter()
    images: dict[str, set[str]] = {}
    for record in records:
        name = str(record.image_path)
        group = groups.get(name, "data")
        examples[group] += 1
        images.setdefault(group, set()).add(name)
    return [DataGroup(group, len(images[group]), examples[group]) for group in images]


def tag_frequency(
    records: Sequence[ImageRecord], groups: Mapping[str, str], separator: str = ","
) -> dict[str, dict[str, int]]:
    """group → tag → number of its images whose caption has the tag, as kohya sd-scripts
    counts ``ss_tag_frequency``: each distinct image once (repeats do not count), its caption
    split at ``separator``, every part stripped and lower-cased, empty parts left out (a tag
    written twice in one caption counts twice). Tags by count, most frequent first."""
    seen: set[tuple[str, str]] = set()
    counts: dict[str, Counter[str]] = {}
    for record in records:
        name = str(record.image_path)
        group = groups.get(name, "data")
        if (group, name) in seen:
            continue
        seen.add((group, name))
        tags = (part.strip().lower() for part in record.caption.split(separator))
        counts.setdefault(group, Counter()).update(tag for tag in tags if tag)
    return {
        group: dict(sorted(counter.items(), key=lambda item: (-item[1], item[0])))
        for group, counter in counts.items()
    }


def dataset_json(
    num_images: int, steps_per_epoch: int, epoch: int, frequency: Mapping[str, Mapping[str, int]]
) -> str:
    """``dataset.json``: ``images`` (training examples per epoch, repeats counted),
    ``steps_per_epoch``, ``epoch`` (epochs completed at the checkpoint) and ``tag_frequency``
    (:func:`tag_frequency`). The export of kohya LoRA metadata reads this format."""
    document = {
        "images": num_images,
        "steps_per_epoch": steps_per_epoch,
        "epoch": epoch,
        "tag_frequency": frequency,
    }
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"
