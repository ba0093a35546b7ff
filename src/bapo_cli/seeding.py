"""One seed for every generator a run draws from: Python's `random`, NumPy's global generator and
torch's (CPU and every CUDA device).

A ground-floor module: the trainer seeds with it at start (and per rank), evaluation and the
failure classes seed with it before sampling a checkpoint again, and the testbed build
(`launch.testbed`) before each held-out measurement. Saving and restoring the generators' states
is the checkpoint's job (`trainer.checkpoint.rng_state` / `set_rng_state`).
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
