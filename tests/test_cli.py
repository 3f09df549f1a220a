"""The command line: inspect, verify, ls and prune; exit codes, JSON output, and no torch import."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.cli import main


@pytest.fixture
def checkpoint(tmp_path: Path, make_state: Callable[..., dict[str, Any]]) -> Path:
    path = tmp_path / "step_00000007"
    sk.save(make_state(), path, step=7, fields=sk.ManifestFields(model_id="tiny", epoch=1))
    return path


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_inspect_prints_a_readable_summary(checkpoint: Path) -> None:
    code, out, _ = run("inspect", str(checkpoint))
    assert code == 0
    for expected in (
        "step 7",
        "epoch 1",
        "tiny",
        "AdamW",
        "blake3",
        "tier         hot",
        "rank_00000.safetensors",
        "model.0.weight",
        "F32",
        "optim_state  optim",
    ):
        assert expected in out, expected


def test_inspect_json_is_machine_readable(checkpoint: Path) -> None:
    code, out, _ = run("inspect", str(checkpoint), "--json")
    assert code == 0
    document = json.loads(out)
    assert document["manifest"]["step"] == 7
    assert document["summary"]["tensor_count"] == sum(len(f.tensors) for f in sk.read_manifest(checkpoint).files)
    assert "F32" in document["summary"]["dtypes"]


def test_verify_exit_codes(checkpoint: Path, tmp_path: Path, flip_bit: Callable[[Path, int, int], None]) -> None:
    code, out, _ = run("verify", str(checkpoint))
    assert code == 0 and out.startswith("OK")
    shard = checkpoint / "shards" / "rank_00000.safetensors"
    flip_bit(shard, shard.stat().st_size - 3, 3)  # in the data, past the header
    (checkpoint / "junk").write_text("x")
    code, out, _ = run("verify", str(checkpoint))
    assert code == 1
    assert "PROBLEM  shards/rank_00000.safetensors: digest mismatch" in out
    assert "PROBLEM  junk: extra file" in out
    code, out, _ = run("verify", str(checkpoint), "--json")
    assert code == 1 and json.loads(out)["ok"] is False and len(json.loads(out)["problems"]) == 2
    code, _, err = run("inspect", str(tmp_path / "missing"))
    assert code == 2 and "no checkpoint" in err
    # Nothing to verify is not "corrupt": exit 2, as the help says.
    code, out, err = run("verify", str(tmp_path / "missing"))
    assert code == 2 and "no checkpoint" in err and out == ""


def test_cli_does_not_import_torch_and_module_entry_point_works(checkpoint: Path) -> None:
    program = (
        "import sys\n"
        "from shardkeep.cli import main\n"
        f"a = main(['inspect', {str(checkpoint)!r}])\n"
        f"b = main(['verify', {str(checkpoint)!r}])\n"
        f"c = main(['ls', {str(checkpoint.parent)!r}])\n"
        f"d = main(['prune', {str(checkpoint.parent)!r}])\n"
        "assert (a, b, c, d) == (0, 0, 0, 0)\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, capture_output=True)
    result = subprocess.run(
        [sys.executable, "-m", "shardkeep", "verify", str(checkpoint)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "OK" in result.stdout
    result = subprocess.run([sys.executable, "-m", "shardkeep", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "inspect" in result.stdout and "verify" in result.stdout


def test_inspect_escapes_control_characters_from_the_manifest(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sk.save({"evil\x1b[2Jkey": torch.zeros(1)}, path, fields=sk.ManifestFields(model_id="m\x1b]0;title\x07"))
    code, out, _ = run("inspect", str(path))
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b[2Jkey" in out


@pytest.fixture
def managed_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    manager = sk.CheckpointManager(root, keep_last=2, keep_best=1)
    for step, loss in [(0, None), (10, 2.0), (20, 1.0), (30, 1.5), (40, 1.7)]:
        manager.save(
            {"w": torch.full((8,), float(step))}, step=step, metrics=None if loss is None else {"val_loss": loss}
        )
    return root


def test_ls_shows_steps_metrics_marks_and_state(managed_root: Path, flip_bit: Callable[[Path, int, int], None]) -> None:
    code, out, _ = run("ls", str(managed_root))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert list(lines) == ["step_00000020", "step_00000030", "step_00000040"]
    assert "best" in lines["step_00000020"] and "last" not in lines["step_00000020"]
    assert "last" in lines["step_00000040"] and " 1.7 " in lines["step_00000040"]
    assert lines["step_00000040"].endswith(" unverified")  # a quick check is never shown as "ok"
    assert "keep_last=2 keep_best=1 metric=val_loss" in out  # the policy recorded in the manifests
    assert "(recorded by step_00000040)" in out
    assert "pointer last -> step_00000040  current" in out and "pointer best -> step_00000020  current" in out

    flip_bit(next((managed_root / "step_00000030").rglob("*.safetensors")), 130, 0)
    code, out, _ = run("ls", str(managed_root))
    assert code == 0  # a flipped bit needs --verify, and the listing says so
    assert next(line for line in out.splitlines() if line.startswith("step_00000030")).endswith(" unverified")
    assert "--verify checks every digest" in out
    code, out, _ = run("ls", str(managed_root), "--verify")
    assert code == 1 and "CORRUPT" in next(line for line in out.splitlines() if line.startswith("step_00000030"))
    assert out.count(" verified") == 2 and "unverified" not in out

    code, out, _ = run("ls", str(managed_root), "--json", "--keep-last", "1", "--keep-best", "0")
    document = json.loads(out)
    assert document["digests_checked"] is False
    assert [c["state"] for c in document["checkpoints"]] == ["unverified"] * 3
    assert [c["step"] for c in document["checkpoints"]] == [20, 30, 40]
    assert [c["prunable"] for c in document["checkpoints"]] == [True, True, False]
    assert document["policy"]["keep_last"] == 1 and document["run"]


def test_prune_is_a_dry_run_unless_applied(managed_root: Path) -> None:
    before = sorted(p.name for p in managed_root.iterdir())
    code, out, _ = run("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0")
    assert code == 0 and "would delete  step_00000020" in out and "dry run" in out
    assert sorted(p.name for p in managed_root.iterdir()) == before
    code, out, _ = run("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0", "--apply")
    assert code == 0 and "deleted 2 checkpoint(s)" in out
    assert sorted(p.name for p in managed_root.iterdir()) == ["last", "step_00000040"]
    code, _, err = run("prune", str(managed_root / "missing"))
    assert code == 2 and "does not exist" in err
    with pytest.raises(SystemExit):
        run("prune", str(managed_root), "--keep-last", "-1")


def test_keep_period_and_interval_add_to_the_policy(managed_root: Path) -> None:
    plain = ("--keep-last", "1", "--keep-best", "0")
    code, out, _ = run("prune", str(managed_root), *plain, "--keep-period", "20", "--json")
    document = json.loads(out)
    assert code == 0 and document["delete"] == ["step_00000030"]  # 20 is a multiple of the period
    assert document["policy"]["keep_period"] == 20 and document["policy"]["keep_interval_seconds"] is None
    assert document["policy"]["source"] == "recorded by step_00000040, with the options given"
    # one window as long as the epoch: only its last checkpoint (step 40) is kept by the interval
    code, out, _ = run("prune", str(managed_root), *plain, "--keep-interval", "1e10", "--json")
    document = json.loads(out)
    assert document["delete"] == ["step_00000030", "step_00000020"]
    assert document["policy"]["keep_interval_seconds"] == 1e10 and document["policy"]["keep_period"] is None
    code, out, _ = run("ls", str(managed_root), "--keep-period", "20", "--keep-interval", "1e10")
    assert "keep_last=2 keep_best=1 metric=val_loss mode=min keep_period=20 keep_interval=1e+10s" in out
    assert "(recorded by step_00000040, with the options given)" in out
    lines = {
        line.split()[0]: line.split()[6] for line in out.splitlines() if line.startswith("step_")
    }  # size is 2 words
    assert lines == {"step_00000020": "best,period", "step_00000030": "last", "step_00000040": "last,period,interval"}
    code, out, _ = run("ls", str(managed_root), "--json", "--keep-period", "20")
    periodic = {c["step"]: (c["is_periodic"], c["is_per_interval"]) for c in json.loads(out)["checkpoints"]}
    assert periodic == {20: (True, False), 30: (False, False), 40: (True, False)}
    code, out, _ = run("prune", str(managed_root), *plain, "--keep-period", "20", "--apply")
    assert sorted(p.name for p in managed_root.iterdir() if p.name.startswith("step_")) == [
        "step_00000020",
        "step_00000040",
    ]
    for bad in (("--keep-period", "0"), ("--keep-period", "1.5"), ("--keep-interval", "0"), ("--keep-interval", "nan")):
        with pytest.raises(SystemExit):
            run("prune", str(managed_root), *bad)


# -- exit codes: 0 ok, 1 problems found, 2 usage error or unreadable -----------------------------


@pytest.fixture
def key_pair(tmp_path: Path) -> tuple[Path, Path]:
    code, _, err = run("keygen", str(tmp_path / "k.pem"))
    assert code == 0, err
    return tmp_path / "k.pem", tmp_path / "k.pem.pub"


def test_every_command_exits_2_on_usage_errors_and_unreadable_input(
    checkpoint: Path, managed_root: Path, key_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    private, public = key_pair
    missing = str(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [
        ("verify", missing),
        ("verify", str(tmp_path / "file")),
        ("verify", str(checkpoint), "--tier", "nope"),
        ("verify", str(checkpoint), "--tier-location", "nope=/tmp"),
        ("verify", str(checkpoint), "--allow-unsigned"),
        ("verify", str(checkpoint), "--public-key", missing),
        ("inspect", missing),
        ("inspect", str(checkpoint), "--tier-location", "nope=/tmp"),
        ("sign", missing, "--key", str(private)),
        ("sign", str(checkpoint), "--key", missing),
        ("keygen", str(private)),
        ("import", missing, str(tmp_path / "imported")),
        ("import", str(checkpoint), str(tmp_path / "imported")),
        ("export", missing, str(tmp_path / "out.pt")),
        ("export", str(checkpoint), str(tmp_path / "out.unknown")),
        ("ls", missing),
        ("ls", str(tmp_path / "file")),
        ("ls", str(tmp_path / "empty")),
        ("ls", str(checkpoint)),
        ("ls", str(managed_root), "--tier-location", "nope=/tmp"),
        ("prune", str(tmp_path / "empty")),
        ("prune", str(checkpoint)),
        ("ledger", "status", missing),
        ("ledger", "reassign", missing, "0", "1"),
    ]
    for argv in cases:
        code, _, err = run(*argv)
        assert code == 2, (argv, code, err)
        assert err.startswith(f"shardkeep {argv[0]}: error: "), (argv, err)
    for argv in [("verify",), ("verify", str(checkpoint), "--progress", "sometimes"), ("ls", "r", "--keep-last", "-1")]:
        with pytest.raises(SystemExit) as exited:
            run(*argv)
        assert exited.value.code == 2
    # and 0 when all is well, 1 when a check finds a problem
    assert run("sign", str(checkpoint), "--key", str(private))[0] == 0
    assert run("verify", str(checkpoint), "--public-key", str(public))[0] == 0
    assert run("inspect", str(checkpoint))[0] == 0
    assert run("ls", str(managed_root))[0] == 0
    (checkpoint / "junk").write_text("x")
    assert run("verify", str(checkpoint))[0] == 1
    assert run("ls", str(checkpoint.parent))[0] == 1


def test_verify_of_a_manifest_that_cannot_be_read_exits_2(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkeep.errors import StorageError
    from shardkeep.storage import LocalStore

    real_open = LocalStore.open_read

    def refuse(self: LocalStore, path: str) -> object:
        if path.endswith("manifest.json"):
            raise StorageError(f"opening {path!r} failed: Permission denied (errno 13)")
        return real_open(self, path)

    monkeypatch.setattr(LocalStore, "open_read", refuse)
    code, out, err = run("verify", str(checkpoint))
    assert code == 2 and "Permission denied" in err and "FAILED" not in out


def test_messages_name_command_line_flags_not_python_keywords(
    checkpoint: Path, key_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    private, _ = key_pair
    assert run("sign", str(checkpoint), "--key", str(private))[0] == 0
    code, _, err = run("sign", str(checkpoint), "--key", str(private))
    assert code == 2 and "pass --replace" in err and "replace=True" not in err
    assert run("sign", str(checkpoint), "--key", str(private), "--replace")[0] == 0

    assert run("export", str(checkpoint), str(tmp_path / "out.pt"))[0] == 0
    code, _, err = run("export", str(checkpoint), str(tmp_path / "out.pt"))
    assert code == 2 and "pass --force" in err and "overwrite=" not in err
    code, _, err = run("export", str(checkpoint), str(tmp_path / "out.data"))
    assert code == 2 and "pass --format" in err and "format=" not in err

    code, _, err = run("verify", str(checkpoint), "--tier", "nope")
    assert code == 2 and "--tier nope" in err and "tiers=" not in err
    code, _, err = run("verify", str(checkpoint), "--tier-location", "nope=/x")
    assert code == 2 and "--tier-location nope" in err and "tier_locations" not in err

    for argv in (
        ("ledger", "status", str(tmp_path / "p.json")),
        ("ledger", "reassign", str(tmp_path / "p.json"), "0", "1"),
    ):
        code, _, err = run(*argv)
        assert code == 2 and "no progress ledger" in err and "initialize()" not in err


# -- ls on something that is not a root; quick checks labelled as such -------------------------


def test_ls_and_prune_say_what_they_found_instead_of_inventing_a_policy(checkpoint: Path, tmp_path: Path) -> None:
    for command in ("ls", "prune"):
        code, out, err = run(command, str(checkpoint))
        assert code == 2 and out == ""
        assert f"{checkpoint} is a checkpoint, not a root of checkpoints" in err
        assert f"shardkeep inspect {checkpoint}" in err and f"shardkeep {command} {checkpoint.parent}" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run("ls", str(empty))
    assert code == 2 and out == "" and f"no checkpoints under {empty}" in err and "policy" not in err
    # A directory of roots points at them.
    parent = tmp_path / "runs"
    sk.CheckpointManager(parent / "a").save({"w": torch.ones(2)}, step=1)
    code, _, err = run("ls", str(parent))
    assert code == 2 and f"roots of checkpoints below it: {parent / 'a'}" in err


def test_ls_names_the_source_of_its_policy(tmp_path: Path, checkpoint: Path) -> None:
    code, out, _ = run("ls", str(checkpoint.parent))
    assert code == 0 and "(no checkpoint records a policy: defaults)" in out
    code, out, _ = run("ls", str(checkpoint.parent), "--keep-last", "3")
    assert "keep_last=3" in out and "the options given, defaults for the rest" in out


# -- tiers whose location moved: --tier-location, and one message per missing tier -------------


@pytest.fixture
def tiered(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint in a root whose cold tier (8 files) was moved after the save."""
    cold = tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    state = {f"layer{i}.experts.w": torch.full((16,), float(i)) for i in range(8)} | {"dense": torch.ones(3)}
    path = tmp_path / "root" / "step_00000010"
    sk.save(
        state,
        path,
        options=sk.WriteOptions(file_size_target=1),
        tiers=sk.TierPlan(tiers=tiers, placement=[("*.experts.*", "cold"), ("*", "hot")]),
        step=10,
    )
    assert len({record.path for record in sk.read_manifest(path).files if record.tier == "cold"}) == 8
    moved = tmp_path / "cold-moved"
    cold.rename(moved)
    return path, moved


def test_a_moved_tier_is_one_message_with_the_remap_flag(tiered: tuple[Path, Path], tmp_path: Path) -> None:
    path, moved = tiered
    code, out, err = run("verify", str(path))
    assert code == 2, (out, err)
    problems = [line for line in out.splitlines() if line.startswith(("PROBLEM", "MISSING"))]
    assert len(problems) == 1, out
    assert "tier 'cold' is missing" in problems[0] and "--tier-location cold=NEW_LOCATION" in problems[0]
    assert "INCOMPLETE" in out and "1 file(s)" in out  # the hot tier was still checked

    code, out, _ = run("verify", str(path), "--tier-location", f"cold={moved}")
    assert code == 0 and out.startswith("OK") and "9 file(s)" in out
    code, out, _ = run("verify", str(path), "--json")
    document = json.loads(out)
    assert code == 2 and document["ok"] is False and list(document["missing_tiers"]) == ["cold"]

    code, out, _ = run("inspect", str(path))
    assert code == 0 and out.count("tier 'cold' is missing") == 1
    code, out, _ = run("inspect", str(path), "--tier-location", f"cold={moved}")
    assert code == 0 and f"read from {moved} (--tier-location)" in out and "missing" not in out

    code, _, err = run("export", str(path), str(tmp_path / "out.pt"))
    assert code == 2 and err.count("tier 'cold' is missing") == 1 and "--tier-location cold=" in err
    code, _, err = run("export", str(path), str(tmp_path / "out.pt"), "--tier-location", f"cold={moved}")
    assert code == 0, err
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(exported["layer7.experts.w"], torch.full((16,), 7.0))

    root = str(path.parent)
    code, out, _ = run("ls", root, "--verify")
    line = next(line for line in out.splitlines() if line.startswith("step_00000010"))
    assert code == 2 and "UNREADABLE: tier 'cold' is missing" in line and "--tier-location cold=" in line
    assert out.count("tier 'cold'") == 1
    code, out, _ = run("ls", root, "--verify", "--tier-location", f"cold={moved}")
    assert code == 0 and next(line for line in out.splitlines() if line.startswith("step_")).endswith(" verified")


def test_help_states_the_exit_codes_and_the_new_options() -> None:
    from shardkeep.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "0 success; 1 a check found problems" in text and "2 usage error" in text
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for name in ("inspect", "verify", "export", "ls"):
        assert "--tier-location NAME=LOCATION" in commands.choices[name].format_help(), name
    for name, parser_of in commands.choices.items():
        with pytest.raises(SystemExit) as exited:
            run(name, "--help")
        assert exited.value.code == 0, name
        assert parser_of.format_help()


def test_ls_plot_says_when_digests_were_not_checked_and_leaves_misnamed_copies_off(
    managed_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import shardkeep.report

    drawn: list[tuple[list[str], str]] = []

    def fake_plot(entries: list[sk.CheckpointEntry], *args: object, title: str) -> None:
        drawn.append(([entry.name for entry in entries], title))

    monkeypatch.setattr(shardkeep.report, "plot_root", fake_plot)
    shutil.copytree(managed_root / "step_00000020", managed_root / "step_00000099")
    run("ls", str(managed_root), "--plot", str(tmp_path / "a.png"))
    run("ls", str(managed_root), "--verify", "--plot", str(tmp_path / "b.png"))
    (quick, quick_title), (full, full_title) = drawn
    assert "step_00000099" not in quick and "step_00000099" not in full and "step_00000040" in quick
    assert "digests not verified" in quick_title and "digests not verified" not in full_title


def test_manifest_limit_mib_reads_a_checkpoint_over_the_default_limits(tmp_path: Path) -> None:
    """A checkpoint whose manifest is over the default limits: every reading command says how to
    raise them with the flag (not a Python keyword), and reads it with --manifest-limit-mib."""
    from shardkeep.config import ManifestLimits

    root = tmp_path / "root"
    checkpoint = root / "step_00000001"
    sk.save(
        {"w": torch.ones(3)}, checkpoint, step=1, fields=sk.ManifestFields(custom_fields={"padding": "x" * (2 << 20)})
    )
    small = ManifestLimits.scaled(1)
    assert small.max_bytes == 1 << 20 and small.max_tensors == round(ManifestLimits().max_tensors / 40)
    for argv in (
        ["verify", str(checkpoint)],
        ["inspect", str(checkpoint)],
        ["export", str(checkpoint), str(tmp_path / "o.pt")],
    ):
        out, err = io.StringIO(), io.StringIO()
        code = main([*argv, "--manifest-limit-mib", "1"], out=out, err=err)
        said = out.getvalue() + err.getvalue()
        assert code == (1 if argv[0] == "verify" else 2), (argv, said)  # verify: a problem found
        assert "over the limit" in said and "--manifest-limit-mib" in said and "ManifestLimits" not in said, said
        assert main([*argv, "--manifest-limit-mib", "3"], out=io.StringIO(), err=io.StringIO()) == 0, argv
    out = io.StringIO()
    assert main(["ls", str(root), "--verify", "--manifest-limit-mib", "3"], out=out, err=io.StringIO()) == 0, (
        out.getvalue()
    )
    assert main(["ls", str(root), "--verify", "--manifest-limit-mib", "1"], out=io.StringIO(), err=io.StringIO()) != 0


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every runnable command of the CLI, by name (``ledger status``, ``ledger reassign`` ...)."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = _subcommands(sub)
                found.update({f"{name} {inner}": p for inner, p in nested.items()} if nested else {name: sub})
    return found


def test_every_command_has_json_output() -> None:
    from shardkeep.cli import build_parser

    commands = _subcommands(build_parser())
    assert len(commands) >= 10, sorted(commands)
    without = [name for name, parser in commands.items() if "--json" not in parser._option_string_actions]
    assert without == []


def test_json_output_of_every_command_parses_and_holds_its_fields(
    checkpoint: Path, managed_root: Path, tmp_path: Path
) -> None:
    """Each command with --json prints one JSON object on stdout (the fields docs/cli.md
    documents), and nothing else."""

    def document(*argv: str) -> dict[str, object]:
        code, out, err = run(*argv, "--json")
        assert code == 0 and err == "", (argv, err)
        parsed = json.loads(out)
        assert isinstance(parsed, dict)
        return parsed

    key = tmp_path / "k.pem"
    made = document("keygen", str(key))
    assert made["private"] == str(key) and made["public"] == f"{key}.pub" and made["encrypted"] is False
    signed = document("sign", str(checkpoint), "--key", str(key))
    assert signed == {"path": str(checkpoint), "key_id": made["key_id"], "replaced": False}
    exported = document("export", str(checkpoint), str(tmp_path / "out.pt"))
    assert exported["format"] == "pt" and exported["tensors"] and str(exported["dest"]).endswith("out.pt")
    imported = document("import", str(tmp_path / "out.pt"), str(tmp_path / "back"))
    assert imported["format"] == "pt" and imported["signed"] is False
    assert imported["summary"]["tensor_count"] == exported["tensors"]
    pruned = document("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0")
    assert pruned["applied"] is False and pruned["delete"] and pruned["keep"]
    assert pruned["policy"]["keep_last"] == 1
    assert {p.name for p in managed_root.iterdir()} >= set(pruned["delete"])  # a dry run deletes nothing
    applied = document("prune", str(managed_root), "--keep-last", "1", "--keep-best", "0", "--apply")
    assert applied["applied"] is True and applied["delete"] == pruned["delete"]
    assert not ({p.name for p in managed_root.iterdir()} & set(applied["delete"]))
    ledger = sk.ProgressLedger(str(tmp_path / "ledger.json"), world_size=2)
    ledger.initialize()
    moved = document("ledger", "reassign", str(tmp_path / "ledger.json"), "1", "0")
    assert moved == {
        "path": str(tmp_path / "ledger.json"),
        "shard": 1,
        "original_rank": 1,
        "previous_worker": 1,
        "worker": 0,
    }
    assert document("ledger", "status", str(tmp_path / "ledger.json"))["progress"]
    assert document("verify", str(checkpoint))["ok"] is True
    assert document("inspect", str(checkpoint))["manifest"]["step"] == 7
    assert document("ls", str(managed_root))["checkpoints"]


def test_errors_with_json_are_one_json_object_on_stderr(tmp_path: Path) -> None:
    code, out, err = run("inspect", str(tmp_path / "missing"), "--json")
    assert code == 2 and out == ""
    error = json.loads(err)["error"]
    assert (
        error["command"] == "inspect" and error["type"] == "CheckpointNotFoundError" and "missing" in error["message"]
    )
    code, out, err = run("ledger", "reassign", str(tmp_path / "none.json"), "0", "1", "--json")
    assert code == 2 and json.loads(err)["error"]["command"] == "ledger reassign"
