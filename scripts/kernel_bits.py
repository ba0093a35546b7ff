"""Which kernel setting changes which bits: a cheap proxy for a training run (issue 32, item 3).

A run at the stressed lr ends a seed's width away when one last bit of one kernel differs
(docs/study-v3.md, "What is not pinned"). Whole runs take minutes per knob; this takes seconds:
on fixed inputs it computes, once, each computation a training step of `model=tiny_pairs` is made
of, and prints a short hash of the exact bytes of each result. Two processes under two
environments that print the same hash for a line computed the same bits there. The first line
says which setting the libraries took (an asked-for one can be ignored: MKL_CBWR=AVX2 on AMD).

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python scripts/kernel_bits.py [--dtype float64] [--mkldnn-off] [--flush-denormal] \\
        [--deterministic] [--threads N]

Lines: gemm (a [512,128]x[128,256] matrix product), softmax / log_softmax / exp / sum of a
[512, V] tensor, sdpa (attention), rmsnorm, silu, multinomial (seeded draws from fixed
probabilities), forward (the model's logits on a fixed batch), backward (the gradients of a
log-prob loss on them), adamw (the weights after one AdamW step at lr 6e-4), generate (tokens
sampled by `generate()` from a fixed seed, T=1, as the study samples).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

WEIGHTS = SRC / "bapo_cli" / "models" / "weights" / "tiny_pairs"


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def setting() -> str:
    """What the environment asked for and what the libraries took: ATen's kernel set, and MKL's
    code branch as MKL_VERBOSE reports it for one SGEMM (MKL_CBWR=AVX2 reads back as AUTO on
    AMD CPUs: MKL honours only COMPATIBLE there; docs/study-v3.md)."""
    probe = "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    env = {**os.environ, "MKL_VERBOSE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    cnr = re.search(r"CNR:(\S+)", done.stdout + done.stderr)
    asked = {k: os.environ.get(k, "-") for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")}
    return (
        f"# asked MKL_CBWR={asked['MKL_CBWR']} ATEN_CPU_CAPABILITY={asked['ATEN_CPU_CAPABILITY']}"
        f"; took MKL {cnr.group(1) if cnr else '?'}, ATen "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--mkldnn-off", action="store_true", help="torch.backends.mkldnn.enabled=0")
    ap.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(1)")
    ap.add_argument("--deterministic", action="store_true", help="use_deterministic_algorithms")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.mkldnn_off:
        torch.backends.mkldnn.enabled = False
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict[str, str] = {}
    # inputs from numpy: torch.randn's own kernel is vectorised per ATEN_CPU_CAPABILITY, so its
    # numbers would change with the setting and hide which computation did
    rng = np.random.default_rng(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape)).to(dtype)

    a, b = randn(512, 128), randn(128, 256)
    out["gemm"] = digest(a @ b)
    x = randn(512, 384) * 4
    out["softmax"] = digest(torch.softmax(x, -1))
    out["log_softmax"] = digest(torch.log_softmax(x, -1))
    out["exp"] = digest(torch.exp(x))
    out["sum"] = digest(x.sum(-1), x.sum())
    q, k, v = (randn(8, 2, 64, 64) for _ in range(3))
    out["sdpa"] = digest(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    h = randn(512, 128)
    out["rmsnorm"] = digest(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    out["silu"] = digest(torch.nn.functional.silu(h))
    logits = rng.standard_normal((512, 384)) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = torch.from_numpy(probs / probs.sum(-1, keepdims=True)).float()
    torch.manual_seed(1)
    out["multinomial"] = digest(torch.multinomial(probs, 1))

    model = AutoModelForCausalLM.from_pretrained(str(WEIGHTS), dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(WEIGHTS))
    vocab = model.config.vocab_size
    ids = torch.from_numpy(rng.integers(3, vocab, (64, 48)))
    logits = model(input_ids=ids).logits
    out["forward"] = digest(logits)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits[:, :-1].to(wide), -1)
    loss = -logp.gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    out["backward"] = digest(*(p.grad for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
    opt.step()
    out["adamw"] = digest(*(p for p in model.parameters()))
    model.eval()
    prompt = torch.tensor([tok("12 7 3 9 ->")["input_ids"]] * 64)
    torch.manual_seed(2)
    with torch.no_grad():
        gen = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            max_new_tokens=40,
            pad_token_id=tok.pad_token_id,
        )
    out["generate"] = digest(gen)
    print(setting())
    for key, value in out.items():
        print(f"{key:<12} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
