"""LoRA in the real loop (tiny model, hf engine): only the adapters train and are optimised,
checkpoints hold the adapter, resume continues like an unbroken run, `bapo merge-lora` writes a
plain model equal to the adapted one. (DDP with LoRA: tests/train/test_multinode.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.trainer import checkpoint
from tests.conftest import run_bapo
from tests.train.conftest import run_train

LORA = ("model.lora.rank=4", "model.lora.alpha=16", "trainer.lr=5e-3", "algo=bapo")


def _no_perf(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in history]


def test_only_adapters_train_and_the_checkpoint_holds_the_adapter(tmp_path: Path) -> None:
    result = run_train(tmp_path, *LORA, "trainer.max_steps=2")
    ckpt = result.checkpoint
    assert (ckpt / "adapter_config.json").is_file() and (
        ckpt / "adapter_model.safetensors"
    ).is_file()
    assert not (ckpt / "model.safetensors").exists()  # the base stays where model.path points
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B moved off 0
    # the optimizer holds the adapters alone: one AdamW state per adapter tensor
    state = checkpoint.load_state(ckpt)
    optim = state["optimizer"]
    assert len(optim["param_groups"][0]["params"]) == len(adapter)
    assert {tuple(s["exp_avg"].shape) for s in optim["state"].values()} == {
        tuple(v.shape) for v in adapter.values()
    }
    assert all("bapo/rho" in h for h in result.history)  # BAPO's search ran on every step
    # the base weights did not move: the trained policy minus its adapters is the base model
    trained, _ = models.load_checkpoint(ckpt)  # merged on load
    base, _ = models.load_policy(run_train_cfg().model)
    wrapped = lora.load_adapter(base, ckpt)
    for name, p in wrapped.get_base_model().named_parameters():
        if "base_layer" in name or "lora_" in name:
            continue
        assert torch.equal(p, dict(trained.named_parameters())[name]), name


def run_train_cfg():
    from bapo_cli.config.preflight import preflight

    return preflight("train", []).config


@pytest.mark.slow
def test_resume_continues_like_an_unbroken_run_and_merge_lora_writes_a_plain_model(
    tmp_path: Path,
) -> None:
    args = (*LORA, "trainer.max_steps=3", "trainer.save_every=1")
    whole = run_train(tmp_path, *args, name="whole")
    root = whole.run_dir / "checkpoints"
    killed = checkpoint.step_dir(tmp_path / "killed" / "checkpoints", 2)
    shutil.copytree(checkpoint.step_dir(root, 2), killed)
    resumed = run_train(tmp_path, *args, "trainer.resume=true", name="killed")
    assert _no_perf(resumed.history) == _no_perf(whole.history)
    a = load_file(checkpoint.step_dir(root, 3) / "adapter_model.safetensors")
    b = load_file(resumed.checkpoint / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    out = tmp_path / "merged"
    done = run_bapo("merge-lora", str(resumed.checkpoint), str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    plain, _ = models.load_checkpoint(out)
    adapted, _ = models.load_checkpoint(resumed.checkpoint)
    assert not lora.is_lora(plain)
    for (n, p), (m, q) in zip(plain.named_parameters(), adapted.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    refused = run_bapo("merge-lora", str(out), str(tmp_path / "again"))
    assert refused.returncode == 2 and "not a LoRA checkpoint" in refused.stderr


def test_lora_with_the_async_worker_is_refused_in_one_line(tmp_path: Path) -> None:
    """At the config check, before anything is written (the worker process takes no adapter;
    generation servers take the merged weights: tests/servers/test_eval_watch.py)."""
    from bapo_cli.config.preflight import PreflightError

    with pytest.raises(PreflightError) as err:
        run_train(tmp_path / "run", *LORA, "staleness.regime=async")
    assert str(err.value).startswith("model.lora.rank=4: with staleness.regime=async needs ")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_the_plan_says_lora_is_on(tmp_path: Path) -> None:
    from bapo_cli.config.preflight import preflight
    from bapo_cli.launch import plan

    rows = dict(plan.train_rows(preflight("train", list(LORA)).config, tmp_path))
    assert rows["model"].endswith("(tiny), LoRA r=4 alpha=16 on all-linear")
    assert "LoRA" not in dict(plan.train_rows(run_train_cfg(), tmp_path))["model"]
