"""The tiny model: a ~0.3M-parameter Qwen2 built locally and warmed up on a synthetic task.

`bapo train` (model=tiny) needs no download: the presets `model=tiny` and `model=tiny_pairs` load
warmed-up weights that ship inside the package (`models/weights/<name>/`, made by
`python -m bapo_cli.launch.testbed build <name>`, recorded in its `build_info.json`). Any other
settings are built on first use: `ensure_tiny` builds a character-level tokenizer and a small
Qwen2 (head_dim 64, since vLLM's CPU attention rejects 16), then runs a supervised warm-up of
exactly `sft_steps` steps on the task `model.tiny.task` names -- a weak but non-zero start, like the
SFT checkpoints the paper starts RL from.

The warm-up stops by step count, never by an accuracy threshold or a time budget: it once stopped
at the first held-out check reaching a target accuracy, and a threshold on a noisy measurement
turns tiny floating-point differences between machines into a different stopping step (1,000
steps on one machine, 1,600 on another, for the same config) and so a different model. Held-out
greedy accuracy is still measured every `eval_every` steps, for the record only.

    task=arith   (default) `data.tasks.ArithTask`: prompt "37+45=", target the answer "82"
    task=pairs   `data.pairs.PairTask`: prompt "318596:?+?=12!", target a random-order search
                 trace cut at PAIRS_MAX_TOKENS (no <eos> when cut): the model learns the format,
                 the sums and when to stop, not which pair to try first (model=tiny_pairs)

The result is an ordinary HF directory (config.json, model.safetensors, tokenizer.json, ...), so
`AutoModelForCausalLM` / `AutoTokenizer` and vLLM load it like any other model. A built one is
cached under

    $BAPO_CACHE_DIR/tiny/<key>      (default root: $XDG_CACHE_HOME/bapo-cli or ~/.cache/bapo-cli)

where <key> hashes the settings and `BUILD_VERSION`; a missing entry is rebuilt. The build is
deterministic for its settings on one machine (one torch thread, deterministic algorithms, fixed
seeds): same settings, torch and CPU kernels -> the same weights bit for bit. Across machines the
CPU kernels (MKL's GEMM, torch's vectorised reductions chosen by instruction set) round
differently; `launch/testbed.py` pins them for the shipped builds. The build runs in a temporary
sibling that is renamed into place after `COMPLETE_MARKER` is written, under a file lock, so a kill
or two concurrent builds never leave a half-written entry.

The tokenizer prepends <bos> itself (its post-processor), so HF and vLLM, both encoding the prompt
text with special tokens, see the same ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_cli.config.schema.model import WARMUP_TASK_NAMES
from bapo_cli.data.pairs import (
    PAIRS_MAX_TOKENS,
    PAIRS_TEMPLATE,
    PairTask,
    pairs_reward,
    search_trace,
)
from bapo_cli.data.tasks import ARITH_TEMPLATE, ArithTask, Problem

BUILD_VERSION = 2
"""Bump when the architecture, tokenizer or warm-up recipe changes: old cache entries go stale.
2: the warm-up runs exactly `sft_steps` (1 stopped at a held-out accuracy target)."""

COMPLETE_MARKER = "COMPLETE"
BUILD_INFO = "build_info.json"
SHIPPED_ROOT = Path(__file__).resolve().parent / "weights"
"""The warmed-up builds that ship with the package, one directory per preset name."""
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
"""Four special tokens, then one token per byte: ASCII character c has id 4 + ord(c)."""
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer split (with no merges it only decides where nothing can merge)."""
MAX_POSITIONS = 256
EVAL_EVERY = 20
"""Warm-up steps between held-out accuracy checks (arith; `WarmupTask.eval_every`)."""
EVAL_SIZE = 512
MAX_ANSWER_TOKENS = 6
"""Greedy budget of the arith warm-up check (the longest answer, "-89"/"891", plus <eos>)."""
BUILD_THREADS = 1
"""Torch threads during the build: the weights then do not depend on the machine's core count,
and a model this small gains little from more (on a busy 2-core machine one thread ran a warm-up
step in 96 ms, two threads in 510 ms)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupTask:
    """What the warm-up needs of a task: its generator, prompt, SFT targets and grading."""

    make: Callable[[int], Any]
    """seed -> generator with `sample(n, rng, split=...)` and `held_out(n)` (ArithTask's shape)."""
    template: str
    max_new_tokens: int
    """Greedy budget of the accuracy check; SFT targets longer than this are cut (no <eos>)."""
    target: Callable[[Problem, random.Random], str]
    """The response the model imitates (may draw from the warm-up's rng)."""
    correct: Callable[[str, str], bool]
    """(answer text up to <eos>, reference answer) -> right?"""
    eval_every: int
    """Warm-up steps between held-out accuracy checks (recorded; they never stop the warm-up)."""
    kv_cache: bool
    """Decode with a KV cache. arith keeps the full re-forward its recorded accuracies were
    measured with; pairs' 48-token answers need the cache."""


WARMUP_TASKS: dict[str, WarmupTask] = {
    "arith": WarmupTask(
        ArithTask,
        ARITH_TEMPLATE,
        MAX_ANSWER_TOKENS,
        lambda p, rng: p.answer,
        str.__eq__,
        eval_every=EVAL_EVERY,
        kv_cache=False,
    ),
    "pairs": WarmupTask(
        PairTask,
        PAIRS_TEMPLATE,
        PAIRS_MAX_TOKENS,
        lambda p, rng: search_trace(p.question, rng),
        lambda text, answer: pairs_reward(text, answer) > 0,
        eval_every=100,  # a check of 512 40-token answers costs ~10 training steps
        kv_cache=True,
    ),
}
"""`model.tiny.task` -> how to warm up on it. The keys are the values TinyModelConfig.task accepts,
`WARMUP_TASK_NAMES` of config (a layer below models, so the names live there): a task added here
must be named there too, or config refuses it; checked when this module loads."""
if tuple(WARMUP_TASKS) != WARMUP_TASK_NAMES:
    raise ImportError(
        f"models.tiny.WARMUP_TASKS has {tuple(WARMUP_TASKS)}, but config.schema.model."
        f"WARMUP_TASK_NAMES (what model.tiny.task accepts) is {WARMUP_TASK_NAMES}"
    )
DEFAULT_TASK = "arith"


# ------------------------------------------------------------------------------------ tokenizer


def byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE uses for the bytes 0..255 (GPT-2's `bytes_to_unicode`):
    printable bytes stand for themselves, the others are shifted above U+0100 (space -> 'Ġ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def build_tokenizer() -> Any:
    """A byte-level `PreTrainedTokenizerFast` with no merges: one token per byte, <bos> prepended.

    Every ASCII character is one token (id 4 + its code) and any other text round-trips as its
    UTF-8 bytes, so nothing is ever unknown (<unk> exists but is never produced). The pipeline is
    exactly Qwen2's (NFC, Qwen2's split regex, byte-level): transformers 5 loads a `qwen2`
    checkpoint's tokenizer as `Qwen2Tokenizer` whatever class the directory names, rebuilding
    that pipeline around the saved vocabulary -- so HF, vLLM and this function agree on the ids.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *byte_alphabet()))}
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=MAX_POSITIONS,
    )


# ---------------------------------------------------------------------------------------- model


def settings_of(cfg: Any) -> dict[str, Any]:
    """The tiny settings as a plain dict (from the dataclass or Hydra's DictConfig)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def build_key(cfg: Any) -> str:
    """Cache key: a hash of every tiny setting and `BUILD_VERSION` (also what names a shipped
    build: a preset loads the shipped weights only while its settings are exactly theirs)."""
    blob = json.dumps({"build_version": BUILD_VERSION, **settings_of(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shipped_builds(root: Path = SHIPPED_ROOT) -> dict[str, Path]:
    """build key -> directory of every warmed-up build shipped under `root` (not the hidden
    temporary folder of a rebuild in progress)."""
    out = {}
    for info in sorted(root.glob(f"*/{BUILD_INFO}")):
        if not info.parent.name.startswith("."):
            out[json.loads(info.read_text())["key"]] = info.parent
    return out


def shipped_dir(cfg: Any, root: Path = SHIPPED_ROOT) -> Path | None:
    """The shipped build of exactly these settings, if one ships (else None: build it)."""
    return shipped_builds(root).get(build_key(cfg))


def cache_root(cache_dir: Path | None = None) -> Path:
    """`cache_dir`, else $BAPO_CACHE_DIR, else $XDG_CACHE_HOME/bapo-cli, else ~/.cache/bapo-cli."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("BAPO_CACHE_DIR"):
        return Path(os.environ["BAPO_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "bapo-cli"


def tiny_dir(cfg: Any, cache_dir: Path | None = None) -> Path:
    """Where the tiny model of these settings lives (whether or not it is built yet)."""
    return cache_root(cache_dir) / "tiny" / build_key(cfg)


def is_complete(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


def build_config(cfg: Any) -> Any:
    """The Qwen2Config of the tiny settings (tied embeddings, vocabulary of the char tokenizer)."""
    from transformers import Qwen2Config

    s = settings_of(cfg)
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def ensure_tiny(cfg: Any, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The directory of the warmed-up tiny model for `cfg` (a `TinyModelConfig`), built if missing.

    The shipped build of these settings (`model=tiny`, `model=tiny_pairs`) returns at once, as
    does a complete cache entry; otherwise the model is built under a file lock (a second process
    waits and then finds it built) and moved into place only when complete.
    """
    from filelock import FileLock

    shipped = shipped_dir(cfg)
    if shipped is not None:
        return shipped
    final = tiny_dir(cfg, cache_dir)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if is_complete(final):
            return final
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            build_tiny(cfg, tmp, progress=progress)
            if final.exists():  # an entry without its marker: left by an older, killed build
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_tiny(cfg: Any, directory: Path, *, progress: bool = True) -> dict[str, Any]:
    """Initialise, warm up and save the tiny model into `directory`; returns the build info.

    One torch thread (a reduction split over threads sums in another order) and deterministic
    algorithms, both restored afterwards: the weights then depend on the settings, torch and the
    CPU's kernels, not on the core count or the load."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        return _build(cfg, directory, progress=progress)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _build(cfg: Any, directory: Path, *, progress: bool) -> dict[str, Any]:
    from transformers import Qwen2ForCausalLM

    s = settings_of(cfg)
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    config = build_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s["seed"])
        model = Qwen2ForCausalLM(config)
    # ids only: vLLM takes sampling defaults from generation_config.json, so set none
    model.generation_config.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    result = warm_up(model, tokenizer, cfg, progress=progress)
    seconds = time.perf_counter() - started
    import transformers

    info = {
        "key": build_key(cfg),
        "settings": s,
        "build_version": BUILD_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(seconds, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": BUILD_THREADS,
        "deterministic_algorithms": True,
        **result,
    }
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    (directory / COMPLETE_MARKER).write_text(f"{BUILD_VERSION}\n")
    return info


# -------------------------------------------------------------------------------------- warm-up


def _sft_batch(
    tokenizer: Any, problems: list[Problem], task: WarmupTask, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded <bos> prompt target <eos> with labels on the target and <eos> only; a target
    longer than the task's budget is cut there, without <eos> (it ran out of tokens)."""
    prompts = tokenizer([task.template.format(problem=p.question) for p in problems]).input_ids
    targets = [task.target(p, rng) for p in problems]
    answers = tokenizer(targets, add_special_tokens=False).input_ids
    ends = [[EOS_ID] if len(a) < task.max_new_tokens else [] for a in answers]
    answers = [a[: task.max_new_tokens] for a in answers]
    width = max(len(q) + len(a) + len(e) for q, a, e in zip(prompts, answers, ends, strict=True))
    ids = torch.full((len(problems), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(problems), width), -100, dtype=torch.long)
    for row, (q, a, e) in enumerate(zip(prompts, answers, ends, strict=True)):
        seq = q + a + e
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(q) : len(seq)] = torch.tensor(a + e)
    return ids, labels


@torch.no_grad()
def greedy_accuracy(
    model: Any, tokenizer: Any, problems: list[Problem], task: str = DEFAULT_TASK
) -> float:
    """Share of problems whose greedy answer (up to <eos>, within the task's budget) is right;
    a run-on (no <eos>) is wrong."""
    spec = WARMUP_TASKS[task]
    answers = greedy_answers(model, tokenizer, problems, task)
    correct = sum(
        ended and spec.correct(text, p.answer)
        for (text, ended), p in zip(answers, problems, strict=True)
    )
    return correct / max(len(problems), 1)


@torch.no_grad()
def greedy_answers(
    model: Any, tokenizer: Any, problems: list[Problem], task: str = DEFAULT_TASK
) -> list[tuple[str, bool]]:
    """(greedy text up to <eos> or the task's budget, whether it ended with <eos>) per problem.

    Prompts are grouped by length, so no padding is needed and each forward is the computation an
    engine does for a single prompt (positions from 0 at <bos>).
    """
    spec = WARMUP_TASKS[task]
    was_training = model.training
    model.eval()
    encoded = tokenizer([spec.template.format(problem=p.question) for p in problems]).input_ids
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out: list[tuple[str, bool]] = [("", False)] * len(problems)
    for rows in by_length.values():
        generated = _greedy(model, torch.tensor([encoded[i] for i in rows]), spec)
        for row, tokens in zip(rows, generated, strict=True):
            ended = EOS_ID in tokens
            kept = tokens[: tokens.index(EOS_ID)] if ended else tokens
            out[row] = (tokenizer.decode(kept, skip_special_tokens=False), ended)
    model.train(was_training)
    return out


def _greedy(model: Any, seqs: torch.Tensor, spec: WarmupTask) -> list[list[int]]:
    """Greedy continuations (padded with <pad> after <eos>) of equal-length prompts."""
    done = torch.zeros(len(seqs), dtype=torch.bool)
    out, past, step_input = [], None, seqs
    for _ in range(spec.max_new_tokens):
        if spec.kv_cache:
            result = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
        else:
            result = model(input_ids=seqs, use_cache=False)
        nxt = result.logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
        out.append(nxt)
        done |= nxt == EOS_ID
        seqs, step_input = torch.cat([seqs, nxt[:, None]], dim=1), nxt[:, None]
        if bool(done.all()):
            break
    return torch.stack(out, dim=1).tolist()


def warm_up(model: Any, tokenizer: Any, cfg: Any, *, progress: bool = True) -> dict[str, Any]:
    """Supervised warm-up of exactly `sft_steps` steps (see the module docstring for why).

    Returns steps, the final held-out greedy accuracy, seconds per step and the accuracy history
    [(step, acc), ...] (checked every `eval_every` steps and after the last).
    """
    s = settings_of(cfg)
    name = s.get("task", DEFAULT_TASK)
    spec = WARMUP_TASKS[name]
    task = spec.make(s["seed"])
    held_out = task.held_out(EVAL_SIZE)
    rng = random.Random(s["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["sft_lr"])
    steps = s["sft_steps"]
    history: list[tuple[int, float]] = []
    acc, loss_value, step = 0.0, float("nan"), 0
    train_seconds = 0.0
    model.train()
    with _progress(progress, steps) as update:
        while step < steps:
            t0 = time.perf_counter()
            ids, labels = _sft_batch(tokenizer, task.sample(s["sft_batch_size"], rng), spec, rng)
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            train_seconds += time.perf_counter() - t0
            step += 1
            loss_value = loss.item()
            if step % spec.eval_every == 0 or step == steps:
                acc = greedy_accuracy(model, tokenizer, held_out, name)
                history.append((step, acc))
            update(step, loss_value, acc)
    model.eval()
    return {
        "steps": step,
        "accuracy": acc,
        "final_loss": round(loss_value, 4),
        "ms_per_step": round(1000 * train_seconds / max(step, 1), 1),
        "history": history,
    }


class _progress:
    """A rich progress bar over the warm-up's steps (or nothing when disabled)."""

    def __init__(self, enabled: bool, steps: int) -> None:
        self.enabled, self.steps = enabled, steps
        self.bar: Any = None

    def __enter__(self):
        if not self.enabled:
            return lambda step, loss, acc: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("building tiny model: warm-up"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            TextColumn("held-out acc {task.fields[acc]:.2f}  loss {task.fields[loss]:.3f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task("sft", total=self.steps, acc=0.0, loss=float("nan"))

        def update(step: int, loss: float, acc: float) -> None:
            self.bar.update(task, completed=step, acc=acc, loss=loss)

        return update

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
