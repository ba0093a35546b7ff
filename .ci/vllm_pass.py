"""CI's check that the tests marked `vllm` are exactly the tests that skip without vLLM.

The second pass (.ci/run) runs `pytest -m vllm` in .venv-vllm beside the first pass, so it cannot
wait for the first pass's list of skips; this compares the two afterwards. A skipped entry is a
node id, or a module's path when the whole module skipped at import.

    python .ci/vllm_pass.py SKIPS SELECTED   (SELECTED.collected beside SELECTED)

Exit 1 with one line per difference: a test that skipped for want of vLLM and was not run with
it (mark it `@pytest.mark.vllm`), or a marked test that ran in the first pass without vLLM
(unmark it: the second pass would run it twice over).
"""

from __future__ import annotations

import sys
from pathlib import Path


def differences(skipped: set[str], collected: list[str], selected: set[str]) -> list[str]:
    """What differs between the first pass's vLLM skips and the second pass's `-m vllm` run."""
    out = []
    modules = {s for s in skipped if "::" not in s}
    for entry in sorted(skipped):
        if entry in modules:
            inside = [n for n in collected if n.startswith(entry + "::")]
            missing = [n for n in inside if n not in selected] if inside else [entry]
            out += [f"{n}: skipped without vLLM (whole module), not marked vllm" for n in missing]
        elif entry not in selected:
            out.append(f"{entry}: skipped without vLLM, not marked vllm")
    for node in sorted(selected):
        if node not in skipped and node.split("::", 1)[0] not in modules:
            out.append(f"{node}: marked vllm, but it ran without vLLM in the first pass")
    return out


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text(encoding="utf-8").splitlines() if x]


def main(skips: str, selected: str) -> int:
    found = differences(
        set(_lines(Path(skips))), _lines(Path(selected + ".collected")), set(_lines(Path(selected)))
    )
    for line in found:
        print(f"ci: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
