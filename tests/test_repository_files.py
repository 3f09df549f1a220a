"""What the repository says about itself agrees: the timings README and Makefile give, what git
ignores of what the examples write, and the examples' error lines, which are never cut inside a
word."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


def _example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPOSITORY / "examples"))  # the examples import each other
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPOSITORY / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_readme_and_makefile_give_the_same_test_timings() -> None:
    readme = (REPOSITORY / "README.md").read_text()
    makefile = (REPOSITORY / "Makefile").read_text()
    timing = r"\d+(?:\.\d+)?(?:\u2013\d+(?:\.\d+)?)? (?:minutes|seconds) on 2 cores"
    for target in ("test", "test-fast"):
        rule = re.search(rf"((?:#[^\n]*\n)+){re.escape(target)}:", makefile)
        assert rule is not None, target
        in_makefile = re.findall(timing, rule.group(1))
        assert len(in_makefile) == 1, (target, rule.group(1))
        assert in_makefile[0] in readme, (target, in_makefile[0])
        assert "\u2013" in in_makefile[0], "a measured range, not one figure"


def test_git_ignores_what_the_examples_write_by_default() -> None:
    if not (REPOSITORY / ".git").exists():
        pytest.skip("not a git checkout")
    for written in ("batch-output/progress.json", "demo-output/x"):
        done = subprocess.run(
            ["git", "-C", str(REPOSITORY), "check-ignore", "--no-index", "-q", written], capture_output=True
        )
        assert done.returncode == 0, f"{written} is not ignored"


def test_an_error_line_is_printed_whole_never_cut_inside_a_word(monkeypatch: pytest.MonkeyPatch) -> None:
    train_moe = _example("train_moe", monkeypatch)
    message = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
        "[127.0.0.1]:45927 while reading the header of the next message of collective allreduce_gloo\n"
        "Exception raised from recvFromPeer at ../third_party/gloo/gloo/transport/tcp/pair.cc"
    )
    line = train_moe.first_line(RuntimeError(message))
    assert line == message.splitlines()[0] and len(line) > 160
    assert train_moe.first_line(RuntimeError("\n  \nsecond")) == "second"
    for name in ("train_moe", "demo"):
        source = (REPOSITORY / "examples" / f"{name}.py").read_text()
        assert not re.search(r"(?:exc|reason|error|message)\)?(?:\.splitlines\(\)\[0\])?\[:\d+\]", source), name
