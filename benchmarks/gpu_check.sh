#!/usr/bin/env bash
# The GPU checks, as one short script for a lent CUDA machine with PyTorch + transformers but no
# internet and no vLLM: the loss speed, `bapo train` on CUDA (one process in mixed and pure
# precision, DDP and FSDP2 on NCCL), an FSDP2 checkpoint + resume, and one optimizer update on a
# 0.5B-shaped model (mixed vs pure bf16 vs FSDP2; PPO vs BAPO), and one update of a 1.5B-shaped
# model on 8 x 4096 response tokens with full-vocabulary logits vs chunked log-probs. With vLLM
# built for CUDA (not on the machines lent so far): async RL on a vLLM server on the GPU with
# filesystem weights, and vLLM's NCCL weight push checked by log-probs (two GPUs).
#
# Needs beside the repo: .gpu/whl/*.whl (hydra-core, omegaconf, antlr4 4.9.3, math-verify,
# latex2sympy2_extended: pure-Python wheels) and .gpu/cache (the tiny model, BAPO_CACHE_DIR).
# Writes its logs under $OUT (default ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 COLUMNS=160
export BAPO_CACHE_DIR=$PWD/.gpu/cache BAPO_OUTPUT_ROOT=/tmp/bapo_out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

step() { echo; echo "=== $1 ($(date +%T))"; }
TRAIN=(experiment=smoke tracking=none trainer.max_steps=20 trainer.prompts_per_step=32 rollout.n=8
       trainer.micro_batch_size=64 algo=bapo staleness=2)

step "loss speed (bench_loss, cuda)"
timeout 120 python3 benchmarks/bench_loss.py --device cuda --repeats 20 2>&1 | tee "$OUT/bench_loss.txt"

step "bapo train, one process (mixed: fp32 weights, bf16 autocast)"
timeout 150 python3 -m bapo_cli train "${TRAIN[@]}" hydra.run.dir=/tmp/r_single 2>&1 \
    | tee "$OUT/train_single.txt" | tail -25
step "bapo train, one process, trainer.precision=pure (bf16 weights)"
timeout 150 python3 -m bapo_cli train "${TRAIN[@]}" trainer.precision=pure \
    hydra.run.dir=/tmp/r_pure 2>&1 | tee "$OUT/train_pure.txt" | tail -14
step "bapo train --nproc 1, DDP on NCCL"
timeout 150 python3 -m bapo_cli train --nproc 1 "${TRAIN[@]}" hydra.run.dir=/tmp/r_ddp 2>&1 \
    | tee "$OUT/train_ddp.txt" | tail -25
step "bapo train --nproc 1, FSDP2 on NCCL (fp32 master, bf16 compute), checkpoint at 10 and 20"
timeout 150 python3 -m bapo_cli train --nproc 1 "${TRAIN[@]}" trainer.strategy=fsdp2 \
    trainer.save_every=10 hydra.run.dir=/tmp/r_fsdp 2>&1 | tee "$OUT/train_fsdp2.txt" | tail -25
step "FSDP2 resume from step 10 into a new run dir: step 20 must equal the unbroken run"
mkdir -p /tmp/r_resume/checkpoints && cp -r /tmp/r_fsdp/checkpoints/step_000010 /tmp/r_resume/checkpoints/
timeout 150 python3 -m bapo_cli train --nproc 1 "${TRAIN[@]}" trainer.strategy=fsdp2 \
    trainer.save_every=10 trainer.resume=true hydra.run.dir=/tmp/r_resume 2>&1 | tail -5
python3 - <<'EOF' 2>&1 | tee "$OUT/compare.txt"
import torch
def last(d):
    s = torch.load(f"{d}/checkpoints/step_000020/trainer_state.pt", weights_only=False)
    return {k: v for k, v in s["state"]["history"][-1].items() if not k.startswith("perf/")}
runs = {n: last(f"/tmp/r_{n}") for n in ("single", "pure", "ddp", "fsdp", "resume")}
for key in ("reward/mean", "actor/entropy", "actor/c_low", "actor/c_high", "bapo/rho"):
    print(key, {n: round(m.get(key, float("nan")), 6) for n, m in runs.items()})
print("single == ddp (same math):", runs["single"] == runs["ddp"])
for n in ("single", "pure", "fsdp"):
    s = torch.load(f"/tmp/r_{n}/checkpoints/step_000020/trainer_state.pt", weights_only=False)
    steps = [h["perf/step_s"] for h in s["state"]["history"][5:]]
    print(n, "median step s (steps 6-20):", round(sorted(steps)[len(steps) // 2], 4))
print("fsdp2 resume == unbroken:", runs["fsdp"] == runs["resume"])
EOF

step "one optimizer update, Qwen2 0.5B shape, one process, mixed precision"
timeout 200 python3 benchmarks/bench_update.py --shape 0.5b --repeats 3 2>&1 | tee "$OUT/update_single.txt"
step "one optimizer update, Qwen2 0.5B shape, one process, pure bf16 weights"
timeout 200 python3 benchmarks/bench_update.py --shape 0.5b --repeats 3 --precision pure 2>&1 \
    | tee "$OUT/update_pure.txt"
step "one optimizer update, Qwen2 0.5B shape, FSDP2 (NCCL, 1 rank), fp32 master + bf16 compute"
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/bench_update.py --shape 0.5b --strategy fsdp2 --repeats 3 2>&1 \
    | tee "$OUT/update_fsdp2.txt"
step "one update, Qwen2.5-1.5B shape, 8 responses x 4096 tokens, bf16 autocast: full-vocabulary logits vs chunked log-probs (issue 26)"
timeout 200 python3 benchmarks/bench_memory.py --device cuda --shape 1.5b --grad-ckpt --no-trl \
    --only length --responses 8 --lengths 4096 --old-max 32768 --threads 8 2>&1 \
    | tee "$OUT/memory_1p5b.txt"
# ---- generation servers: these need vLLM built for CUDA, which the lent machines so far lacked
# (NEVER RUN: docs/engines.md); skipped when `import vllm` fails.
if python3 -c "import vllm" 2>/dev/null; then
    step "async on a vLLM server on this GPU, filesystem weights (requires vLLM on CUDA)"
    PORT=8011
    python3 -m bapo_cli serve model.max_model_len=256 rollout.gpu_memory_utilization=0.3 \
        --port $PORT > "$OUT/serve.txt" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 2; done
    timeout 300 python3 -m bapo_cli train "${TRAIN[@]}" model.device=cuda model.max_model_len=256 \
        staleness.regime=async staleness.weights=filesystem rollout.servers=[http://127.0.0.1:$PORT] \
        hydra.run.dir=/tmp/r_servers 2>&1 | tee "$OUT/train_servers.txt" | tail -20
    python3 - <<'PY' 2>&1 | tee "$OUT/servers_probe.txt"
import torch
s = torch.load("/tmp/r_servers/checkpoints/step_000020/trainer_state.pt", weights_only=False)
h = s["state"]["history"]
print("probe |server - trainer| per step:", [round(x.get("servers/probe_abs_diff_max", -1), 5) for x in h])
print("staleness max / response max:", max(x["staleness/max"] for x in h), max(x["staleness/trajectory_max"] for x in h))
print("push s (median):", sorted(x["servers/push_s"] for x in h if "servers/push_s" in x)[len(h) // 4])
PY
    kill $SERVE_PID; wait $SERVE_PID 2>/dev/null
    step "NCCL weight push, checked by log-probs (requires vLLM on CUDA and 2 GPUs)"
    timeout 600 python3 benchmarks/gpu_nccl_push.py --port 8012 2>&1 | tee "$OUT/nccl_push.txt"
else
    step "generation servers: skipped (vLLM is not installed for CUDA here)"
fi
step "done"
