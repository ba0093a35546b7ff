"""`.ci/vllm_pass.py`: CI's second pass (`-m vllm`) must run exactly what skipped without vLLM."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time

from tests.conftest import REPO

SCRIPT = REPO / ".ci" / "vllm_pass.py"
_spec = importlib.util.spec_from_file_location("vllm_pass", SCRIPT)
vllm_pass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_pass)

COLLECTED = ["a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2[x]", "b.py::t2[y]", "c.py::t1"]


def test_the_same_tests_differ_in_nothing() -> None:
    skipped = {"a.py", "b.py::t2[x]", "b.py::t2[y]"}
    selected = {"a.py::t1", "a.py::t2", "b.py::t2[x]", "b.py::t2[y]"}
    assert vllm_pass.differences(skipped, COLLECTED, selected) == []


def test_an_unmarked_skip_and_a_needless_mark_are_each_one_line() -> None:
    skipped = {"a.py", "b.py::t2[x]"}
    selected = {"a.py::t1", "b.py::t1"}  # a.py::t2 unmarked, b.py::t2[x] unmarked, b.py::t1 not
    assert vllm_pass.differences(skipped, COLLECTED, selected) == [
        "a.py::t2: skipped without vLLM (whole module), not marked vllm",
        "b.py::t2[x]: skipped without vLLM, not marked vllm",
        "b.py::t1: marked vllm, but it ran without vLLM in the first pass",
    ]


def test_a_skipped_module_the_second_pass_did_not_collect_is_named() -> None:
    assert vllm_pass.differences({"d.py"}, COLLECTED, set()) == [
        "d.py: skipped without vLLM (whole module), not marked vllm"
    ]


def test_the_script_exits_1_and_says_why(tmp_path) -> None:
    (tmp_path / "skips").write_text("a.py\na.py\n")  # the two workers and the controller repeat
    (tmp_path / "selected").write_text("a.py::t1\n")
    (tmp_path / "selected.collected").write_text("\n".join(COLLECTED) + "\n")
    args = [sys.executable, str(SCRIPT), str(tmp_path / "skips"), str(tmp_path / "selected")]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr == "ci: a.py::t2: skipped without vLLM (whole module), not marked vllm\n"
    (tmp_path / "selected").write_text("a.py::t1\na.py::t2\n")
    done = subprocess.run(args, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")


def test_quiet_tests_run_last_and_wait_for_the_file(tmp_path) -> None:
    """tests/conftest.py: a `quiet` test runs after the others (whatever its place in the file)
    and, with BAPO_QUIET_AFTER set, only once that file exists (.ci/run writes it when the first
    pass is done)."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_order.py").write_text(
        "import time\nimport pytest\n\n\n"
        "@pytest.mark.quiet\ndef test_q():\n    print('RAN q', time.time())\n\n\n"
        "def test_a():\n    print('RAN a', time.time())\n"
    )
    flag = tmp_path / "first-pass-done"
    env = {**os.environ, "BAPO_QUIET_AFTER": str(flag)}
    args = [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", "test_order.py"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(3.0)  # pytest starts and runs test_a, then test_q waits for the file
    written = time.time()
    flag.touch()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    ran = re.findall(r"RAN (\w) ([\d.]+)", out)  # pytest's dots share their lines
    assert [name for name, _ in ran] == ["a", "q"], out
    assert float(ran[1][1]) >= written  # q ran only after the file appeared


def test_modules_with_a_slow_test_run_first_whole_and_quiet_tests_last(tmp_path) -> None:
    """tests/conftest.py `run_order`: a module that holds a test marked `slow` runs before the
    others, in one piece (its other tests with it), the collection's order kept otherwise; a
    `quiet` test still runs last. (Two workers take tests in this order: the long ones start
    early, short ones end the run.)"""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    mark = "import pytest\n\n\n"
    (tmp_path / "test_a.py").write_text("def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n")
    (tmp_path / "test_b.py").write_text(
        f"{mark}def test_b1():\n    pass\n\n\n@pytest.mark.slow\ndef test_b2():\n    pass\n\n\n"
        "@pytest.mark.quiet\ndef test_b3():\n    pass\n"
    )
    (tmp_path / "test_c.py").write_text(
        f"{mark}pytestmark = pytest.mark.slow\n\n\ndef test_c1():\n    pass\n"
    )
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]
    assert order == ["test_b1", "test_b2", "test_c1", "test_a1", "test_a2", "test_b3"]
