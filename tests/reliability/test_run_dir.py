"""The run directory is one run's: a second trainer on it stops with one line naming the
first (pid, host) and changes nothing; a lock left by a killed trainer is taken over; a
damaged or tampered newest checkpoint is set aside and the previous one resumed (no pickle
payload runs); a changed optimizer is one line; a full disk is one line and loses nothing, also
when it fills between two saves and another file of the run cannot be written."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import (
    assert_one_line_error,
    final_state,
    finish,
    logged_steps,
    run,
    start,
    wait_for,
    write_config,
)
from helpers import assert_same

from impasto import cli, faults
from impasto.checkpoint import DiskFullError, list_checkpoints, sharded
from impasto.checkpoint import state as checkpoint_state
from impasto.checkpoint.space import DeferredDiskFull
from impasto.cli import main
from impasto.distributed import RunGroup
from impasto.train import run_lock, trainer
from impasto.train.run_lock import RunDirInUse, RunLock


def raw_config(data: Path, run_dir: Path, max_steps: int = 10, **train: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny"},
        "data": {"path": str(data), "resolution": 64, "batch_size": 4},
        "parts": {"unet": "lora"},
        "lora": {"rank": 4},
        "optim": {"lr": 1e-3},
        "train": {"output_dir": str(run_dir), "seed": 0, "max_steps": max_steps, **train},
        "checkpoint": {"every_steps": 5, "keep_last": 3},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
    }


@pytest.mark.slow  # two trainer processes (28 s)
def test_a_second_trainer_on_a_run_directory_stops_and_changes_nothing(tmp_path, demo_folder):
    run_dir = tmp_path / "run"
    first_config = write_config(tmp_path / "a.yaml", raw_config(demo_folder, run_dir, 100000))
    first = start(first_config)
    wait_for(lambda: len(logged_steps(run_dir)) >= 3, first)
    for seed in (0, 1):  # the same config, and one that would have resumed another's run
        raw = raw_config(demo_folder, run_dir, 100000, seed=seed)
        second = run(write_config(tmp_path / f"b{seed}.yaml", raw))
        assert_one_line_error(
            second, f"{run_dir} is in use by another impasto run", f"pid {first.pid} on "
            f"{socket.gethostname()}", "set another train.output_dir",
        )  # fmt: skip
    os.killpg(first.pid, signal.SIGTERM)
    result = finish(first)
    assert result.returncode == 130, result.stderr
    steps = logged_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # no line lost or written twice
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == f"step-{steps[-1]:08d}"


def test_a_killed_trainers_lock_is_taken_over(tmp_path, demo_folder):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "a.yaml", raw_config(demo_folder, run_dir, 100000))
    first = start(config)
    wait_for(lambda: len(logged_steps(run_dir)) >= 1, first)
    first.send_signal(signal.SIGKILL)
    finish(first)
    holder = json.loads((run_dir / ".impasto.lock").read_text())
    assert holder["pid"] == first.pid  # the file stays behind; its flock died with the process
    with RunLock(run_dir):
        assert json.loads((run_dir / ".impasto.lock").read_text())["pid"] == os.getpid()


def test_without_flock_the_lock_file_itself_locks_and_a_dead_holders_is_stale(
    tmp_path, monkeypatch
):
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    lock = RunLock(tmp_path).acquire()
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} .*if no such process runs"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / ".impasto.lock").exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = {"pid": gone.pid, "host": socket.gethostname(), "started": "then"}
    (tmp_path / ".impasto.lock").write_text(json.dumps(holder))
    with RunLock(tmp_path):  # stale: its holder ran here and is gone
        assert json.loads((tmp_path / ".impasto.lock").read_text())["pid"] == os.getpid()
    holder["host"] = "another-node"
    (tmp_path / ".impasto.lock").write_text(json.dumps(holder))
    with pytest.raises(RunDirInUse, match=f"pid {gone.pid} on another-node"):
        RunLock(tmp_path).acquire()  # another host's process cannot be checked: kept


class Payload:
    """What a tampered checkpoint might carry: code that runs when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_newest_checkpoint_is_refused_unread_and_the_previous_resumes(
    tmp_path, demo_folder, capsys
):
    straight_dir = tmp_path / "straight"
    straight = write_config(tmp_path / "s.yaml", raw_config(demo_folder, straight_dir))
    assert main(["train", str(straight)]) == 0
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 8))
    assert main(["train", str(config)]) == 0  # checkpoints at 5 and 8
    newest = run_dir / "checkpoints" / "step-00000008"
    marker = tmp_path / "payload-ran"
    rng = newest / "rng.pt"
    rng.write_bytes(pickle.dumps({"torch": Payload(marker)}))
    state_file = newest / "state.json"  # a careful attacker also fixes the recorded size
    state = json.loads(state_file.read_text())
    state["files"]["rng.pt"] = rng.stat().st_size
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["train", str(write_config(config, raw_config(demo_folder, run_dir, 10)))]) == 0
    out = capsys.readouterr().out
    assert not marker.exists()  # the payload never ran
    assert (
        "rng.pt is damaged (refused: not plain tensors); set aside as damaged-step-00000008" in out
    )
    assert "step-00000005 (step 5)" in out
    assert (run_dir / "checkpoints" / "damaged-step-00000008").is_dir()
    assert_same(final_state(straight_dir), final_state(run_dir), "final state")


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, demo_folder, capsys):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 10))
    assert main(["train", str(config)]) == 0
    weights = run_dir / "checkpoints" / "step-00000010" / "unet.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["train", str(write_config(config, raw_config(demo_folder, run_dir, 12)))]) == 0
    out = capsys.readouterr().out
    assert "unet.safetensors is damaged (truncated:" in out
    assert "resumed from" in out and "step-00000005 (step 5)" in out


def test_a_changed_optimizer_on_resume_is_one_line(tmp_path, demo_folder, capsys):
    run_dir = tmp_path / "run"
    raw = raw_config(demo_folder, run_dir, 5)
    assert main(["train", str(write_config(tmp_path / "r.yaml", raw))]) == 0
    raw["optim"]["name"] = "adafactor"
    raw["train"]["max_steps"] = 10
    capsys.readouterr()
    assert main(["train", str(write_config(tmp_path / "r.yaml", raw))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "impasto: error: optim.name: the checkpoint step-00000005 was trained with adamw, this "
        "config says adafactor (its state does not carry over); keep optim.name: adamw, or "
        "start over with --no-resume"
    ]
    assert main(["train", str(write_config(tmp_path / "r.yaml", raw)), "--no-resume"]) == 0


def test_no_room_for_a_checkpoint_is_one_line_and_loses_nothing(
    tmp_path, demo_folder, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 10))
    real_usage = checkpoint_state.shutil.disk_usage
    saves = []

    def small_disk(path):  # room for the first checkpoint, not the second
        usage = real_usage(path)
        saves.append(path)
        return usage._replace(free=usage.free if len(saves) == 1 else 1 << 20)

    monkeypatch.setattr(checkpoint_state.shutil, "disk_usage", small_disk)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "impasto: error: checkpoint step-00000010: not enough disk space in"
    ), err
    assert "1.0 MiB free); the previous checkpoint step-00000005 is intact" in err[0]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000005"]
    monkeypatch.undo()
    assert main(["train", str(config)]) == 0  # space freed: resumes from step 5
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")][-1] == "step-00000010"


def test_a_disk_that_fills_during_the_save_is_one_line(tmp_path, demo_folder, capsys, monkeypatch):
    """The writers' own errors on a full disk (torch.save's zip writer hides the errno)."""
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 10))
    real_save, real_usage = checkpoint_state.torch.save, checkpoint_state.shutil.disk_usage
    full = []

    def save_until_full(obj, path):
        if "step-00000010" in str(path):
            full.append(path)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
        return real_save(obj, path)

    def usage(path):
        value = real_usage(path)
        return value._replace(free=4096) if full else value

    monkeypatch.setattr(checkpoint_state.torch, "save", save_until_full)
    monkeypatch.setattr(checkpoint_state.shutil, "disk_usage", usage)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint step-00000010: not enough disk space" in err[0], err
    assert "4.0 KiB free); the previous checkpoint step-00000005 is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000005"]


def tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)  # fmt: skip
    return mounted.returncode == 0


def test_a_real_full_disk_is_one_line(tmp_path, demo_folder, capsys, monkeypatch):
    """A 2 MiB tmpfs (needs root, as in CI's container): the first checkpoint does not fit."""
    disk = tmp_path / "disk"
    if not tmpfs(disk, "2m"):
        pytest.skip("cannot mount a tmpfs here (not root); the injected-error tests cover it")
    try:
        run_dir = disk / "run"
        raw = raw_config(demo_folder, run_dir, 5)
        raw["parts"] = {"unet": "full"}  # a few MiB of weights and optimizer state
        config = write_config(tmp_path / "r.yaml", raw)
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not enough disk space" in err[0] and "nothing was lost" in err[0]
        # The same disk filling up while the checkpoint is written (the check passed):
        monkeypatch.setattr(checkpoint_state, "check_free_space", lambda *args: None)
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not enough disk space" in err[0], err
        assert not list((run_dir / "checkpoints").iterdir())  # the partial save is gone
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_tensor_byte_count_matches_the_files(tmp_path):
    data = checkpoint_state.CheckpointData(
        tensors={"model": {"w": torch.zeros(1000)}},
        objects={"optimizer": {"state": {0: {"m": torch.zeros(500, dtype=torch.float64)}}}},
    )
    assert checkpoint_state.checkpoint_bytes(data) == 4000 + 4000
    path = checkpoint_state.save_checkpoint(tmp_path, 1, data, keep_last=1)
    on_disk = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".pt", ".safetensors"))
    assert 8000 <= on_disk < 8000 * checkpoint_state.SPACE_MARGIN + checkpoint_state.SPACE_SLACK


def test_a_damaged_sharded_checkpoint_falls_back_and_a_full_disk_is_one_line(
    tmp_path, demo_folder, capsys, monkeypatch
):
    """The same guarantees for the sharded checkpoints of parallel runs (one process here)."""
    run_dir = tmp_path / "run"
    raw = raw_config(demo_folder, run_dir, 10)
    raw["parallel"] = {"strategy": "fsdp"}
    config = write_config(tmp_path / "r.yaml", raw)
    assert main(["train", str(config)]) == 0
    shard = run_dir / "checkpoints" / "step-00000010" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    capsys.readouterr()
    raw["train"]["max_steps"] = 12
    assert main(["train", str(write_config(config, raw))]) == 0
    out = capsys.readouterr().out
    assert "__0_0.distcp is damaged (truncated:" in out and "step-00000005 (step 5)" in out
    real_usage = checkpoint_state.shutil.disk_usage

    def no_room(path):
        return real_usage(path)._replace(free=1 << 20)

    monkeypatch.setattr(checkpoint_state.shutil, "disk_usage", no_room)
    raw["train"]["max_steps"] = 15
    assert main(["train", str(write_config(config, raw))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint step-00000015: not enough disk space" in err[0], err
    assert "the previous checkpoint step-00000012 is intact" in err[0]


def test_an_output_folder_without_write_permission_is_one_line(
    tmp_path, demo_folder, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 2))
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):  # as under a read-only parent (root ignores modes)
        if self == run_dir:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["train", str(config)]) == 2  # a config value to change: exit 2 (issue #29)
    assert capsys.readouterr().err.strip().splitlines() == [
        f"impasto: error: train.output_dir: cannot create {run_dir} (Permission denied); "
        "choose a folder you can write to"
    ]


def test_an_alias_bomb_in_a_checkpoints_config_does_not_stall_the_resume(
    tmp_path, demo_folder, capsys
):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir, 5))
    assert main(["train", str(config)]) == 0
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    ]  # 10^9 leaves once expanded
    checkpoint = run_dir / "checkpoints" / "step-00000005"
    (checkpoint / "config.yaml").write_text("\n".join(bomb))
    state = json.loads((checkpoint / "state.json").read_text())  # its recorded size fixed too
    state["files"]["config.yaml"] = (checkpoint / "config.yaml").stat().st_size
    (checkpoint / "state.json").write_text(json.dumps(state))
    raw = raw_config(demo_folder, run_dir, 6)
    assert main(["train", str(write_config(config, raw))]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_a_signal_that_library_code_turns_into_another_error_still_exits_130(monkeypatch, capsys):
    """torch's C++ can catch the KeyboardInterrupt a signal handler raises in the middle of a
    call and raise a ValueError instead: the CLI still reports the signal, exit 130."""
    import impasto.cli as cli

    def loading(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt as error:
            raise ValueError("could not determine the shape of object type 'Storage'") from error

    monkeypatch.setattr(cli, "cmd_doctor", loading)
    assert main(["doctor"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "impasto: SIGTERM received during start-up; stopped before training (nothing new to "
        "save; run the same command again to continue)"
    ]
    monkeypatch.undo()
    monkeypatch.setattr(cli, "cmd_doctor", lambda args: int("not a number"))
    assert main(["doctor"]) == 2  # the next command's own error is its own again
    assert "impasto: error: invalid literal" in capsys.readouterr().err


def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path):
    """A data-loader worker is a fork: it shares the lock's open file, so without closing its
    copy the run would stay locked (and read as running) after the trainer let go."""
    import os
    import time

    from impasto.train.run_lock import RunLock

    lock = RunLock(tmp_path).acquire()
    child = os.fork()
    if child == 0:  # the worker: outlives the lock
        time.sleep(3)
        os._exit(0)
    try:
        time.sleep(0.2)
        lock.release()
        RunLock(tmp_path).acquire().release()  # free, while the child still runs
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def test_a_disk_that_fills_between_two_saves_is_one_line_and_resumes_bitwise(
    tmp_path, demo_folder, capsys, monkeypatch
):
    """The metrics append at step 7 finds the disk full (after the checkpoint at step 5): one
    line naming the file and the intact checkpoint, exit 2; with room again, the same command
    resumes and ends where an uninterrupted run does, bit for bit, its log without a gap."""
    straight_dir = tmp_path / "straight"
    straight = write_config(tmp_path / "s.yaml", raw_config(demo_folder, straight_dir))
    assert main(["train", str(straight)]) == 0
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", raw_config(demo_folder, run_dir))
    monkeypatch.setattr(faults, "SPEC", "enospc@metrics.write:7")
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        f"impasto: error: not enough disk space to write {run_dir / 'metrics.jsonl'} ("
    ), err
    assert err[0].endswith(
        "free); the checkpoint step-00000005 is intact; free some space and run the same "
        "command again to resume from it"
    ), err
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    monkeypatch.undo()  # room again
    assert main(["train", str(config)]) == 0
    assert "step-00000005 (step 5)" in capsys.readouterr().out
    assert logged_steps(run_dir) == list(range(1, 11))
    assert_same(final_state(straight_dir), final_state(run_dir), "final state")


@pytest.mark.parametrize(
    ("fault", "raw_edits", "written", "kept"),
    [
        ("enospc@samples.write:2", {"sample": {"every_steps": 3, "prompts": ["a red square"],
         "num_steps": 2}}, "samples/step-00000006.png", "the checkpoint step-00000005 is intact"),
        ("enospc@tensorboard.write:6", {"log": {"every_steps": 1, "tensorboard": True,
         "progress_bar": False}}, "tensorboard", "the checkpoint step-00000005 is intact"),
        ("enospc@lock.write:1", {}, ".impasto.lock", "no checkpoint yet"),
    ],
)  # fmt: skip
def test_each_writer_on_a_full_disk_is_one_line(
    fault, raw_edits, written, kept, tmp_path, demo_folder, capsys, monkeypatch
):
    """A validation grid, TensorBoard's events and the run's lock file (at start, before any
    checkpoint): each names its file; the run lets go of everything (the same process runs
    the same command again)."""
    run_dir = tmp_path / "run"
    raw = raw_config(demo_folder, run_dir, 6) | raw_edits
    config = write_config(tmp_path / "r.yaml", raw)
    monkeypatch.setattr(faults, "SPEC", fault)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"impasto: error: not enough disk space to write {run_dir / written} (" in err[0], err
    assert f"free); {kept}; free some space and run the same command again" in err[0], err
    monkeypatch.undo()
    assert main(["train", str(config)]) == 0


def fill(disk: Path) -> None:
    """Write a file on ``disk`` until no byte more fits."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        for size in (1 << 20, 1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    filler.write(b"\0" * size)


def test_a_real_disk_that_fills_between_two_saves_is_one_line(
    tmp_path, demo_folder, capsys, monkeypatch
):
    """A 40 MiB tmpfs filled right after the checkpoint at step 5: the next write of the run
    (metrics, TensorBoard's writer thread) fails; one line, no thread's traceback. Once the
    filler is deleted the same command resumes from step 5 and finishes."""
    disk = tmp_path / "disk"
    if not tmpfs(disk, "40m"):
        pytest.skip("cannot mount a tmpfs here (not root); the injected-error tests cover it")
    try:
        run_dir = disk / "run"
        raw = raw_config(demo_folder, run_dir, 10)
        raw["log"]["tensorboard"] = True
        config = write_config(tmp_path / "r.yaml", raw)
        real_save_run = trainer.save_run

        def save_then_fill(*args, **kwargs):
            saved = real_save_run(*args, **kwargs)
            fill(disk)
            return saved

        monkeypatch.setattr(trainer, "save_run", save_then_fill)
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"impasto: error: not enough disk space to write {run_dir}/")
        assert "(0 bytes free); the checkpoint step-00000005 is intact; free some" in err[0]
        monkeypatch.undo()
        (disk / "filler").unlink()
        assert main(["train", str(config)]) == 0
        assert "step-00000005 (step 5)" in capsys.readouterr().out
        assert logged_steps(run_dir) == list(range(1, 11))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_real_disk_that_fills_during_a_sharded_save_is_one_line(
    tmp_path, demo_folder, capsys, monkeypatch
):
    """DCP's writers fail on a 192 KiB tmpfs (the check before the save disabled): their
    error, which DCP gathers from every rank, is the one line; the partial save is removed."""
    disk = tmp_path / "disk"
    if not tmpfs(disk, "192k"):
        pytest.skip("cannot mount a tmpfs here (not root); the injected-error tests cover it")
    try:
        run_dir = disk / "run"
        raw = raw_config(demo_folder, run_dir, 5)  # about 300 KiB of LoRA and optimizer state
        raw["parallel"] = {"strategy": "fsdp"}
        monkeypatch.setattr(checkpoint_state, "check_free_space", lambda *args: None)
        monkeypatch.setattr(sharded, "check_free_space", lambda *args: None)
        assert main(["train", str(write_config(tmp_path / "r.yaml", raw))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert "checkpoint step-00000005: not enough disk space" in err[0], err
        assert "nothing was lost" in err[0], err
        assert not list((run_dir / "checkpoints").iterdir())  # the partial save is gone
    finally:
        subprocess.run(["umount", str(disk)], check=False)


class RankOneOfTwo:
    """The run group as rank 1 sees it when rank 0's metrics write found the disk full."""

    is_main = False

    def any(self, *flags: bool) -> list[bool]:
        return [True for _ in flags]

    def gather(self, value: Any) -> list[Any]:
        return ["not enough disk space to write RUN/metrics.jsonl (...)", value]


def test_a_full_disk_on_rank_0_stops_the_other_ranks_silently(tmp_path, capsys):
    """Every rank stops at the same step with rank 0's line (exit 2); rank 0 alone prints it."""
    writes = DeferredDiskFull()
    with pytest.raises(DiskFullError) as stopped:
        writes.check(RankOneOfTwo(), tmp_path, tmp_path / "checkpoints")
    assert str(stopped.value) == "not enough disk space to write RUN/metrics.jsonl (...)"
    assert stopped.value.rank_0_reports
    assert cli._report(stopped.value) == 2
    assert capsys.readouterr().err == ""
    with writes.deferred(), faults.writing(tmp_path / "report.tsv"):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(PermissionError), writes.deferred():
        raise PermissionError(errno.EACCES, "Permission denied")  # not a full disk: raised
    line = str(writes.stop(RunGroup(), tmp_path, tmp_path / "checkpoints"))
    assert line == (
        f"not enough disk space to write {tmp_path / 'report.tsv'} (over the disk quota); no "
        "checkpoint yet; free some space and run the same command again to start over"
    )
