"""SaveSettings is the single source of the save options: the keyword signatures of ``save`` and
``async_save`` must match its fields (names, defaults, annotations), and the checkpoint manager
accepts and forwards exactly its manager options."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
import shardkeep.saving as saving
from shardkeep.saving import SaveSettings

ASYNC_ONLY = {"wait", "staging_budget", "after_commit"}


def _keywords(function: Any) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name: p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _fields(*, for_async: bool = False) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in SaveSettings.option_fields(for_async=for_async)}


@pytest.mark.parametrize(
    ("function", "extra", "for_async"),
    [(sk.save, set(), False), (sk.async_save, ASYNC_ONLY, True)],
    ids=["save", "async_save"],
)
def test_signature_matches_the_settings(function: Any, extra: set[str], for_async: bool) -> None:
    keywords = _keywords(function)
    fields = _fields(for_async=for_async)
    assert set(keywords) == set(fields) | extra
    for name, option in fields.items():
        parameter = keywords[name]
        assert parameter.default == option.default, name
        assert parameter.annotation == option.type, name


def test_every_setting_reaches_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value given to ``save`` arrives in the SaveSettings the job runs with (so a new field
    cannot be silently dropped by ``from_arguments``)."""
    seen: list[SaveSettings] = []
    real = saving.run_save

    def spy(state: Any, path: Any, settings: SaveSettings) -> Any:
        seen.append(settings)
        return real(state, path, settings)  # the real save: the manifest must agree too

    monkeypatch.setattr(sk.api, "run_save", spy)
    manifest = sk.save({"w": torch.zeros(2)}, tmp_path / "c", digest="sha256", model_id="m", epoch=3, timeout=7.0)
    assert (manifest.digest_algorithm, manifest.model_id, manifest.epoch) == ("sha256", "m", 3)
    assert seen and seen[0].digest == "sha256" and seen[0].model_id == "m"
    assert seen[0].epoch == 3 and seen[0].timeout == 7.0


def test_settings_validate_when_built() -> None:
    with pytest.raises(sk.UnsupportedValueError, match="digest='md5'"):
        SaveSettings(digest="md5")
    with pytest.raises(sk.UnsupportedValueError, match="io_threads=0"):
        SaveSettings(io_threads=0)
    assert SaveSettings(compression="zstd").io.compression == "zstd"


def test_manager_options_are_the_non_call_fields() -> None:
    options = SaveSettings.manager_options()
    assert "digest" in options and "signer" in options and "tiers" in options
    # The manager decides these itself for every save.
    assert not {"step", "metrics", "run", "storage", "incremental", "process_group", "started"} & set(options)


def test_manager_refuses_an_unknown_option_by_name(tmp_path: Path) -> None:
    with pytest.raises(sk.ConfigError, match=r"\['digets'\]"):
        sk.CheckpointManager(tmp_path / "root", digets="sha256")
    with pytest.raises(sk.ConfigError, match="step"):
        sk.CheckpointManager(tmp_path / "root", step=3)


def test_manager_validates_save_options_at_construction(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="compression='lz4'"):
        sk.CheckpointManager(tmp_path / "root", compression="lz4")


def test_manager_forwards_every_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_state: Callable[..., dict[str, Any]]
) -> None:
    """Every manager option given at construction arrives, unchanged, in the settings of each
    save; checked generically over SaveSettings.manager_options()."""
    given: dict[str, Any] = {
        "digest": "sha256",
        "byte_budget": 8 << 20,
        "io_threads": 3,
        "file_size_target": 1 << 20,
        "compression": "zstd",
        "compression_level": 5,
        "model_id": "tiny",
        "epoch": 4,
        "training": {"learning_rate": 0.5},
        "sharding_strategy": "none",
        "custom_fields": {"team": "a"},
        "tiers": None,
        "placement": None,
        "signer": None,
        # Needs incremental, which the manager refuses beside compression: its forwarding is
        # shown in test_trust_versions.test_async_saves_never_use_the_proof.
        "trust_versions": False,
    }
    assert set(given) == set(SaveSettings.manager_options()), "a new manager option needs a case here"
    seen: list[SaveSettings] = []
    real = saving.run_save

    def spy(state: Any, path: Any, settings: SaveSettings) -> Any:
        seen.append(settings)
        return real(state, path, settings)

    monkeypatch.setattr("shardkeep.manager.run_save", spy)
    manager = sk.CheckpointManager(tmp_path / "root", keep_last=2, keep_best=0, **given)
    entry = manager.save(make_state(), step=10, metrics={"val_loss": 1.0})
    assert len(seen) == 1
    for name, value in given.items():
        assert getattr(seen[0], name) == value, name
    assert seen[0].step == 10 and seen[0].run is not None
    manifest = sk.read_manifest(entry.path)
    assert manifest.digest_algorithm == "sha256"
    assert manifest.model_id == "tiny" and manifest.epoch == 4
    assert manifest.custom_fields == {"team": "a"}
    assert manifest.training.learning_rate == 0.5
    assert all(record.path.endswith(".zst") for record in manifest.files)
