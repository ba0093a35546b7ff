"""Delta versions (`rollout.weights_delta`): encode/apply round trips bit for bit, the chain a
server is sent, and when the writer writes a full version instead (no vLLM)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.rollout import weights_delta, weights_fs
from bapo_cli.rollout.weights_delta import VersionWriter, apply, chain, encode

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(weights_delta._bits(a), weights_delta._bits(b))
    )


@st.composite
def versions_pair(draw):
    """Two versions of the same tensors: some elements changed (a few, many or all), some to
    -0.0, NaN or inf, whose bits differ while == may say equal (or never)."""
    dtype = draw(st.sampled_from(DTYPES))
    names = draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True))
    old, new = {}, {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        before = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        after = before.clone()
        flat = after.reshape(-1)
        share = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
        hit = torch.rand(flat.shape, generator=g) < share
        flat[hit] = flat[hit] + torch.randn(int(hit.sum()), generator=g).to(dtype)
        special = draw(st.sampled_from([None, -0.0, float("nan"), float("inf")]))
        if special is not None and flat.numel():
            flat[0] = special
        old[name], new[name] = before, after
    return old, new


@given(versions_pair())
@settings(max_examples=150, deadline=None)
def test_a_delta_applied_to_the_version_before_gives_the_new_one_bit_for_bit(pair) -> None:
    old, new = pair
    delta = encode(old, new)
    held = {n: t.clone() for n, t in old.items()}
    changed = apply(held, delta)
    for name in new:
        assert bits_equal(held[name], new[name]), name
    moved = {n for n in new if not bits_equal(old[n], new[n])}
    assert set(changed) == moved
    # never more bytes than the tensors that changed, whole
    assert weights_delta.nbytes(delta) <= sum(new[n].numel() * new[n].element_size() for n in moved)


def test_per_tensor_the_fewest_bytes_nothing_sparse_or_whole() -> None:
    old = {n: torch.zeros(100, dtype=torch.bfloat16) for n in ("same", "few", "most")}
    new = {n: t.clone() for n, t in old.items()}
    new["few"][[3, 50]] = 1.0  # 2 x (4 + 2) bytes < 200
    new["most"][:80] = 1.0  # 80 x 6 > 200: whole
    new["same"][7] = -0.0  # another bit pattern, == says equal: still a change
    delta = encode(old, new)
    assert sorted(delta) == ["few::gap", "few::val", "most", "same::gap", "same::val"]
    # positions 0 (every STRIDE-th joins), 3, 50 as gaps; values the new ones
    assert delta["few::gap"].tolist() == [0, 3, 47] and delta["few::gap"].dtype == torch.int16
    assert delta["few::val"].tolist() == [0.0, 1.0, 1.0]
    assert weights_delta.nbytes(delta) == 3 * 4 + 200 + 2 * 4  # "same": positions 0 and 7


def test_gaps_past_two_bytes_and_positions_past_two_to_the_31() -> None:
    """Gaps up to STRIDE travel in two bytes (as int16 bits); a tensor of more than 2^31
    elements is addressed by the gaps' int64 sum (a 2^31-element tensor is not built here:
    positions_of is checked on the gaps such a tensor would give)."""
    n = 3 * weights_delta.STRIDE + 10
    old = torch.zeros(n, dtype=torch.bfloat16)
    new = old.clone()
    new[[1, weights_delta.STRIDE + 7, n - 1]] = 2.0
    delta = encode({"t": old}, {"t": new})
    held = {"t": old.clone()}
    apply(held, delta)
    assert bits_equal(held["t"], new)
    gaps = torch.full((40_000,), weights_delta.STRIDE, dtype=torch.int32).to(torch.int16)
    assert weights_delta.positions_of(gaps)[-1].item() == 40_000 * weights_delta.STRIDE > 2**31


def kinds(spec: str) -> dict[int, tuple[str, int | None]]:
    """'F D D F D' from version 0: full and delta versions, each delta on the one before."""
    return {v: ("full", None) if k == "F" else ("delta", v - 1) for v, k in enumerate(spec.split())}


@pytest.mark.parametrize(
    ("spec", "held", "target", "want"),
    [
        ("F D D D", 1, 3, [2, 3]),  # deltas from the held version
        ("F D D D", None, 3, [0, 1, 2, 3]),  # not known (came back): from the full one
        ("F D D F D", 1, 4, [3, 4]),  # a full version on the way: from it
        ("F D D D", 3, 3, []),  # holds it
        ("F D D D", 7, 3, [0, 1, 2, 3]),  # holds a version not on the chain
    ],
)
def test_the_chain_a_server_is_sent(spec, held, target, want) -> None:
    assert chain(held, target, kinds(spec)) == want


def test_no_chain_without_a_full_version_under_it() -> None:
    on_disk = {2: ("delta", 1), 3: ("delta", 2)}  # the full version 1 was removed
    assert chain(2, 3, on_disk) == [3]
    with pytest.raises(weights_fs.WeightsDirError, match="no full weights version"):
        chain(None, 3, on_disk)


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def nudged(base: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """`base` with about `share` of its bf16 elements moved (an RL step at a small lr), in
    place, as an optimizer step moves the parameters the writer was given."""
    g = torch.Generator().manual_seed(seed)
    for t in base.values():
        t.add_((torch.rand(t.shape, generator=g) < share) * t.abs() * 0.1)
    return base


def read_back(root: Path, version: int, held: dict | None) -> dict[str, torch.Tensor]:
    d = weights_fs.version_dir(root, version)
    if weights_fs.is_delta(d):
        apply(held, weights_delta.read(d))
        return held
    return dict(weights_fs.open_version(d, version))


@pytest.mark.parametrize("dtype", [torch.bfloat16, None])  # None: the trainer's float32
def test_the_writer_full_at_start_every_n_after_a_revival_and_when_not_cheaper(dtype) -> None:
    serving = dtype or torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = VersionWriter(delta=True, full_every=3, dtype=dtype)
        weights = model(0)
        got, notes = [], {}
        held = None
        for v in range(9):
            if v == 5:
                writer.force_full("a server came back")
            share = 0.9 if v == 7 else 0.02
            weights = nudged(weights, share, v)
            w = writer.write(weights.items(), root, v)
            got.append((w.delta, w.why_full))
            notes.update({v: w.note} if w.note else {})
            held = read_back(root, v, held)
            for n, t in weights.items():  # every version reads back as the serving dtype's
                assert bits_equal(held[n], t.to(serving))
            marker = weights_fs.read_marker(w.directory)
            assert marker["fingerprint"] == weights_fs.fingerprint(held.items())
            assert w.full_bytes == (64 * 64 + 64) * serving.itemsize
            if w.delta:
                assert marker["base"] == v - 1 and w.bytes < w.full_bytes / 5
        assert got == [
            (False, "the start (what the servers hold is not known)"),
            (True, None),
            (True, None),
            (False, "a full version every 3"),
            (True, None),
            (False, "a server came back"),
            (True, None),
            (False, weights_delta.LARGER),
            (True, None),
        ]
        # said when the choice by bytes turns, not for the versions full by the schedule
        assert sorted(notes) == [7, 8]
        assert re.fullmatch(
            r"weights: version 7 written full: its delta would be \d+% of the full version's "
            r"bytes \(versions are written full until a delta is fewer bytes\)",
            notes[7],
        )
        assert re.fullmatch(
            r"weights: version 8 written as a delta again \(\d+% of the bytes\)", notes[8]
        )
        # a resumed run: a new writer, what the servers hold is not known
        again = VersionWriter(delta=True, full_every=3, dtype=dtype)
        assert not again.write(weights.items(), root, 9).delta


def test_cleanup_keeps_the_full_version_a_chain_starts_from() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = VersionWriter(delta=True, full_every=10)
        weights = model(1)
        for v in range(4):  # 0 full, 1-3 deltas
            weights = nudged(weights, 0.01, v)
            writer.write(weights.items(), root, v)
        assert weights_fs.cleanup(root, keep_from=3) == []  # 3 needs 0, 1, 2
        assert weights_delta.chain(None, 3, weights_delta.kinds_on_disk(root)) == [0, 1, 2, 3]
        writer.force_full("a server came back")
        writer.write(nudged(weights, 0.01, 9).items(), root, 4)
        assert weights_fs.cleanup(root, keep_from=4) == [0, 1, 2, 3]


def test_a_server_that_came_back_makes_the_next_version_full() -> None:
    """The pool counts servers that came back (`ServerPool.revivals`); the writer tells its
    servers to keep what they load only when it writes deltas."""
    pool = SimpleNamespace(revivals=0, keep_held=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = VersionWriter(delta=True, full_every=100, pool=pool)
        assert pool.keep_held
        weights = model(2)
        kinds = []
        for v in range(5):
            if v == 3:
                pool.revivals += 1
            kinds.append(writer.write(nudged(weights, 0.01, v).items(), root, v).why_full)
            assert writer.metrics["push_delta"] == float(kinds[-1] is None)
        assert kinds == [
            "the start (what the servers hold is not known)",
            None,
            None,
            "a server came back",
            None,
        ]
    assert not VersionWriter(delta=False, pool=pool).delta and not pool.keep_held
