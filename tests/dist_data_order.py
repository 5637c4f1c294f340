"""Load training batches on every rank of a torchrun job and write the global sample order.

    torchrun --standalone --nproc_per_node N tests/dist_data_order.py DATA OUT STEPS [STATE]

Each step's samples (rank 0's batch, then rank 1's, ...) are gathered on rank 0, which writes
``OUT`` as JSON: ``{"steps": [[[epoch, index, caption, pixel_sum, flipped], ...], ...],
"state": sampler.state_dict()}``. ``STATE`` (a JSON file with a saved state) resumes.
Used by tests/test_distributed_order.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from impasto.data import build_dataloader, scan_image_folder
from impasto.data.buckets import assign_image_buckets, generate_buckets
from impasto.distributed import gather_to_all, process_group

BATCH, SEED = 2, 11


def sample_summaries(batch) -> list[list]:
    """What identifies each sample: its index, caption and pixels (the augmentation)."""
    return [
        [int(index), caption, round(float(pixels.double().sum()), 4)]
        for index, caption, pixels in zip(
            batch.indices, batch.captions, batch.pixel_values, strict=True
        )
    ]


def main(data: str, out: str, steps: int, state_file: str | None) -> None:
    with process_group() as (rank, world):
        records = scan_image_folder(Path(data))
        bucket_of, _ = assign_image_buckets(records, generate_buckets(32 * 32, 16, 64, 16))
        loader, sampler = build_dataloader(
            records,
            32,
            "random",
            True,
            BATCH,
            SEED,
            bucket_of=bucket_of,
            caption_dropout=0.2,
            rank=rank,
            world_size=world,
        )
        if state_file:
            sampler.load_state_dict(json.loads(Path(state_file).read_text()))
        taken = []
        while len(taken) < steps:
            for batch in loader:
                sampler.advance()
                step = [
                    sample for part in gather_to_all(sample_summaries(batch)) for sample in part
                ]
                taken.append(step)
                if len(taken) == steps:
                    break
        if rank == 0:
            Path(out).write_text(json.dumps({"steps": taken, "state": sampler.state_dict()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
