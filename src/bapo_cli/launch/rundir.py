"""Run and sweep dirs that no two runs share, even when started in the same second.

Hydra's default `runs/<date>/<time>` is only as unique as the clock's second: two `bapo train`
started together (two terminals, a script, parallel sweeps) would write checkpoints, samples and
the MLflow spill journal into one directory. The CLI therefore claims the directory itself before
Hydra starts: `os.mkdir` either creates it or fails because it exists, atomically, so of several
processes racing for `<time>` exactly one gets it and the others move on to `<time>-1`, `<time>-2`,
... An explicit `hydra.run.dir=` / `hydra.sweep.dir=` is used as given (that is how
`trainer.resume=true` finds an earlier run's checkpoints).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path


def claim(base: Path) -> Path:
    """Create `base`, or else the first free `base-1`, `base-2`, ...; the one created is returned
    and no other caller (thread or process) gets the same."""
    base.parent.mkdir(parents=True, exist_ok=True)
    path, taken = base, 0
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            taken += 1
            path = base.with_name(f"{base.name}-{taken}")


def claim_timestamped(output_root: Path, kind: str, now: datetime | None = None) -> Path:
    """A fresh `<output_root>/<kind>/<date>/<time>[-N]` (kind: runs or sweeps), created."""
    now = now or datetime.now()
    return claim(Path(output_root) / kind / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"))
