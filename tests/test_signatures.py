"""Signed manifests: ``manifest.sig`` is an Ed25519 signature over a
domain-separation prefix and the manifest's exact bytes, checked before the manifest is parsed."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import shardkeep as sk
from shardkeep.cli import main
from shardkeep.integrity import (
    PASSPHRASE_ENV,
    SIGNATURE_DOMAIN,
    generate_key_pair,
    key_id,
    parse_signature,
    seal_manifest,
)


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 5}


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _resign_raw(checkpoint: Path, key: Ed25519PrivateKey, message: bytes) -> None:
    """Write a well-formed manifest.sig holding a signature by ``key`` over ``message``."""
    record = {
        "format": "shardkeep-signature/1",
        "algorithm": "ed25519",
        "key_id": key_id(key.public_key()),
        "signature": key.sign(message).hex(),
    }
    (checkpoint / "manifest.sig").write_bytes(msgspec.json.encode(record) + b"\n")


def test_a_signed_checkpoint_loads_and_verifies_with_its_public_key(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint, signer=key)
    manifest_bytes = (checkpoint / "manifest.json").read_bytes()
    signer, raw = parse_signature((checkpoint / "manifest.sig").read_bytes())
    assert signer == key_id(key.public_key())
    key.public_key().verify(raw, SIGNATURE_DOMAIN + manifest_bytes)  # over the exact bytes, with the prefix
    loaded = sk.load(checkpoint, public_key=key.public_key())
    assert torch.equal(loaded["w"], _state()["w"])
    report = sk.verify(checkpoint, public_key=key.public_key())
    assert report.ok, report.problems
    assert report.signature.startswith("valid signature by key ")
    assert sk.read_manifest(checkpoint, public_key=key.public_key()).files
    unchecked = sk.verify(checkpoint)
    assert unchecked.ok and "not checked" in unchecked.signature


def test_keys_from_pem_files_including_an_encrypted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    identity = generate_key_pair(tmp_path / "plain.pem", tmp_path / "plain.pem.pub")
    assert (tmp_path / "plain.pem").stat().st_mode & 0o777 == 0o600
    sk.save(_state(), tmp_path / "a", signer=tmp_path / "plain.pem")
    assert sk.verify(tmp_path / "a", public_key=str(tmp_path / "plain.pem.pub")).signature.endswith(identity[:16])

    monkeypatch.setenv(PASSPHRASE_ENV, "correct horse")
    generate_key_pair(tmp_path / "locked.pem", tmp_path / "locked.pub")
    assert b"ENCRYPTED" in (tmp_path / "locked.pem").read_bytes()
    sk.save(_state(), tmp_path / "b", signer=str(tmp_path / "locked.pem"))
    assert sk.verify(tmp_path / "b", public_key=tmp_path / "locked.pub").ok
    monkeypatch.setenv(PASSPHRASE_ENV, "wrong")
    with pytest.raises(sk.ConfigError, match=r"locked\.pem"):
        sk.save(_state(), tmp_path / "c", signer=tmp_path / "locked.pem")
    assert not (tmp_path / "c").exists()
    monkeypatch.delenv(PASSPHRASE_ENV)
    with pytest.raises(sk.ConfigError, match=PASSPHRASE_ENV):
        sk.save(_state(), tmp_path / "c", signer=tmp_path / "locked.pem")

    with pytest.raises(sk.ConfigError, match="already exists"):
        generate_key_pair(tmp_path / "plain.pem", tmp_path / "other.pub")
    with pytest.raises(sk.ConfigError, match="not a readable PEM"):
        sk.verify(tmp_path / "a", public_key=tmp_path / "plain.pem")  # a private key is not a public key
    with pytest.raises(sk.ConfigError, match="cannot read"):
        sk.load(tmp_path / "a", public_key=tmp_path / "missing.pub")
    with pytest.raises(sk.ConfigError, match="must be an Ed25519PrivateKey"):
        sk.save(_state(), tmp_path / "d", signer=b"not a key")


def test_the_signature_is_checked_before_the_manifest_is_parsed(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint, signer=key)
    os.chmod(checkpoint / "manifest.json", 0o644)
    nested = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (checkpoint / "manifest.json").write_bytes(seal_manifest(nested, "blake3"))
    # Without a key the parser sees it and refuses it; with a key it is never parsed.
    with pytest.raises(sk.ManifestError):
        sk.load(checkpoint)
    with pytest.raises(sk.SignatureError, match="changed after it was signed"):
        sk.load(checkpoint, public_key=key.public_key())
    report = sk.verify(checkpoint, public_key=key.public_key())
    assert report.manifest is None
    assert [p.split(":")[0] for p in report.problems] == ["manifest.sig"]


def test_a_resealed_manifest_passes_the_seal_but_not_the_signature(
    tmp_path: Path, key: Ed25519PrivateKey, reseal: Callable[..., None]
) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint, signer=key)

    def change_value(raw: dict[str, Any]) -> None:
        raw["values"][0]["value"] = 6

    reseal(checkpoint, change_value)
    assert sk.load(checkpoint)["step"] == 6  # the seal detects damage, not an attacker
    with pytest.raises(sk.SignatureError):
        sk.load(checkpoint, public_key=key.public_key())
    assert not sk.verify(checkpoint, public_key=key.public_key()).ok


def test_unsigned_wrong_key_and_undomained_signatures_are_refused(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    unsigned = tmp_path / "unsigned"
    sk.save(_state(), unsigned)
    with pytest.raises(sk.SignatureError, match="missing"):
        sk.load(unsigned, public_key=key.public_key())
    assert sk.load(unsigned, public_key=key.public_key(), require_signature=False)["step"] == 5
    assert not sk.verify(unsigned, public_key=key.public_key()).ok
    assert sk.verify(unsigned, public_key=key.public_key(), require_signature=False).ok
    with pytest.raises(sk.ConfigError, match="needs public_key"):
        sk.load(unsigned, require_signature=True)
    with pytest.raises(sk.ConfigError, match="verify=False"):
        sk.load(unsigned, public_key=key.public_key(), verify=False)

    other = Ed25519PrivateKey.generate()
    signed = tmp_path / "signed"
    sk.save(_state(), signed, signer=other)
    with pytest.raises(sk.SignatureError, match="made with key"):
        sk.load(signed, public_key=key.public_key())
    # require_signature=False still refuses a signature that is present but wrong.
    with pytest.raises(sk.SignatureError):
        sk.load(signed, public_key=key.public_key(), require_signature=False)

    # A valid Ed25519 signature by the right key, but over the bare manifest (no domain prefix).
    _resign_raw(signed, key, (signed / "manifest.json").read_bytes())
    with pytest.raises(sk.SignatureError, match="changed after it was signed"):
        sk.load(signed, public_key=key.public_key())
    _resign_raw(signed, key, SIGNATURE_DOMAIN + (signed / "manifest.json").read_bytes())
    assert sk.load(signed, public_key=key.public_key())["step"] == 5


def test_non_cryptographic_digests_are_never_signed_or_trusted(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="cryptographic digest"):
        sk.save(_state(), tmp_path / "fast", options=sk.WriteOptions(digest="xxh3-128"), signer=key)
    assert not (tmp_path / "fast").exists() and not list(tmp_path.iterdir())
    sk.save(_state(), tmp_path / "fast", options=sk.WriteOptions(digest="xxh3-128"))
    with pytest.raises(sk.UnsupportedValueError, match="not cryptographic"):
        from shardkeep.verification import sign_checkpoint

        sign_checkpoint(tmp_path / "fast", key)
    assert not (tmp_path / "fast" / "manifest.sig").exists()
    # Signed anyway, by hand: a reader with the key still refuses it.
    _resign_raw(tmp_path / "fast", key, SIGNATURE_DOMAIN + (tmp_path / "fast" / "manifest.json").read_bytes())
    with pytest.raises(sk.SignatureError, match="not cryptographic"):
        sk.load(tmp_path / "fast", public_key=key.public_key())
    assert not sk.verify(tmp_path / "fast", public_key=key.public_key()).ok
    sk.save(_state(), tmp_path / "sha", options=sk.WriteOptions(digest="sha256"), signer=key)
    assert sk.verify(tmp_path / "sha", public_key=key.public_key()).ok


def test_malformed_signature_files_are_typed_errors(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint, signer=key)
    good = (checkpoint / "manifest.sig").read_bytes()
    for bad in [b"", b"{}", good.replace(b'"ed25519"', b'"rsa"'), good.rstrip(b"\n"), good + b" ", b"x" * 5000]:
        (checkpoint / "manifest.sig").write_bytes(bad)
        with pytest.raises(sk.SignatureError):
            sk.load(checkpoint, public_key=key.public_key())
        report = sk.verify(checkpoint)  # without a key, a malformed signature is still a problem
        assert not report.ok and report.problems[0].startswith("manifest.sig")
    (checkpoint / "manifest.sig").unlink()
    os.mkfifo(checkpoint / "manifest.sig")
    with pytest.raises(sk.ShardkeepError, match=r"special file|not a regular file"):
        sk.load(checkpoint, public_key=key.public_key())


@pytest.mark.timeout(60)
def test_key_files_must_be_small_regular_files(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    """A FIFO given as a key (an open of it would block forever), a device, a directory, a symlink
    to any of them or a huge file is refused promptly, with the path and the reason."""
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint, signer=key)
    generate_key_pair(tmp_path / "k.pem", tmp_path / "k.pub")
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"-" * (1 << 20))
    link = tmp_path / "link.pem"
    os.symlink(tmp_path / "k.pem", link)
    link_to_fifo = tmp_path / "fifo-link.pem"
    os.symlink(fifo, link_to_fifo)
    cases = {
        fifo: "is a FIFO, not a regular file",
        link_to_fifo: "is a FIFO, not a regular file",  # a symlink is followed, to a regular file only
        Path("/dev/zero"): "is a character device, not a regular file",
        tmp_path / "k.pub.d": "is a directory, not a regular file",
        huge: "is 1048576 bytes, over the limit of 65536",
    }
    (tmp_path / "k.pub.d").mkdir()
    before = sorted(os.listdir(tmp_path))
    for path, reason in cases.items():
        started = time.monotonic()
        expected = re.escape(f"{str(path)!r} {reason}")
        with pytest.raises(sk.ConfigError, match=expected):
            sk.verify(checkpoint, public_key=path)
        with pytest.raises(sk.ConfigError, match=expected):
            sk.load(checkpoint, public_key=str(path))
        with pytest.raises(sk.ConfigError, match=expected):
            sk.save(_state(), tmp_path / "new", signer=path)
        assert time.monotonic() - started < 10, path
        assert sorted(os.listdir(tmp_path)) == before  # the refused save left nothing
    assert sk.verify(checkpoint, public_key=key.public_key()).ok
    # A symlink to a regular key file (how Kubernetes mounts secrets) is followed.
    sk.save(_state(), tmp_path / "via-link", signer=link)
    assert sk.verify(tmp_path / "via-link", public_key=tmp_path / "k.pub").ok


def test_the_cli_refuses_a_fifo_key_promptly(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint)
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    for argv in (["verify", str(checkpoint), "--public-key", str(fifo)], ["sign", str(checkpoint), "--key", str(fifo)]):
        result = subprocess.run(
            [sys.executable, "-m", "shardkeep", *argv], capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert f"{str(fifo)!r} is a FIFO, not a regular file" in result.stderr, result.stderr
    assert sorted(os.listdir(checkpoint)) == ["manifest.json", "shards"]


def test_signing_an_existing_checkpoint_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert main(["keygen", str(tmp_path / "k.pem")], out=out) == 0
    assert "key id" in out.getvalue() and (tmp_path / "k.pem.pub").exists()
    assert main(["keygen", str(tmp_path / "k.pem")], out=io.StringIO(), err=io.StringIO()) == 2

    checkpoint = tmp_path / "ckpt"
    sk.save(_state(), checkpoint)
    public = str(tmp_path / "k.pem.pub")
    out = io.StringIO()
    assert main(["verify", str(checkpoint), "--public-key", public], out=out) == 1
    assert "manifest.sig is missing" in out.getvalue()
    assert main(["verify", str(checkpoint), "--public-key", public, "--allow-unsigned"], out=io.StringIO()) == 0

    out = io.StringIO()
    assert main(["sign", str(checkpoint), "--key", str(tmp_path / "k.pem")], out=out) == 0
    assert "signed" in out.getvalue()
    out = io.StringIO()
    assert main(["verify", str(checkpoint), "--public-key", public], out=out) == 0
    assert "valid signature by key" in out.getvalue()
    assert sorted(p.name for p in checkpoint.iterdir()) == ["manifest.json", "manifest.sig", "shards"]

    err = io.StringIO()
    assert main(["sign", str(checkpoint), "--key", str(tmp_path / "k.pem")], out=io.StringIO(), err=err) == 2
    assert "already signed" in err.getvalue()
    generate_key_pair(tmp_path / "new.pem", tmp_path / "new.pub")
    assert main(["sign", str(checkpoint), "--key", str(tmp_path / "new.pem"), "--replace"], out=io.StringIO()) == 0
    assert main(["verify", str(checkpoint), "--public-key", public], out=io.StringIO()) == 1
    out = io.StringIO()
    assert main(["verify", str(checkpoint), "--public-key", str(tmp_path / "new.pub"), "--json"], out=out) == 0
    assert json.loads(out.getvalue())["signature"].startswith("valid")


def test_the_manager_signs_and_restore_falls_back_past_a_bad_signature(
    tmp_path: Path, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture, make_state: Callable[..., dict[str, Any]]
) -> None:
    root = tmp_path / "root"
    manager = sk.CheckpointManager(
        root, keep_last=3, keep_best=0, signer=key, public_key=key.public_key(), verify_newest=True
    )
    state = make_state()
    manager.save(state, step=1, metrics={"val_loss": 1.0})
    manager.async_save(state, step=2, metrics={"val_loss": 0.5}).result(60)
    assert all((root / name / "manifest.sig").exists() for name in ("step_00000001", "step_00000002"))
    # The newest checkpoint re-signed by a stranger: restore must not take it.
    other = Ed25519PrivateKey.generate()
    _resign_raw(
        root / "step_00000002", other, SIGNATURE_DOMAIN + (root / "step_00000002" / "manifest.json").read_bytes()
    )
    with caplog.at_level(logging.WARNING, logger="shardkeep"):
        restored = sk.CheckpointManager(
            root, keep_last=3, keep_best=0, public_key=key.public_key(), read_only=True
        ).restore()
    assert restored.entry.step == 1
    assert restored.skipped and "SignatureError" in restored.skipped[0][1]
    assert "falling back" in caplog.text
    # A manager without a key accepts it (the data is intact); one that requires signatures
    # refuses an unsigned checkpoint.
    assert sk.CheckpointManager(root, keep_last=3, keep_best=0).restore().entry.step == 2
    (root / "step_00000002" / "manifest.sig").unlink()
    assert (
        sk.CheckpointManager(root, keep_last=3, keep_best=0, public_key=key.public_key(), read_only=True)
        .restore()
        .entry.step
        == 1
    )


def test_a_signed_save_to_s3(s3_root: tuple[str, dict[str, Any]], key: Ed25519PrivateKey) -> None:
    root, options = s3_root
    sk.save(_state(), f"{root}/step_1", signer=key, options=sk.WriteOptions(storage_options=options))
    assert sk.load(f"{root}/step_1", public_key=key.public_key(), storage_options=options)["step"] == 5
    report = sk.verify(f"{root}/step_1", public_key=key.public_key(), storage_options=options)
    assert report.ok and report.signature.startswith("valid")


def test_two_coordinators_racing_on_s3_leave_the_winner_signed(
    s3_root: tuple[str, dict[str, Any]], key: Ed25519PrivateKey
) -> None:
    from shardkeep.distributed.commit import CheckpointCommit
    from shardkeep.storage import FsspecStore

    store = FsspecStore(*s3_root)
    winner, loser = CheckpointCommit(store, "step_1"), CheckpointCommit(store, "step_1")
    winner.begin()
    loser.begin()
    winner.commit(b"manifest A", b"signature A\n")
    with pytest.raises(sk.CheckpointExistsError):
        loser.commit(b"manifest B", b"signature B\n")
    loser.abort()
    handle = store.open_read("step_1/manifest.sig")
    found = bytearray(handle.size)
    handle.read_into(0, memoryview(found))
    handle.close()
    assert bytes(found) == b"signature A\n"


def test_a_leftover_signature_never_sticks_to_a_later_checkpoint(
    s3_root: tuple[str, dict[str, Any]], key: Ed25519PrivateKey
) -> None:
    from shardkeep.storage import FsspecStore

    store = FsspecStore(*s3_root)
    other = Ed25519PrivateKey.generate()
    # A signed attempt that died after writing its signature but before its manifest (the
    # old order), or whose manifest was removed by retention first.
    sk.save(_state(), "step_1", storage=store, signer=other)
    store.remove_tree("step_1/manifest.json")
    sk.save(_state(), "step_1", storage=store)  # unsigned: the leftover signature goes
    assert store.stat("step_1/manifest.sig") is None
    assert sk.verify("step_1", storage=store).signature == "not signed"
    store.remove_tree("step_1/manifest.json")
    sk.save(_state(), "step_1", storage=store, signer=key)  # signed: replaced by the new one
    assert sk.verify("step_1", storage=store, public_key=key.public_key()).ok
