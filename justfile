# just --list   — recipes for the common commands (`just` comes with the dev extra: rust-just)

venv := ".venv/bin"

# create .venv with bapo-cli (editable) and dev tools
setup:
    bash scripts/setup.sh

# train with overrides, e.g. `just train algo=grpo staleness=8`
train *OVERRIDES:
    {{venv}}/bapo train {{OVERRIDES}}

# evaluate, e.g. `just eval model.path=Qwen/Qwen2.5-Math-1.5B benchmark=aime24`
eval *OVERRIDES:
    {{venv}}/bapo eval {{OVERRIDES}}

# Hydra multirun, e.g. `just sweep algo.rho0=0.3,0.4,0.5`
sweep *OVERRIDES:
    {{venv}}/bapo train -m {{OVERRIDES}}

# compare the runs of a sweep, e.g. `just report --sweep outputs/sweeps/<date>/<time>`
report *ARGS:
    {{venv}}/bapo report {{ARGS}}

# the README's test command (what CI runs)
test *ARGS:
    {{venv}}/python -m pytest {{ARGS}}

# lint and format check (CI fails on either)
lint:
    {{venv}}/ruff check .
    {{venv}}/ruff format --check .

# speed benchmarks (tables, not tests): loss, grading, rollout engines, training vs TRL
bench:
    {{venv}}/python benchmarks/bench_loss.py
    {{venv}}/python benchmarks/bench_grading.py
    {{venv}}/python benchmarks/bench_rollout.py
    {{venv}}/python benchmarks/bench_train.py

# sync vs real async RL on the tiny model (samples/s, wall time, final reward), e.g. `just bench-async --experiment pairs`
bench-async *ARGS:
    {{venv}}/python benchmarks/bench_async.py {{ARGS}}
