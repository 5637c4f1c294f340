"""The data order across ranks: one sequence of per-rank batches, split by step, resumable on
any number of ranks (the sampler unit-tested here, and a real torchrun job on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from impasto.data import BatchPosition, ResumableBatchSampler

SCRIPT = Path(__file__).with_name("dist_data_order.py")


def flat_steps(sampler_for_rank, world: int, steps: int, start=(0, 0)) -> list[list[tuple]]:
    """``steps`` steps of ``world`` ranks: each step's keys, rank 0's batch first."""
    samplers = [sampler_for_rank(rank, world, start) for rank in range(world)]
    taken: list[list[tuple]] = []
    iterators = [iter(sampler) for sampler in samplers]
    while len(taken) < steps:
        try:
            parts = [next(iterator) for iterator in iterators]
        except StopIteration:
            iterators = [iter(sampler) for sampler in samplers]
            continue
        for sampler in samplers:
            sampler.advance()
        taken.append([(key.epoch, key.index) for part in parts for key in part])
    assert len({sampler.position for sampler in samplers}) == 1
    return taken


def make_sampler(rank: int, world: int, start, bucket_of=None) -> ResumableBatchSampler:
    return ResumableBatchSampler(
        13, 2, seed=5, drop_last=False, fill_last=True, start_position=start,
        bucket_of=bucket_of, rank=rank, world_size=world,
    )  # fmt: skip


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_one_sequence_across_epochs(world: int, bucketed: bool) -> None:
    buckets = [(32, 32), (32, 64), (64, 32)]
    bucket_of = [buckets[i % 3] for i in range(13)] if bucketed else None
    sampler_for = lambda rank, w, start: make_sampler(rank, w, start, bucket_of)  # noqa: E731
    single = [key for step in flat_steps(sampler_for, 1, 30) for key in step]
    several = [key for step in flat_steps(sampler_for, world, 30 // world) for key in step]
    assert several == single[: len(several)]
    # 7 batches per epoch: some steps take batches of two epochs
    per_epoch = make_sampler(0, 1, (0, 0), bucket_of).num_batches_per_epoch
    assert per_epoch % world != 0
    epochs = {key[0] for key in several}
    assert epochs == set(range(len(several) // (2 * per_epoch) + 1))


def test_resume_on_another_number_of_ranks_continues_with_the_next_batch() -> None:
    uninterrupted = [key for step in flat_steps(make_sampler, 1, 24) for key in step]
    first = flat_steps(make_sampler, 2, 5)  # 10 batches, then stop
    position = make_sampler(0, 2, (0, 0)).position_after(BatchPosition(0, 0), 5)
    assert position == BatchPosition(1, 3)  # 7 batches per epoch
    second = flat_steps(make_sampler, 3, 4, (position.epoch, position.batch_in_epoch))
    resumed = [key for step in first + second for key in step]
    assert resumed == uninterrupted[: len(resumed)]


def test_state_dict_resumes_on_any_number_of_ranks() -> None:
    sampler = make_sampler(1, 4, (0, 0))
    sampler.advance(2)
    state = sampler.state_dict()
    assert state["world_size"] == 4 and (state["epoch"], state["batch_in_epoch"]) == (1, 1)
    single = make_sampler(0, 1, (0, 0))
    single.load_state_dict(state)
    assert single.position == BatchPosition(1, 1)
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        make_sampler(2, 2, (0, 0))


def write_images(root: Path) -> None:
    """Nine small images in three aspect ratios, with captions."""
    root.mkdir()
    sizes = [(32, 32), (48, 24), (24, 48)]
    for i in range(9):
        height, width = sizes[i % 3]
        color = (20 * i, 255 - 20 * i, (40 * i) % 256)
        image = Image.new("RGB", (width, height), color)
        image.putpixel((1, 2), (255, 0, 0))  # not symmetric: a flip changes the pixels
        image.save(root / f"{i:02d}.png")
        (root / f"{i:02d}.txt").write_text(f"image {i}, tag{i % 4}")


def torchrun(world: int, data: Path, out: Path, steps: int, state: Path | None = None) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", str(SCRIPT), str(data), str(out), str(steps),
    ]  # fmt: skip
    if state is not None:
        command.append(str(state))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # a torchrun launch (43 s)
@pytest.mark.distributed
def test_torchrun_two_ranks_resume_exactly_on_two_or_one(tmp_path: Path) -> None:
    data = tmp_path / "images"
    write_images(data)
    whole = torchrun(2, data, tmp_path / "whole.json", 8)
    first = torchrun(2, data, tmp_path / "first.json", 3)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first["state"]))
    on_two = torchrun(2, data, tmp_path / "two.json", 5, state)
    on_one = torchrun(1, data, tmp_path / "one.json", 10, state)

    def flat(run: dict) -> list:
        return [sample for step in run["steps"] for sample in step]

    reference = flat(whole)
    assert len(reference) == 8 * 2 * 2 and len({s[0] for s in reference}) == 9
    assert flat(first) + flat(on_two) == reference
    assert flat(first) + flat(on_one) == reference
    assert on_two["state"]["epoch"] == whole["state"]["epoch"] >= 1
    assert on_one["state"]["batch_in_epoch"] == whole["state"]["batch_in_epoch"]
