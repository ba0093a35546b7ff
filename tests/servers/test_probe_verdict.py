"""The verdict on a weight push from the probe (`staleness.probe`), on log-probs made by hand:
the dtype-aware tolerance, a server above it, a server that kept the version before, and no
false stop where a step moved the probe less than the engine's noise. The verdict on real
servers and a proxy: tests/servers/test_ownership.py."""

from __future__ import annotations

import torch

from bapo_cli.staleness import probe

URL = "http://127.0.0.1:8001"


def logprobs(seed: int, n: int = 40, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return -scale * torch.rand(n, generator=g)


def noise(seed: int, size: float, n: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return size * torch.randn(n, generator=g)


def test_the_tolerance_is_dtype_aware_and_configurable() -> None:
    assert probe.tolerance(None, ["torch.float32", "float32"]) == probe.FLOAT32_TOLERANCE == 0.01
    assert probe.tolerance(None, ["torch.float32", "bfloat16"]) == probe.HALF_TOLERANCE == 1.0
    assert probe.tolerance(None, ["torch.float16"]) == 1.0
    assert probe.tolerance(0.3, ["bfloat16"]) == 0.3


def test_a_server_within_the_tolerance_passes_and_one_beyond_stops() -> None:
    before, want = logprobs(0), logprobs(1)
    assert probe.verdict(URL, 3, 3, want + noise(2, 2e-6), want, before, 0.01) is None
    line = probe.verdict(URL, 3, 3, want + 8.6, want, before, 0.01)
    assert line == (
        f"the generation server {URL} differs from the trainer by 8.6 nats after the push of "
        "version 3 (probe log-probs, max |server - trainer|; staleness.probe_tolerance=0.01): it "
        "does not hold this run's weights; check what answers at that URL, or raise "
        "staleness.probe_tolerance if its kernels differ this much"
    )
    line = probe.verdict(URL, 3, 2, want, want, before, 0.01)
    assert line.startswith(
        f"the generation server {URL} stamps version 2 after the push of version 3"
    )


def test_a_server_still_at_the_version_before_stops_below_the_tolerance() -> None:
    """bf16-sized noise (0.05) and a tolerance of 1 nat: a step that moved the probe by ~0.2 (mean)
    is within the tolerance either way; the server's distance to the two versions tells."""
    before = logprobs(0)
    want = before + noise(1, 0.25)
    kept = before + noise(2, 0.05)  # the push did not reach its model
    line = probe.verdict(URL, 5, 5, kept, want, before, 1.0)
    assert line is not None
    assert line.startswith(
        f"the generation server {URL} still serves the weights of before the push of version 5"
    )
    took = want + noise(2, 0.05)
    assert probe.verdict(URL, 5, 5, took, want, before, 1.0) is None


def test_no_false_stop_when_the_step_is_smaller_than_the_noise() -> None:
    """A step that moved the probe less than the engine's noise: the server, holding the new
    weights, is about as far from both versions; no seed of 200 stops it."""
    for seed in range(200):
        before = logprobs(seed)
        want = before + noise(seed + 1000, 0.01)
        took = want + noise(seed + 2000, 0.05)
        assert probe.verdict(URL, 1, 1, took, want, before, 1.0) is None, seed
