"""The ``keygen`` and ``sign`` commands: make an Ed25519 key pair and sign a committed checkpoint."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from shardkeep.cli.format import json_argument, write_json
from shardkeep.errors import (
    CheckpointExistsError,
)
from shardkeep.integrity import PASSPHRASE_ENV, generate_key_pair
from shardkeep.verification import (
    sign_checkpoint,
)


def add_keygen(commands: Any) -> None:
    """``shardkeep keygen``: a new Ed25519 key pair."""
    keygen = commands.add_parser(
        "keygen",
        help="write a new Ed25519 key pair for signing checkpoints",
        description="Write PRIVATE (PKCS#8 PEM, mode 0600) and PRIVATE.pub (or --public). If "
        f"${PASSPHRASE_ENV} is set, the private key is encrypted with it (and read with it when signing). "
        "Existing files are never overwritten.",
    )
    keygen.add_argument("private", metavar="PRIVATE", help="where to write the private key, e.g. signing.pem")
    keygen.add_argument("--public", metavar="PATH", help="where to write the public key (default: PRIVATE.pub)")
    json_argument(keygen, "the files written and the key id")


def add_sign(commands: Any) -> None:
    """``shardkeep sign``: write manifest.sig."""
    sign = commands.add_parser(
        "sign",
        help="sign a committed checkpoint: write manifest.sig over the manifest's exact bytes",
        description="Check the manifest, then write manifest.sig: an Ed25519 signature over a domain-separation "
        "prefix and manifest.json's exact bytes. The manifest records every file's digest, so the signature covers "
        "the data; manifests with xxh3-128 digests are refused.",
    )
    sign.add_argument("path", metavar="PATH", help="a committed checkpoint: a directory or a URL")
    sign.add_argument("--key", required=True, metavar="PEM", help="the Ed25519 private key (from shardkeep keygen)")
    sign.add_argument("--replace", action="store_true", help="replace an existing signature")
    json_argument(sign, "the checkpoint and the key id")


def run_keygen(args: argparse.Namespace, out: TextIO) -> int:
    public = args.public or f"{args.private}.pub"
    identity = generate_key_pair(args.private, public)
    if args.json:
        encrypted = bool(os.environ.get(PASSPHRASE_ENV))
        write_json(out, {"private": args.private, "public": public, "key_id": identity, "encrypted": encrypted})
        return 0
    out.write(f"wrote {args.private} (private, keep it secret) and {public} (public)\nkey id {identity}\n")
    return 0


def run_sign(args: argparse.Namespace, out: TextIO) -> int:
    try:
        identity = sign_checkpoint(args.path, args.key, replace=args.replace)
    except CheckpointExistsError as exc:  # the only one sign_checkpoint raises: a signature is there
        raise CheckpointExistsError(
            f"{args.path} is already signed (manifest.sig exists); pass --replace to replace the signature"
        ) from exc
    if args.json:
        write_json(out, {"path": args.path, "key_id": identity, "replaced": bool(args.replace)})
        return 0
    out.write(f"signed {args.path} with key {identity[:16]}\n")
    return 0
