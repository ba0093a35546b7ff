"""Every validation rule: one readable line that names the key and what is allowed."""

from __future__ import annotations

import pytest

from bapo_cli.config.preflight import PreflightError, preflight

# (overrides, the line must start with, and must contain)
RULES = [
    (
        ["algo=foo"],
        "algo=foo",
        "valid: bapo, bapo_recipe, ce_gppo, cispo, clip_cov, clip_higher, dapo, dcpo, dppo_kl",
    ),
    (["staleness=3"], "staleness=3", "valid: 0, 1, 2, 4, 8"),
    (["model=nope"], "model=nope", "valid: "),
    (["algo.rho0=abc"], "algo.rho0=abc", "must be a number"),
    (["rollout.n=two"], "rollout.n=two", "must be an integer"),
    (["trainer.resume=maybe"], "trainer.resume=maybe", "true or false"),
    (["algo.rho0=1.5"], "algo.rho0=1.5", "within [0, 1]"),
    (["algo.rho0=-0.1"], "algo.rho0=-0.1", "within [0, 1]"),
    (["algo.low_range=[0.0,0.9]"], "algo.low_range", "(0, 1]"),
    (["algo.low_range=[0.6,1.2]"], "algo.low_range", "(0, 1]"),
    (["algo.high_range=[0.8,3.0]"], "algo.high_range", ">= 1"),
    (["algo.high_range=[3.0,1.2]"], "algo.high_range", "min must be <= max"),
    (["algo.low_range=[0.9,0.6]"], "algo.low_range", "min must be <= max"),
    (["algo.low_range=[0.6]"], "algo.low_range", "[min, max]"),
    (["algo.low_step=0"], "algo.low_step=0", "> 0"),
    (["algo.high_step=-0.05"], "algo.high_step=-0.05", "> 0"),
    (["algo.weighting=sqrt"], "algo.weighting=sqrt", "none, rollout_prob"),
    (["algo.bound_scope=rank"], "algo.bound_scope=rank", "minibatch, microbatch"),
    (["algo.agg=sum"], "algo.agg=sum", "token-mean"),
    (
        ["algo.loss=reinforce"],
        "algo.loss=reinforce",
        "bapo, ce_gppo, cispo, clip_cov, clip_higher, dcpo, dppo_kl, dppo_tv, gspo, kl_cov, "
        "luspo, m2po, minpro, ppo, prime_default, sapo, topr, vcpo, vespo",
    ),
    (["algo.advantage=gae"], "algo.advantage=gae", "drgrpo, grpo, rloo"),
    (["algo.dual_clip=0.5"], "algo.dual_clip=0.5", "> 1"),
    (["algo=grpo", "algo.eps=1.5"], "algo.eps=1.5", "(0, 1)"),
    (["algo=clip_higher", "algo.eps_high=0"], "algo.eps_high=0", "> 0"),
    (["algo=grpo", "algo.rho0=0.3"], "algo.rho0", "unknown key"),
    (["algo.rule=verl"], "algo.rule=verl", "must be one of paper, recipe"),
    (["algo=bapo_recipe", "algo.rho0=2"], "algo.rho0=2", "within [0, 1]"),
    (["algo=gspo", "algo.eps_low=1.5"], "algo.eps_low=1.5", "(0, 1)"),
    (["algo=cispo", "algo.eps_high=0"], "algo.eps_high=0", "> 0"),
    (["algo=sapo", "algo.tau_neg=0"], "algo.tau_neg=0", "> 0"),
    (["algo=sapo", "algo.eps=0.2"], "algo.eps", "unknown key"),
    (["algo=dapo", "algo.overlong_buffer=1.0"], "algo.overlong_buffer=1.0", "within [0, 1)"),
    (["algo=dapo", "algo.overlong_penalty=-1"], "algo.overlong_penalty=-1", ">= 0"),
    (["algo=dapo", "algo.resample_rounds=0"], "algo.resample_rounds=0", "> 0"),
    (
        ["algo=dapo", "staleness=2", "staleness.regime=partial"],
        "algo.dynamic_sampling=True",
        "staleness.regime=reuse, replay or lag",
    ),
    (["staleness.k=-1"], "staleness.k=-1", ">= 0"),
    (["staleness.regime=bogus"], "staleness.regime=bogus", "reuse, replay, partial, lag, async"),
    (["staleness=0", "staleness.regime=replay"], "staleness.regime=replay", "staleness.k >= 1"),
    (["staleness.ppo_epochs=0"], "staleness.ppo_epochs=0", "> 0"),
    (["rollout.n=0"], "rollout.n=0", ">= 1"),
    (["rollout.n=1"], "rollout.n=1", "needs >= 2"),
    (["rollout.temperature=-1"], "rollout.temperature=-1", ">= 0"),
    (["rollout.top_p=0"], "rollout.top_p=0", "(0, 1]"),
    (["rollout.top_k=0"], "rollout.top_k=0", "-1 (off)"),
    (["rollout.max_tokens=0"], "rollout.max_tokens=0", "> 0"),
    (["rollout.tis_cap=0.5"], "rollout.tis_cap=0.5", ">= 1"),
    (["rollout.name=sglang"], "rollout.name=sglang", "auto, hf, vllm"),
    (["rollout.max_tokens=64"], "rollout.max_tokens=64", "< model.max_model_len=64"),
    (
        ["reward.name=js"],
        "reward.name=js",
        "must be one of math, python",
    ),
    (["reward.timeout_s=0"], "reward.timeout_s=0", "> 0"),
    (["reward.workers=0"], "reward.workers=0", "[1, 64]"),
    (["reward.step_budget_s=-1"], "reward.step_budget_s=-1", "> 0"),
    (["trainer.lr=-1e-3"], "trainer.lr=-0.001", "> 0"),
    (["trainer.max_steps=0"], "trainer.max_steps=0", "> 0"),
    (
        ["trainer.prompts_per_step=30", "staleness=4"],
        "trainer.prompts_per_step=30",
        "staleness.k=4",
    ),
    (["trainer.val_every=5"], "trainer.val_benchmarks", "at least one benchmark"),
    (["trainer.strategy=zero3"], "trainer.strategy=zero3", "ddp, fsdp2"),
    (["trainer.precision=fp8"], "trainer.precision=fp8", "mixed, pure"),
    (["trainer.dist_timeout_min=0"], "trainer.dist_timeout_min=0", "> 0"),
    (["trainer.keep_last=0"], "trainer.keep_last=0", ">= 1 (or null to keep all)"),
    (
        ["trainer.strategy=fsdp2", "staleness.regime=partial"],
        "trainer.strategy=fsdp2",
        "use trainer.strategy=ddp with staleness.regime=partial",
    ),
    (["trainer.grad_clip=0"], "trainer.grad_clip=0", "> 0"),
    (["model.dtype=fp8"], "model.dtype=fp8", "auto, float32, bfloat16, float16"),
    (["model.device=tpu"], "model.device=tpu", "auto, cpu, cuda"),
    (["model=qwen2.5-math-1.5b", "model.path=tiny"], "model.tiny", "model=tiny"),
    (["model.tiny.num_kv_heads=3"], "model.tiny.num_kv_heads=3", "divide num_heads"),
    (["model.tiny.sft_steps=0"], "model.tiny.sft_steps=0", "> 0"),
    (["data.kind=dataset"], "data.path", "data.path or data.hf_id"),
    (["data.template=no-placeholder"], "data.template=no-placeholder", "{problem}"),
    (["tracking.backends=[comet]"], "tracking.backends=comet", "mlflow, wandb, tensorboard"),
    (["tracking.backends=[wandb,wandb]"], "tracking.backends", "names a backend twice"),
    (
        ["tracking=wandb", "tracking.wandb.mode=cloud"],
        "tracking.wandb.mode=cloud",
        "online, offline",
    ),
    (["tracking.backends=[mlflow]", "tracking.uri="], "tracking.uri", "when mlflow is on"),
    (["nosuchkey=1"], "nosuchkey", "unknown key"),
    (["algo.nosuchkey=1"], "algo.nosuchkey", "unknown key"),
]


@pytest.mark.parametrize(("overrides", "starts", "contains"), RULES)
def test_rule_names_key_and_allowed_values(overrides, starts, contains) -> None:
    with pytest.raises(PreflightError) as info:
        preflight("train", overrides)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(starts), line
    assert contains in line, line


EVAL_RULES = [
    (
        ["benchmark=aime26"],
        "benchmark=aime26",
        "valid: aime24, aime25, amc23, math500, minerva_math, olympiadbench",
    ),
    (["reward.workers=100"], "reward.workers=100", "[1, 64]"),
    (["eval.n=0"], "eval.n=0", ">= 1"),
    (["eval.limit=0"], "eval.limit=0", ">= 1"),
    (["eval.top_p=2"], "eval.top_p=2", "(0, 1]"),
    (
        ["benchmark.path=null", "benchmark.hf_id=null"],
        "benchmark.path",
        "benchmark.path or benchmark.hf_id",
    ),
]


@pytest.mark.parametrize(("overrides", "starts", "contains"), EVAL_RULES)
def test_eval_rule_names_key(overrides, starts, contains) -> None:
    with pytest.raises(PreflightError) as info:
        preflight("eval", overrides)
    assert str(info.value).startswith(starts), str(info.value)
    assert contains in str(info.value)


def test_sweep_is_validated_job_by_job_before_any_starts() -> None:
    with pytest.raises(PreflightError) as info:
        preflight("train", ["algo.rho0=0.3,1.5"], multirun=True)
    assert str(info.value).startswith("algo.rho0=1.5")
    with pytest.raises(PreflightError) as info:
        preflight("train", ["algo=bapo,foo"], multirun=True)
    assert str(info.value).startswith("algo=foo: unknown option")


def test_unknown_launcher_plugin_says_what_to_install() -> None:
    # a launcher that no installed plugin provides (the extras bring joblib and submitit)
    with pytest.raises(PreflightError) as info:
        preflight("train", ["hydra/launcher=ray_aws"], multirun=True)
    assert str(info.value).startswith("hydra/launcher=ray_aws: no such option")
    assert "pip install 'bapo-cli[sweep or slurm]'" in str(info.value)


def test_reward_group_sets_the_graders_limits() -> None:
    reward = preflight("train", ["reward.timeout_s=2", "reward.step_budget_s=null"]).config.reward
    assert (reward.name, reward.timeout_s, reward.workers, reward.step_budget_s) == (
        "math",
        2.0,
        4,
        None,
    )
    assert preflight("eval", ["reward.workers=2"]).config.reward.workers == 2


def test_a_step_that_cannot_fit_in_memory_is_refused() -> None:
    from bapo_cli.config.preflight import STEP_BYTES_PER_TOKEN, step_memory_error

    cfg = preflight("train", ["trainer.prompts_per_step=64", "rollout.n=8"]).config
    need = 64 * 8 * cfg.rollout.max_tokens * STEP_BYTES_PER_TOKEN
    assert step_memory_error(cfg, need) is None
    line = step_memory_error(cfg, need - 1)
    assert line is not None and "\n" not in line
    assert line.startswith("trainer.prompts_per_step=64 × rollout.n=8 × rollout.max_tokens=16:")
    assert step_memory_error(cfg, None) is None  # memory unknown: nothing to compare with


def test_absurd_sizes_fail_before_any_model_is_loaded(tmp_path) -> None:
    import time

    from tests.conftest import run_bapo

    for overrides, starts in [
        (["rollout.max_tokens=64"], "error: rollout.max_tokens=64: must be < model.max_model_len"),
        (
            ["trainer.prompts_per_step=4000000", "rollout.n=1000", "rollout.max_tokens=32"],
            "error: trainer.prompts_per_step=4000000 × rollout.n=1000 × rollout.max_tokens=32: ",
        ),
    ]:
        t0 = time.perf_counter()
        # a model path that does not exist: loading it would fail with another message
        done = run_bapo("train", *overrides, f"model.path={tmp_path}/no-model", "tracking=none")
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(starts), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        assert time.perf_counter() - t0 < 60
