"""Train one or more runs on every rank of a torchrun job (tests/test_parallel.py).

    torchrun --standalone --nproc-per-node N tests/dist_train.py PLAN.json

``PLAN.json`` is a list of ``{"config": raw config dict, "resume": bool}``; they train one after
another in the same processes (the process group is started once, so each run's setup is the
only cost). ``IMPASTO_TEST_KILL`` = ``RANK:STEP`` makes that rank SIGKILL itself after that
step on the job's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): a crash mid-run.
``IMPASTO_TEST_SLOW_SPACE_CHECK`` = ``SECONDS`` makes rank 0 take that long to check the free
space before each sharded save: a loaded machine, or a slow shared filesystem.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from impasto.config import build_config
from impasto.distributed import init_torchrun_group
from impasto.train import train
from impasto.train.trainer import Trainer


def kill_mid_run() -> None:
    target = os.environ.get("IMPASTO_TEST_KILL")
    if not target or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, at_step = (int(value) for value in target.split(":"))
    if int(os.environ["RANK"]) != rank:
        return
    step = Trainer.step

    def step_then_die(self):
        values = step(self)
        if self.state.step == at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return values

    Trainer.step = step_then_die


def slow_space_check() -> None:
    seconds = os.environ.get("IMPASTO_TEST_SLOW_SPACE_CHECK")
    if not seconds or os.environ.get("RANK") != "0":
        return
    from impasto.checkpoint import sharded

    check = sharded.check_free_space

    def slowly(*args, **kwargs):
        time.sleep(float(seconds))
        return check(*args, **kwargs)

    sharded.check_free_space = slowly


def main(plan_file: str) -> None:
    torch.set_num_threads(1)
    kill_mid_run()
    slow_space_check()
    plan = json.loads(open(plan_file, encoding="utf-8").read())
    launched = "RANK" in os.environ  # by torchrun (else one process: train() makes its group)
    if launched:
        init_torchrun_group("gloo", datetime.timedelta(seconds=120))
    try:
        for run in plan:
            train(build_config(run["config"]), resume=run.get("resume", True))
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
