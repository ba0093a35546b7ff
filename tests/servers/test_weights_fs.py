"""The filesystem weight transport on disk: versions written atomically (a killed writer leaves
no version under its final name), read back exactly, old ones cleaned up (never the newest), and
a directory that cannot be written refused in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.rollout import weights_fs


def tensors(seed: int, size: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(size, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(4, size, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def test_a_version_round_trips_with_its_marker(tmp_path) -> None:
    written = tensors(0)
    path = weights_fs.write_version(written.items(), tmp_path, 7)
    assert path == tmp_path / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == ["STABLE", "model.safetensors"]
    marker = weights_fs.read_marker(path)
    fingerprint = weights_fs.fingerprint(written.items())
    assert marker == {
        "version": 7,
        "tensors": 3,
        "bytes": 8 * 4 * 4 * 2 + 4 * 2,
        "fingerprint": fingerprint,
    }
    assert weights_fs.model_fingerprint(path) == fingerprint  # the files say the same
    read = dict(weights_fs.open_version(path, 7))
    assert read.keys() == written.keys()
    for name, t in written.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007"]  # no temporary left


def test_fingerprints_tell_weights_apart_and_read_few_bytes(tmp_path) -> None:
    """Order does not matter; a value in the sampled part, a name, a shape or a dtype does; two
    models of one architecture (the shipped tiny and tiny_pairs) differ; files and tensors
    agree (bf16 and 0-dim included); no safetensors: None."""
    base = tensors(0) | {"scale": torch.tensor(2.0)}
    fp = weights_fs.fingerprint(base.items())
    assert weights_fs.fingerprint(reversed(list(base.items()))) == fp
    changed = dict(base)
    changed["model.embed_tokens.weight"] = base["model.embed_tokens.weight"].clone()
    changed["model.embed_tokens.weight"][0, 1] += 1e-6
    assert weights_fs.fingerprint(changed.items()) != fp
    renamed = {("x." + k): v for k, v in base.items()}
    assert weights_fs.fingerprint(renamed.items()) != fp
    recast = base | {"model.norm.weight": base["model.norm.weight"].float()}
    assert weights_fs.fingerprint(recast.items()) != fp
    from safetensors.torch import save_file

    save_file(base, str(tmp_path / "model.safetensors"))
    assert weights_fs.model_fingerprint(tmp_path) == fp
    shipped = Path(weights_fs.__file__).parents[1] / "models" / "weights"
    assert weights_fs.model_fingerprint(shipped / "tiny") != weights_fs.model_fingerprint(
        shipped / "tiny_pairs"
    )
    (tmp_path / "empty").mkdir()
    assert weights_fs.model_fingerprint(tmp_path / "empty") is None
    assert weights_fs.model_fingerprint("no-such-org/no-such-model") is None


def test_names_given_twice_and_tied_tensors(tmp_path) -> None:
    """A name given twice is written once (the first); a tensor under two names (a state
    dict's tied embedding and lm_head) is written under both."""
    t = torch.ones(2)
    path = weights_fs.write_version([("a", t), ("a", t * 2), ("b", t)], tmp_path, 1)
    assert {n: v.tolist() for n, v in weights_fs.open_version(path, 1)} == {
        "a": [1.0, 1.0],
        "b": [1.0, 1.0],
    }


def test_incomplete_or_other_versions_are_refused(tmp_path) -> None:
    path = weights_fs.write_version(tensors(0).items(), tmp_path, 3)
    with pytest.raises(weights_fs.WeightsDirError, match="holds version 3, not the requested 4"):
        list(weights_fs.open_version(path, 4))
    (path / "STABLE").unlink()  # as a half-finished copy by another tool would be
    with pytest.raises(weights_fs.WeightsDirError, match="no complete weights version"):
        list(weights_fs.open_version(path, 3))
    assert weights_fs.versions(tmp_path) == []  # and it is not listed


def test_cleanup_keeps_the_newest_and_removes_dead_writers_leftovers(tmp_path) -> None:
    for v in (1, 2, 5):
        weights_fs.write_version(tensors(v).items(), tmp_path, v)
    dead = _dead_pid()
    stale = tmp_path / f".tmp-step_00000006-{dead}-abcd1234"
    live = tmp_path / f".tmp-step_00000006-{os.getpid()}-abcd1234"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    assert weights_fs.versions(tmp_path) == [1, 2, 5]  # temporaries are never versions
    assert weights_fs.cleanup(tmp_path, keep_from=2) == [1]
    assert weights_fs.versions(tmp_path) == [2, 5]
    assert not stale.exists() and live.exists()  # a live writer's is left to it
    assert weights_fs.cleanup(tmp_path, keep_from=100) == [2]  # the newest stays
    assert weights_fs.versions(tmp_path) == [5]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 4)), min_size=1, max_size=8)
)
def test_versions_on_disk_follow_writes_and_cleanups(steps) -> None:
    """Whatever the order of writes (versions going up, some rewritten) and cleanups: the
    listed versions are exactly those written and not removed, the newest written is always
    there, and each one read back is the tensors last written under it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        version, expected, content = 0, set(), {}
        for bump, clean, back in steps:
            version += bump
            weights_fs.write_version(tensors(version * 10 + back).items(), root, version)
            expected.add(version)
            content[version] = version * 10 + back
            if clean:
                keep_from = max(0, version - back)
                removed = weights_fs.cleanup(root, keep_from)
                assert set(removed) == {v for v in expected if v < keep_from and v != version}
                expected -= set(removed)
            assert weights_fs.versions(root) == sorted(expected)
            assert max(expected) == version
        for v in expected:
            read = dict(weights_fs.open_version(weights_fs.version_dir(root, v), v))
            for name, t in tensors(content[v]).items():
                assert torch.equal(read[name], t)


WRITER = """
import sys, torch
from bapo_cli.rollout import weights_fs
root = sys.argv[1]
big = {f"layer{i}.weight": torch.randn(512, 1024) for i in range(8)}  # 16 MiB a version
print("writing", flush=True)
v = 0
while True:
    weights_fs.write_version(big.items(), root, v)
    v += 1
"""


def test_a_writer_killed_mid_write_leaves_only_complete_versions(tmp_path) -> None:
    """SIGKILL a process that writes version after version: every `step_N` left is complete
    (marker present, every tensor readable); what it was writing stays a temporary, which the
    next cleanup removes."""
    root = tmp_path / "w"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout.readline().strip() == b"writing"
        deadline = time.monotonic() + 120
        while len(weights_fs.versions(root)) < 2:  # killed while writing the third or later
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    found = weights_fs.versions(root)
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == [weights_fs.version_dir(root, v).name for v in found]  # none incomplete
    for v in found:
        read = dict(weights_fs.open_version(weights_fs.version_dir(root, v), v))
        assert len(read) == 8 and all(t.shape == (512, 1024) for t in read.values())
    weights_fs.cleanup(root, keep_from=found[-1])
    assert [p.name for p in root.iterdir()] == [weights_fs.version_dir(root, found[-1]).name]


def test_a_directory_that_cannot_be_written_is_refused(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(weights_fs.WeightsDirError) as info:
        weights_fs.check_writable(blocker / "weights")
    line = str(info.value)
    assert line == (
        f"the weights directory {blocker / 'weights'} is not writable (Not a directory); give a "
        "directory this process can write and every server can read"
    )
    assert weights_fs.check_writable(tmp_path / "new" / "w") == tmp_path / "new" / "w"
    assert list((tmp_path / "new" / "w").iterdir()) == []  # the probe file is gone


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
