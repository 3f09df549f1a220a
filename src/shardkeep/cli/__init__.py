"""The ``shardkeep`` command line: argument parsing and printing. Imports without torch (``import``
and ``export`` load it when they run).

Exit status, for every command: 0 on success, 1 when a check finds a problem (``verify``, ``ls``),
2 on bad usage, or when the path is not what the command needs (no checkpoint there, a checkpoint
given as a root, a root without checkpoints) or cannot be read (permissions, a tier location that
is gone). Messages name the command-line flags, never the Python keyword arguments behind them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from shardkeep.cli.checkpoints import add_inspect, add_verify, run_inspect, run_verify
from shardkeep.cli.convert import add_export_command, add_import_command, run_export, run_import
from shardkeep.cli.format import cli_words, write_json
from shardkeep.cli.keys import add_keygen, add_sign, run_keygen, run_sign
from shardkeep.cli.ledger import add_ledger, run_ledger_reassign, run_ledger_status
from shardkeep.cli.root import add_ls, add_prune, run_ls, run_prune
from shardkeep.errors import ShardkeepError

__all__ = ["build_parser", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardkeep")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkeep",
        description="Inspect, verify, sign, list and prune shardkeep checkpoints; import and export other formats; "
        "show and change progress ledgers.",
        epilog="Exit status (every command): 0 success; 1 a check found problems (verify, ls); 2 usage error, or "
        "the path is not what the command needs (no checkpoint there, a checkpoint where a root of checkpoints is "
        "expected, a root without checkpoints) or cannot be read (permissions, a tier location that is gone). "
        "Paths may be s3:// URLs: credentials and endpoint come from the standard AWS environment variables "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION).",
    )
    parser.add_argument("--version", action="version", version=f"shardkeep {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_inspect(commands)
    add_verify(commands)
    add_keygen(commands)
    add_sign(commands)
    add_import_command(commands)
    add_export_command(commands)
    add_ls(commands)
    add_prune(commands)
    add_ledger(commands)
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return run_inspect(args, out)
        if args.command == "verify":
            return run_verify(args, out, err)
        if args.command == "keygen":
            return run_keygen(args, out)
        if args.command == "sign":
            return run_sign(args, out)
        if args.command == "import":
            return run_import(args, out)
        if args.command == "export":
            return run_export(args, out)
        if args.command == "ls":
            return run_ls(args, out)
        if args.command == "prune":
            return run_prune(args, out)
        if args.command == "ledger" and args.ledger_command == "status":
            return run_ledger_status(args, out)
        if args.command == "ledger" and args.ledger_command == "reassign":
            return run_ledger_reassign(args, out)
    except ShardkeepError as exc:
        if getattr(args, "json", False):
            command = " ".join(part for part in (args.command, getattr(args, "ledger_command", None)) if part)
            write_json(err, {"error": {"command": command, "type": type(exc).__name__, "message": str(exc)}})
            return 2
        err.write(f"shardkeep {args.command}: error: {cli_words(str(exc))}\n")
        return 2
    except BrokenPipeError:
        return 0
    raise AssertionError(f"unhandled command {args.command}")
