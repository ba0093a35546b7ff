"""Hostile or broken adapter checkpoints, and absurd LoRA settings, cost one line before any
weight loads (issue 33, items 5 and 10).

An adapter's `base_model_name_or_path` is resolved once: itself, a cycle or a chain through
another adapter are refused (they recursed until RecursionError, ~3,000 lines). Invalid JSON,
NaN, `r: 1e14` (PEFT tried to allocate 512 TB), `lora_alpha: 1e308`, a weights header that lies:
one `LoraError` line naming the file and the field. `model.lora.rank` / `.alpha` have the same
bounds at config check, and `model.lora.target_modules` is matched against the model built on
the meta device (no weights) before it loads.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.config.schema import LoraConfig, ModelConfig
from bapo_cli.models import adapters, loading, lora
from tests.conftest import run_bapo

CONFIG = adapters.ADAPTER_CONFIG
WEIGHTS = adapters.ADAPTER_WEIGHTS


def copy_adapter(src: Path, dst: Path, **changes) -> Path:
    """A copy of the adapter with `changes` written into its adapter_config.json."""
    shutil.copytree(src, dst)
    if changes:
        config = json.loads((dst / CONFIG).read_text())
        config.update(changes)
        (dst / CONFIG).write_text(json.dumps(config))
    return dst


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, loading.ModelLoadError)  # exit 2, 1 line
    return text


def refused(directory: Path, *, base: Path | None = None) -> str:
    """The error of loading `directory` as a policy (model.path=ADAPTER: bapo eval, a resume
    without LoRA): always before any weights load, since the base named is unreadable."""
    with pytest.raises(lora.LoraError) as err:
        loading.load_checkpoint(directory)
    return one_line(err)


@pytest.fixture()
def broken_base(tmp_path: Path, lora_files) -> Path:
    """The base model with weights that cannot be read: an error about the adapter, not the
    load, shows the check came first."""
    base, _ = lora_files
    broken = tmp_path / "broken-base"
    shutil.copytree(base, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    return broken


# --------------------------------------------------------------------------- base resolution


def test_a_base_naming_the_adapter_itself_is_one_line(tmp_path, lora_files) -> None:
    _, adapter = lora_files
    me = copy_adapter(adapter, tmp_path / "me")
    for spelling in (str(me), str(me) + "/", str(me / ".." / "me")):
        copy = json.loads((me / CONFIG).read_text()) | {"base_model_name_or_path": spelling}
        (me / CONFIG).write_text(json.dumps(copy))
        text = refused(me)
        assert text.startswith(f"{me / CONFIG}: base_model_name_or_path=")
        assert "names the adapter's own directory" in text


def test_a_cycle_of_adapters_is_one_line(tmp_path, lora_files) -> None:
    _, adapter = lora_files
    a, b = tmp_path / "a", tmp_path / "b"
    copy_adapter(adapter, a, base_model_name_or_path=str(b))
    copy_adapter(adapter, b, base_model_name_or_path=str(a))
    text = refused(a)
    assert text.startswith(f"{a / CONFIG}: base_model_name_or_path={b}: is itself a LoRA adapter")
    assert f"bapo merge-lora {b} MERGED" in text
    # the same through the policy loader a resume without LoRA and `bapo eval` use
    with pytest.raises(lora.LoraError) as err:
        loading.load_policy(ModelConfig(path=str(b), device="cpu", dtype="float32"))
    assert one_line(err).startswith(f"{b / CONFIG}: base_model_name_or_path={a}:")


def test_a_chain_is_refused_and_base_overrides_are_checked_alike(tmp_path, lora_files) -> None:
    base, adapter = lora_files
    chained = copy_adapter(adapter, tmp_path / "chained", base_model_name_or_path=str(adapter))
    assert "is itself a LoRA adapter" in refused(chained)
    with pytest.raises(lora.LoraError) as err:
        lora.merge(adapter, tmp_path / "out", base=str(adapter))
    assert one_line(err).startswith(f"--base={adapter}: names the adapter's own directory")
    with pytest.raises(lora.LoraError) as err:
        lora.merge(adapter, tmp_path / "out", base=str(tmp_path / "nowhere"))
    assert "no such directory" in one_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (None, "base_model_name_or_path is missing; pass the base model with --base"),
        ("", "base_model_name_or_path is missing"),
        (["x"], 'base_model_name_or_path=["x"]: must be a string'),
        ("not a hub id!", "neither a local directory nor a HF hub id"),
    ],
)
def test_an_unusable_base_name_is_one_line(tmp_path, lora_files, value, says) -> None:
    _, adapter = lora_files
    text = refused(copy_adapter(adapter, tmp_path / "x", base_model_name_or_path=value))
    assert text.startswith(str(tmp_path / "x" / CONFIG)) and says in text


# ------------------------------------------------------------------------- adapter_config.json


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("r", 1e14, "r=100000000000000.0: must be a whole number in [1, 4096]"),
        ("r", 10**30, "r=1000000000000000000000000000000: must be a whole number in [1, 4096]"),
        ("r", 0, "r=0: must be a whole number in [1, 4096]"),
        ("r", True, "r=true: must be a whole number"),
        ("r", "8", "r='8': must be a whole number"),
        ("lora_alpha", 1e308, "lora_alpha=1e+308: must be a finite number in (0, 16384]"),
        ("lora_alpha", -1.0, "lora_alpha=-1.0: must be a finite number in (0, 16384]"),
        ("rank_pattern", {"q_proj": 10**9}, "rank_pattern['q_proj']=1000000000: must be a whole"),
        ("alpha_pattern", {"q_proj": 1e300}, "alpha_pattern['q_proj']=1e+300: must be a finite"),
        ("rank_pattern", [1], "rank_pattern=[1]: must be an object"),
        ("peft_type", "PROMPT_TUNING", "peft_type='PROMPT_TUNING': must be LORA"),
        ("lora_dropout", 1.5, "lora_dropout=1.5: must be a number in [0, 1)"),
        ("init_lora_weights", "pissa", "init_lora_weights='pissa': must be true, false or"),
        ("layer_replication", [[0, 2]] * 1000, "layer_replication: must be null"),
    ],
)
def test_absurd_sizes_name_the_file_and_the_field(
    tmp_path, lora_files, broken_base, field, value, says
) -> None:
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path / "bad", base_model_name_or_path=str(broken_base))
    config = json.loads((bad / CONFIG).read_text()) | {field: value}
    (bad / CONFIG).write_text(json.dumps(config))
    assert refused(bad).startswith(f"{bad / CONFIG}: {says}")
    with pytest.raises(lora.LoraError):
        lora.check_adapter(bad)  # what a LoRA resume checks before the base loads


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"r": 4,', "not valid JSON (Expecting property name"),
        ('{"r": 4, "lora_alpha": NaN}', "not valid JSON (NaN is not a JSON number)"),
        ('{"r": 4, "lora_alpha": Infinity}', "not valid JSON (Infinity is not a JSON number)"),
        ('{"r": 4, "lora_alpha": 1e999}', "lora_alpha=Infinity: must be a finite number"),
        ("[4, 8]", "holds a JSON list, not an object"),
        ('{"r": "\udcff"}', "not valid JSON"),
    ],
)
def test_broken_json_is_one_line(tmp_path, lora_files, text, says) -> None:
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path / "bad")
    (bad / CONFIG).write_bytes(text.encode("utf-8", "surrogateescape"))
    assert refused(bad).startswith(f"{bad / CONFIG}: {says}")


def test_an_oversized_config_is_refused_unread(tmp_path, lora_files) -> None:
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path / "bad")
    (bad / CONFIG).write_text('{"r": 4, "pad": "' + "x" * (2 << 20) + '"}')
    size = (bad / CONFIG).stat().st_size
    assert refused(bad) == (
        f"{bad / CONFIG}: {size} bytes; an adapter config is at most {adapters.MAX_CONFIG_BYTES}"
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    r=st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        st.none(),
    ),
    alpha=st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(-(2**70), 2**70),
        st.text(max_size=3),
    ),
)
def test_read_accepts_exactly_the_bounded_sizes(tmp_path_factory, lora_files, r, alpha) -> None:
    """Whatever r and lora_alpha hold, `read` returns an adapter within the bounds or refuses
    in one line naming the field; it accepts every in-bounds value with a matching weights
    file (here: r=4, the rank of the fixture's tensors)."""
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path_factory.mktemp("h") / "a", r=r, lora_alpha=alpha)
    ok_r = type(r) is int and 1 <= r <= adapters.MAX_RANK
    ok_alpha = type(alpha) in (int, float) and 0 < alpha <= adapters.MAX_ALPHA
    try:
        found = adapters.read(bad)
    except lora.LoraError as err:
        text = str(err)
        assert "\n" not in text
        if not ok_r:
            assert text.startswith(f"{bad / CONFIG}: r=")
        elif not ok_alpha:
            assert text.startswith(f"{bad / CONFIG}: lora_alpha=")
        else:  # in bounds, but the tensors have rank 4
            assert r != 4 and text.startswith(f"{bad / WEIGHTS}: ") and "rank (" in text
        return
    assert ok_r and ok_alpha and r == 4 and found.rank == 4 and found.alpha == float(alpha)


# --------------------------------------------------------------------- adapter_model.safetensors


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def test_a_weights_header_that_lies_is_one_line(tmp_path, lora_files, broken_base) -> None:
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path / "bad", base_model_name_or_path=str(broken_base))
    header, data = _header(bad / WEIGHTS)
    name = next(k for k in header if k.endswith("q_proj.lora_A.weight"))

    _write(bad / WEIGHTS, header, data, length=2**63)  # a header "of 8 EB"
    assert refused(bad).startswith(f"{bad / WEIGHTS}: not a safetensors file (header of ")
    (bad / WEIGHTS).write_bytes(b"\x01\x00")
    assert refused(bad).startswith(f"{bad / WEIGHTS}: not a safetensors file (shorter than")

    grown = {**header, name: {**header[name], "shape": [4, 10**12]}}  # 4 TB from a small file
    _write(bad / WEIGHTS, grown, data)
    assert refused(bad).startswith(f"{bad / WEIGHTS}: {name}.data_offsets=")

    wide = {**header, name: {**header[name], "shape": [16, 32]}}  # the same 512 elements, rank 16
    _write(bad / WEIGHTS, wide, data)
    assert refused(bad) == (
        f"{bad / WEIGHTS}: {name}.shape=[16, 32]: must have the adapter's rank (4, from "
        f"{CONFIG}) in dimension 0"
    )
    odd = {**header, name: {**header[name], "dtype": "F128"}}
    _write(bad / WEIGHTS, odd, data)
    assert f"{name}.dtype='F128': must be one of" in refused(bad)

    (bad / WEIGHTS).unlink()
    (bad / adapters.PICKLED_WEIGHTS).write_bytes(b"\x80\x04crafted pickle")
    assert refused(bad).startswith(f"{bad / adapters.PICKLED_WEIGHTS}: a pickled adapter; only")


def test_an_adapter_of_another_model_is_refused_before_its_base_loads(
    tmp_path, lora_files, broken_base
) -> None:
    """Tensors are matched against the base built on the meta device: a layer it lacks, or a
    width it does not have, is one line, though the base's weights are unreadable."""
    _, adapter = lora_files
    bad = copy_adapter(adapter, tmp_path / "bad", base_model_name_or_path=str(broken_base))
    header, data = _header(bad / WEIGHTS)
    name = next(k for k in header if k.endswith("layers.1.mlp.up_proj.lora_A.weight"))
    moved = name.replace("layers.1.", "layers.7.")
    _write(bad / WEIGHTS, {(moved if k == name else k): v for k, v in header.items()}, data)
    assert refused(bad) == (
        f"{bad / WEIGHTS}: {moved}: the base model of {broken_base} has no such layer at "
        "model.layers.7.mlp.up_proj; an adapter trained on another model (pass its base with "
        "--base)"
    )
    a_name = next(k for k in header if k.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
    entry = header[a_name]  # (4, 128) float32; made (4, 64): its first 1,024 bytes
    start = entry["data_offsets"][0]
    narrow = {**header, a_name: {**entry, "shape": [4, 64], "data_offsets": [start, start + 1024]}}
    _write(bad / WEIGHTS, narrow, data)
    assert refused(bad) == (
        f"{bad / WEIGHTS}: {a_name}.shape=[4, 64]: model.layers.0.self_attn.q_proj of the base "
        f"model of {broken_base} takes 128 features there; an adapter trained on another model "
        "(pass its base with --base)"
    )


def test_a_good_adapter_still_loads_merged(lora_files) -> None:
    _, adapter = lora_files
    found = adapters.read(adapter)
    assert (found.rank, found.alpha) == (4, 8.0) and len(found.tensors) == 2 * 2 * 7
    model, _ = loading.load_checkpoint(adapter)
    assert not lora.is_lora(model)


# -------------------------------------------------------------------- model.lora at config check


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "model.lora.rank=1000000000",
            "model.lora.rank=1000000000: must be within [0, 4096] (0 = off)",
        ),
        ("model.lora.rank=-1", "model.lora.rank=-1: must be within [0, 4096] (0 = off)"),
        ("model.lora.alpha=1e308", "model.lora.alpha=1e+308: must be within (0, 16384]"),
        ("model.lora.alpha=inf", "model.lora.alpha=inf: must be within (0, 16384]"),
        ("model.lora.alpha=0", "model.lora.alpha=0.0: must be within (0, 16384]"),
    ],
)
def test_absurd_lora_settings_are_refused_at_config_check(override, says) -> None:
    with pytest.raises((PreflightError, ConfigError)) as err:
        preflight("train", ["model.lora.rank=8", override])
    assert str(err.value) == says


def test_the_command_line_refuses_them_in_one_line(tmp_path: Path) -> None:
    done = run_bapo("train", "model.lora.rank=8", "model.lora.alpha=1e308", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: model.lora.alpha=1e+308: must be within (0, 16384]"
    ]


# ----------------------------------------------------------------- target modules, no weights


def test_unknown_targets_are_refused_before_the_weights_load(broken_base) -> None:
    cfg = ModelConfig(path=str(broken_base), device="cpu", dtype="float32")
    cfg.lora = LoraConfig(rank=4, target_modules=["q_proj", "qq_proj"])
    with pytest.raises(lora.LoraError) as err:
        loading.load_policy(cfg)
    assert one_line(err) == (
        f"model.lora.target_modules=['q_proj', 'qq_proj']: qq_proj matches no module of "
        f"{broken_base}; its decoder's linear layers are down_proj, gate_proj, k_proj, o_proj, "
        "q_proj, up_proj, v_proj (or use [all-linear])"
    )
    for target, kind in (("lm_head", "Linear"), ("embed_tokens", "Embedding"), ("mlp", "Qwen2MLP")):
        cfg.lora = LoraConfig(rank=4, target_modules=[target])
        with pytest.raises(lora.LoraError) as err:
            loading.load_policy(cfg)
        assert f"{target} ({kind}); adapters go on the decoder's linear layers" in one_line(err)
    cfg.lora = LoraConfig(rank=129)  # the tiny shape's hidden size is 128
    with pytest.raises(lora.LoraError) as err:
        loading.load_policy(cfg)
    assert one_line(err) == (
        f"model.lora.rank=129: above the hidden size of {broken_base} (128); a rank in [1, 128]"
    )
    # the names PEFT matches: a full path and a suffix do, in a check without weights
    assert lora.check_targets(broken_base, LoraConfig(rank=4, target_modules=["self_attn.q_proj"]))
    assert lora.check_targets(broken_base, LoraConfig(rank=128))


def test_a_hub_id_not_in_the_cache_skips_the_check_rather_than_reach_the_network(
    monkeypatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert lora.skeleton("someone/not-a-cached-model") is None
    assert not lora.check_targets("someone/not-a-cached-model", LoraConfig(rank=4))


# ------------------------------------------------------------------------------------ resume


def test_a_resume_from_a_hostile_adapter_checkpoint_is_one_line(tmp_path: Path) -> None:
    """The audit's `bapo train` resume cases on a real LoRA run: with LoRA on, `r: 1e14` is
    refused before the base loads (PEFT allocated it); with LoRA off (the checkpoint merged on
    load) a base naming the checkpoint itself is one line, not a RecursionError."""
    from tests.train.conftest import run_train

    lora_on = ("model.lora.rank=4", "model.lora.alpha=16", "trainer.save_every=1")
    ckpt = run_train(tmp_path, *lora_on, "trainer.max_steps=1").checkpoint
    good = json.loads((ckpt / CONFIG).read_text())
    (ckpt / CONFIG).write_text(json.dumps(good | {"r": 1e14}))
    with pytest.raises(lora.LoraError) as err:
        run_train(tmp_path, *lora_on, "trainer.max_steps=2", "trainer.resume=true")
    assert one_line(err) == (
        f"{ckpt / CONFIG}: r=100000000000000.0: must be a whole number in [1, {adapters.MAX_RANK}]"
    )
    (ckpt / CONFIG).write_text(json.dumps(good | {"base_model_name_or_path": str(ckpt)}))
    with pytest.raises(lora.LoraError) as err:
        run_train(tmp_path, "trainer.max_steps=2", "trainer.resume=true")
    assert one_line(err).startswith(
        f"{ckpt / CONFIG}: base_model_name_or_path={ckpt}: names the adapter's own directory"
    )
