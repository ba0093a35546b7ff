"""Where the configs live: `config_dir()`, the `conf/` directory of the installed package or of the
checkout.

Its own module because both the Hydra wrapper (`hydra_runner`, which composes from it) and the
schema (whose config reference names the algo presets in conf/algo/) need it, and the schema must
not import the wrapper, which imports the schema to register it.
"""

from __future__ import annotations

from pathlib import Path

import bapo_cli


def config_dir() -> Path:
    """The `conf/` directory: inside an installed wheel (bapo_cli/conf), else the checkout's top."""
    package = Path(bapo_cli.__file__).resolve().parent
    for candidate in (package / "conf", package.parents[1] / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"bapo-cli configs not found next to {package} (looked for conf/train.yaml); "
        "reinstall the package"
    )
