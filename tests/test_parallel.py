"""Data-parallel training on CPU with gloo (issue #14): DDP, FSDP2 and HSDP through torchrun
train exactly what one process trains, checkpoints reshard to any number of ranks, and a job
whose rank is killed restarts and finishes with the same weights.

Every launch sets OMP_NUM_THREADS=1 per process (2 cores here). One torchrun launch trains
several runs in the same processes (tests/dist_train.py) to keep start-up costs down.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dist_helpers import (
    ENV,
    WORKER,
    assert_same_training,
    first_failure,
    in_process,
    launch_plan,
    torchrun,
    trained_weights,
)

from impasto.checkpoint.sharded import is_sharded
from impasto.data.demo import write_demo_dataset
from impasto.train.run_lock import RunLock

pytestmark = pytest.mark.slow  # ~2 minutes of torchrun launches: in .ci/run, not in -m "not slow"

STEPS = 5

FULL = {
    "parts": {"unet": "full", "text_encoder": "full"},  # encoder 1 has unused final layers
    "ema": {"enabled": True, "decay": 0.8},
}
ASYNC = {"every_steps": 3, "keep_last": 2, "async": True}
LORA = {"parts": {"unet": "lora", "text_encoder_2": "lora"}, "lora": {"rank": 4}}
# Dropout draws from the global generators, seeded per slot (micro-step × ranks + rank): alike
# for 2 ranks × batch 2 and 1 rank × batch 2 × 2 accumulation (not 1 rank × batch 4: 1 slot).
LORA_DROPOUT = {"parts": LORA["parts"], "lora": {"rank": 4, "dropout": 0.1}}
# DRaFT+ (issue #15) on the demo captions with the shipped demo judge: the noise of the step's
# global batch is drawn once and split by rows, so the ranks sample what one process samples.
DRAFTP = {
    "objective": {"method": "draftp"},
    "parts": {"unet": "lora"},
    "lora": {"rank": 4},
    "reward": {"kind": "demo"},
    "draftp": {"num_steps": 4, "truncation_steps": 2, "guidance_scale": 2.0},
}


def raw_config(data: Path, out: Path, strategy: str, batch: int, accum: int = 1,
               steps: int = STEPS, **sections: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    raw = {
        "model": {"preset": "tiny"},
        "data": {"path": str(data), "resolution": 64, "batch_size": batch},
        "optim": {"lr": 1e-3, "weight_decay": 0.01},
        "train": {
            "output_dir": str(out),
            "seed": 7,
            "max_steps": steps,
            "grad_accum_steps": accum,
            "mixed_precision": "fp32",
        },
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "log": {"every_steps": 1, "tensorboard": False, "progress_bar": False},
        "parallel": {"strategy": strategy},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Trains every run the tests compare; one torchrun launch (2 ranks) for the parallel ones.

    - ``one-full`` / ``one-lora``: one process, batch 4 (the references);
    - ``ddp-*`` / ``fsdp-*``: 2 ranks × batch 2;
    - ``one-accum``: one process, batch 2 × 2 accumulation, 6 steps, LoRA with dropout (the
      same global batches and slots as 2 ranks × batch 2);
    - ``down``: 3 steps on 2 ranks (ddp), then resumed on 1 (ddp, accumulation 2) to step 6;
    - ``up``: 3 steps on 1 rank (fsdp, accumulation 2), then resumed on 2 ranks (fsdp) to 6.
    """
    tmp = tmp_path_factory.mktemp("parallel")
    data = tmp / "data"
    write_demo_dataset(data, 16, 64, seed=1)
    out = tmp / "runs"

    def config(name, strategy, batch, accum=1, steps=STEPS, **sections):
        return raw_config(data, out / name, strategy, batch, accum, steps, **sections)

    in_process((config("up", "fsdp", 2, 2, 3, **LORA_DROPOUT), False))
    launch_plan(tmp, [
        (config("ddp-full", "ddp", 2, **FULL), False),
        (config("fsdp-full", "fsdp", 2, **FULL), False),
        (config("ddp-lora", "ddp", 2, **LORA), False),
        (config("fsdp-lora", "fsdp", 2, checkpoint=ASYNC, **LORA), False),
        (config("down", "ddp", 2, 1, 3, **LORA_DROPOUT), False),
        (config("up", "fsdp", 2, 1, 6, **LORA_DROPOUT), True),
        (config("ddp-draftp", "ddp", 1, 1, 3, **DRAFTP), False),
        (config("fsdp-draftp", "fsdp", 1, 1, 3, **DRAFTP), False),
    ])  # fmt: skip
    in_process(
        (config("one-full", "none", 4, **FULL), False),
        (config("one-lora", "none", 4, **LORA), False),
        (config("one-accum", "none", 2, 2, 6, **LORA_DROPOUT), False),
        (config("down", "ddp", 2, 2, 6, **LORA_DROPOUT), True),
        (config("one-draftp", "none", 2, 1, 3, **DRAFTP), False),
    )
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_ranks_train_like_one_process(runs, strategy, kind):
    """2 ranks × batch 2 = 1 process × batch 4, step for step: losses, weights and (full) the
    EMA, with a text encoder training (DDP would fail on its unused parameters)."""
    assert_same_training(runs / f"{strategy}-{kind}", runs / f"one-{kind}")
    if kind == "full":
        assert_same_training(runs / f"{strategy}-{kind}", runs / "one-full", ema=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_draftp_on_two_ranks_trains_like_one_process(runs, strategy):
    """DRaFT+ with LoRA: 2 ranks × 1 prompt = 1 process × 2 prompts (rewards, KL, weights)."""
    assert_same_training(runs / f"{strategy}-draftp", runs / "one-draftp")


def test_fsdp_equals_ddp(runs):
    for kind in ("full", "lora"):
        assert_same_training(runs / f"fsdp-{kind}", runs / f"ddp-{kind}")


@pytest.mark.parametrize("run", ["down", "up"])
def test_resume_on_another_number_of_ranks(runs, run):
    """Saved on 2 ranks and resumed on 1, and the reverse (with fsdp: the shards move): the
    continued run equals an uninterrupted one-process run."""
    checkpoints = sorted((runs / run / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-00000003", "step-00000006"]
    assert [is_sharded(path) for path in checkpoints] == [True, True]
    saved_by = {"down": 2, "up": 1}[run]  # step 3: written by 2 ranks (down), by 1 (up)
    assert len(list(checkpoints[0].glob("__*_0.distcp"))) == saved_by
    assert_same_training(runs / run, runs / "one-accum")


def test_sharded_checkpoint_has_one_file_per_rank(runs):
    newest = sorted((runs / "fsdp-full" / "checkpoints").iterdir())[-1]
    assert sorted(path.name for path in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    state = json.loads((newest / "state.json").read_text())
    assert state["layout"] == "sharded" and state["train"]["step"] == STEPS
    assert state["train"]["samples_seen"] == STEPS * 4  # summed over the ranks
    assert state["model_metadata"]["unet"]["impasto.prediction_type"] == "epsilon"


def test_async_checkpoints_complete(runs):
    """``checkpoint.async``: written in the background, each becomes a complete checkpoint
    (renamed into place once every rank has written), and the run trained as without it."""
    run = runs / "fsdp-lora"
    names = sorted(path.name for path in (run / "checkpoints").iterdir())
    assert names == ["step-00000003", "step-00000005"]
    for path in (run / "checkpoints").iterdir():
        assert is_sharded(path) and (path / "state.json").is_file()
    # What the background writer saved at step 3 is step 3's state (staged before step 4 ran).
    step_3 = "checkpoints/step-00000003"
    torch.testing.assert_close(
        trained_weights(run / step_3), trained_weights(runs / "ddp-lora" / step_3)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hsdp_on_two_simulated_nodes(runs, tmp_path):
    """Two torchrun launches (``--nnodes 2``, c10d rendezvous on 127.0.0.1) of 2 processes each
    run ``python -m impasto train``: HSDP shards within a node and replicates across, and 4
    ranks × batch 1 train like one process × batch 4 (= DDP, test above)."""
    reference = yaml.safe_load((runs / "one-full" / "config.yaml").read_text())
    raw = raw_config(Path(reference["data"]["path"]), tmp_path / "hsdp", "hsdp", 1, **FULL)
    config = tmp_path / "hsdp.yaml"
    config.write_text(yaml.safe_dump(raw))
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", endpoint, "--rdzv-id", "hsdp-test"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *common,
                "-m",
                "impasto",
                "train",
                str(config),
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert_same_training(tmp_path / "hsdp", runs / "one-full")
    assert sum("impasto: finished at step" in output for output in outputs) == 1  # rank 0 only


def test_killed_rank_restarts_and_finishes_alike(runs, tmp_path):
    """SIGKILL rank 1 after step 4 under ``--max-restarts 1``: torchrun restarts both ranks,
    they join a fresh group (the store is per attempt) and resume from the newest complete
    checkpoint (step 3), and finish with the weights of an uninterrupted run."""
    reference = yaml.safe_load((runs / "one-accum" / "config.yaml").read_text())
    data = Path(reference["data"]["path"])
    raw = raw_config(data, tmp_path / "killed", "ddp", 2, 1, 6, **LORA_DROPOUT)
    env = {**ENV, "IMPASTO_TEST_KILL": "1:4"}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"config": raw, "resume": True}]))
    done = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                    str(WORKER), str(plan), env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "resumed from" in done.stdout and "step-00000003" in done.stdout
    assert_same_training(tmp_path / "killed", runs / "one-accum")


def test_ranks_with_different_configs_stop_with_one_line(runs, tmp_path):
    """Rank 1 gets another seed: every rank stops at start with the same one-line error."""
    reference = yaml.safe_load((runs / "one-accum" / "config.yaml").read_text())
    raw = raw_config(Path(reference["data"]["path"]), tmp_path / "odd", "ddp", 2)
    config = tmp_path / "odd.yaml"
    config.write_text(yaml.safe_dump(raw))
    script = (
        "import os, sys; from impasto.cli import main; "
        "sys.exit(main(['train', sys.argv[1], '--set', f'train.seed={os.environ[\"RANK\"]}']))"
    )
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(script)
    done = torchrun("--standalone", "--nproc-per-node", "2", str(wrapper), str(config))
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "impasto: error:" in line]
    # Each rank prints it, unless torchrun stopped the slower one first (the job failed).
    assert len(errors) in (1, 2)
    assert ["ranks disagree on the config" in error for error in errors] == [True] * len(errors)
    assert not (tmp_path / "odd" / "checkpoints").exists()  # stopped before any step


def test_a_run_directory_in_use_stops_every_rank_with_one_line(runs, tmp_path):
    """Another trainer holds the directory: rank 0 cannot lock it, and every rank stops with
    rank 0's line (none waits at a barrier for the others)."""
    reference = yaml.safe_load((runs / "one-accum" / "config.yaml").read_text())
    raw = raw_config(Path(reference["data"]["path"]), tmp_path / "busy", "ddp", 2)
    config = tmp_path / "busy.yaml"
    config.write_text(yaml.safe_dump(raw))
    with RunLock(tmp_path / "busy"):
        done = torchrun("--standalone", "--nproc-per-node", "2", "-m", "impasto", "train",
                        str(config), timeout=120)  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "impasto: error:" in line]
    assert len(errors) in (1, 2)  # each rank's, unless torchrun stopped the slower one first
    assert all(f"is in use by another impasto run (pid {os.getpid()}" in e for e in errors)
    assert not (tmp_path / "busy" / "checkpoints").exists()


def test_every_rank_waits_for_rank_0_to_make_a_sharded_saves_folder(tmp_path):
    """Rank 0 checks the free space, then makes a sharded save's temporary folder; the other
    ranks start DCP's writer, which makes the folder too, only once rank 0's verdict reaches
    them. Before, a rank 0 slower than its peers (here by 2 s; in the suite, a loaded machine)
    found the folder already made and the run died with FileExistsError."""
    data = tmp_path / "data"
    write_demo_dataset(data, 16, 64, seed=1)
    plan = tmp_path / "plan.json"
    raw = raw_config(data, tmp_path / "run", "fsdp", 2, steps=3)
    plan.write_text(json.dumps([{"config": raw, "resume": False}]))
    env = ENV | {"IMPASTO_TEST_SLOW_SPACE_CHECK": "2"}
    done = torchrun("--standalone", "--nproc-per-node", "2", str(WORKER), str(plan), env=env)
    assert done.returncode == 0, first_failure(done.stderr) + done.stderr[-3000:]
    assert [path.name for path in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-00000003"]
