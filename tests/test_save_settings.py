"""The save settings come from the public option groups: every field of ``SaveSettings`` is
reachable from a group (``WriteOptions``, ``TierPlan``, ``Incremental``, ``ManifestFields``) or an
argument of ``save``; ``save``, ``async_save`` and the checkpoint manager forward every group;
the keyword spellings of the previous release still work, with one ``DeprecationWarning``, and
give the same checkpoint; an unknown keyword is refused by name."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
import shardkeep.saving as saving
from shardkeep.options import INTERNAL_KEYWORDS, regroup
from shardkeep.saving import SaveSettings
from tests.support.states import make_state

#: SaveSettings field -> (group, field of the group) for the fields a group carries.
GROUPED = {
    **{f.name: (sk.WriteOptions, f.name) for f in dataclasses.fields(sk.WriteOptions)},
    **{f.name: (sk.ManifestFields, f.name) for f in dataclasses.fields(sk.ManifestFields)},
    "tiers": (sk.TierPlan, "tiers"),
    "placement": (sk.TierPlan, "placement"),
    "incremental": (sk.Incremental, "base"),
    "trust_versions": (sk.Incremental, "trust_versions"),
}
#: SaveSettings fields that are arguments of ``save`` itself.
ARGUMENTS = {"step", "signer", "storage", "process_group", "timeout"}


#: Every write option at a value other than its default.
NON_DEFAULT_WRITE = sk.WriteOptions(
    digest="sha256",
    byte_budget=8 << 20,
    io_threads=3,
    file_size_target=1 << 20,
    compression="zstd",
    compression_level=5,
    progress=True,
    storage_options={"anon": True},
    block_size=0,
)


def _init_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(SaveSettings) if f.init]


def test_every_setting_is_reachable_from_the_public_groups() -> None:
    """A new SaveSettings field fails here until a group or an argument of ``save`` carries it."""
    parameters = inspect.signature(sk.save).parameters
    for name in _init_fields():
        if name in GROUPED:
            group, attribute = GROUPED[name]
            assert attribute in {f.name for f in dataclasses.fields(group)}, name
        elif name in ARGUMENTS:
            assert name in parameters, name
        else:
            assert name in INTERNAL_KEYWORDS, f"SaveSettings.{name} is reachable from no group nor argument of save"
    assert not ({"started", "run", "budget"} & set(parameters)), "internals stay out of the public signature"
    assert len(parameters) <= 12


def test_every_group_field_arrives_in_the_settings() -> None:
    """Each field of each group, given a value other than its default, arrives in the settings."""
    tier = sk.Tier(tier_id=1, name="hot")
    groups = regroup(
        "save",
        {},
        options=NON_DEFAULT_WRITE,
        tiers=sk.TierPlan(tiers=[tier], placement=[("*", "hot")]),
        incremental=sk.Incremental(base="elsewhere", trust_versions=True),
        fields=sk.ManifestFields(
            model_id="m",
            epoch=2,
            training={"learning_rate": 0.5},
            sharding_strategy="none",
            custom_fields={"a": 1},
            metrics={"loss": 1.0},
        ),
    )
    settings = SaveSettings.of(groups, step=7, signer="key.pem", storage=None, process_group=sk.LOCAL, timeout=9.0)
    by_type = {type(group): group for group in (groups.options, groups.tiers, groups.incremental, groups.fields)}
    defaults = SaveSettings()
    for name, (group, attribute) in GROUPED.items():
        given = getattr(by_type[group], attribute)
        assert getattr(settings, name) == given, name
        assert getattr(settings, name) != getattr(defaults, name), f"{name}: give it a value other than its default"
    assert (settings.step, settings.signer, settings.process_group, settings.timeout) == (7, "key.pem", "local", 9.0)


def test_every_setting_reaches_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value given to ``save`` arrives in the SaveSettings the job runs with (so a new field
    cannot be silently dropped by ``SaveSettings.of``)."""
    seen: list[SaveSettings] = []
    real = saving.run_save

    def spy(state: Any, path: Any, settings: SaveSettings) -> Any:
        seen.append(settings)
        return real(state, path, settings)  # the real save: the manifest must agree too

    monkeypatch.setattr(sk.api, "run_save", spy)
    manifest = sk.save(
        {"w": torch.zeros(2)},
        tmp_path / "c",
        options=sk.WriteOptions(digest="sha256"),
        fields=sk.ManifestFields(model_id="m", epoch=3),
        timeout=7.0,
    )
    assert (manifest.digest_algorithm, manifest.model_id, manifest.epoch) == ("sha256", "m", 3)
    assert seen and seen[0].digest == "sha256" and seen[0].model_id == "m"
    assert seen[0].epoch == 3 and seen[0].timeout == 7.0


def test_settings_validate_when_built() -> None:
    with pytest.raises(sk.UnsupportedValueError, match="digest='md5'"):
        SaveSettings(digest="md5")
    with pytest.raises(sk.UnsupportedValueError, match="io_threads=0"):
        SaveSettings(io_threads=0)
    assert SaveSettings(compression="zstd").io.compression == "zstd"


def test_the_manager_takes_the_groups_and_decides_each_save_itself(tmp_path: Path) -> None:
    """The manager takes the groups of ``save`` (digest, signer, tiers ... apply to every save);
    the per-save names (step, metrics, run, started, budget) it decides itself and refuses."""
    parameters = inspect.signature(sk.CheckpointManager).parameters
    assert {"options", "tiers", "fields", "signer", "incremental"} <= set(parameters)
    assert "digest" in {f.name for f in dataclasses.fields(sk.WriteOptions)}
    assert not {"step", "metrics", "run", "started", "budget"} & set(parameters)
    for name in ("step", "metrics", "run", "started", "budget"):
        with pytest.raises(sk.UnknownOptionError, match=name):
            sk.CheckpointManager(tmp_path / "root", **{name: None})
    with pytest.raises(sk.ConfigError, match="metrics"):
        sk.CheckpointManager(tmp_path / "root", fields=sk.ManifestFields(metrics={"val_loss": 1.0}))
    with pytest.raises(sk.ConfigError, match="picks the base"):
        sk.CheckpointManager(tmp_path / "root", incremental=sk.Incremental(base=tmp_path / "elsewhere"))


def test_manager_refuses_an_unknown_option_by_name(tmp_path: Path) -> None:
    with pytest.raises(sk.ConfigError, match=r"\['digets'\]"):
        sk.CheckpointManager(tmp_path / "root", digets="sha256")
    with pytest.raises(sk.ConfigError, match="step"):
        sk.CheckpointManager(tmp_path / "root", step=3)


def test_manager_validates_save_options_at_construction(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="compression='lz4'"):
        sk.CheckpointManager(tmp_path / "root", options=sk.WriteOptions(compression="lz4"))
    with pytest.raises(sk.UnsupportedValueError, match="compression='lz4'"), pytest.warns(DeprecationWarning):
        sk.CheckpointManager(tmp_path / "root", compression="lz4")


def test_manager_forwards_every_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field of the groups given to the manager arrives, unchanged, in the settings of
    each save; checked generically over the fields of the groups."""
    options = NON_DEFAULT_WRITE
    fields = sk.ManifestFields(
        model_id="tiny", epoch=4, training={"learning_rate": 0.5}, sharding_strategy="none", custom_fields={"team": "a"}
    )
    given = {
        **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
        **{f.name: getattr(fields, f.name) for f in dataclasses.fields(fields) if f.name != "metrics"},
    }
    # Incremental needs no compression, and a tier plan tiers: their forwarding is shown in
    # test_trust_versions.test_async_saves_never_use_the_proof and test_manager_tiers.
    assert set(given) | {"metrics"} == {
        name for name, (group, _) in GROUPED.items() if group in (sk.WriteOptions, sk.ManifestFields)
    }
    seen: list[SaveSettings] = []
    real = saving.run_save

    def spy(state: Any, path: Any, settings: SaveSettings) -> Any:
        seen.append(settings)
        return real(state, path, settings)

    monkeypatch.setattr("shardkeep.manager.run_save", spy)
    manager = sk.CheckpointManager(tmp_path / "root", keep_last=2, keep_best=0, options=options, fields=fields)
    entry = manager.save(make_state(), step=10, metrics={"val_loss": 1.0})
    assert len(seen) == 1
    for name, value in given.items():
        assert getattr(seen[0], name) == value, name
    assert seen[0].step == 10 and seen[0].run is not None and seen[0].metrics == {"val_loss": 1.0}
    manifest = sk.read_manifest(entry.path)
    assert manifest.digest_algorithm == "sha256"
    assert manifest.model_id == "tiny" and manifest.epoch == 4
    assert manifest.custom_fields == {"team": "a"}
    assert manifest.training.learning_rate == 0.5
    assert all(record.path.endswith(".zst") for record in manifest.files)


# --------------------------------------------------------------------------------------------
# The keyword spellings of the previous release
# --------------------------------------------------------------------------------------------

OLD = {"digest": "sha256", "io_threads": 3, "model_id": "m", "epoch": 3, "custom_fields": {"team": "a"}}
NEW = {
    "options": sk.WriteOptions(digest="sha256", io_threads=3),
    "fields": sk.ManifestFields(model_id="m", epoch=3, custom_fields={"team": "a"}),
}


def _same_checkpoint(old: sk.Manifest, new: sk.Manifest) -> None:
    assert (old.digest_algorithm, old.model_id, old.epoch, old.custom_fields) == (
        new.digest_algorithm,
        new.model_id,
        new.epoch,
        new.custom_fields,
    )
    assert [(r.path, r.size, r.digest) for r in old.files] == [(r.path, r.size, r.digest) for r in new.files]


def test_old_keywords_still_work_with_one_warning_and_give_the_same_checkpoint(tmp_path: Path) -> None:
    state = make_state()
    with pytest.warns(DeprecationWarning) as caught:
        old = sk.save(state, tmp_path / "old", **OLD)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "digest= is now options=WriteOptions(digest=...)" in message
    assert "model_id= is now fields=ManifestFields(model_id=...)" in message
    assert caught[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = sk.save(state, tmp_path / "new", **NEW)
    _same_checkpoint(old, new)
    with pytest.warns(DeprecationWarning, match="placement= is now tiers=TierPlan"):
        tiered = sk.save(
            state,
            tmp_path / "tiered",
            tiers=[sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold")],
            placement=[("model.*", "cold"), ("*", "hot")],
        )
    assert {record.tier for record in tiered.files} == {"hot", "cold"}


def test_old_keywords_of_async_save_and_the_manager(tmp_path: Path) -> None:
    state = make_state()
    with pytest.warns(DeprecationWarning) as caught:
        old = sk.async_save(state, tmp_path / "old", **OLD).result(timeout=60)
    assert len(caught) == 1 and "async_save()" in str(caught[0].message)
    _same_checkpoint(old, sk.async_save(state, tmp_path / "new", **NEW).result(timeout=60))
    with pytest.warns(DeprecationWarning) as caught:
        manager = sk.CheckpointManager(tmp_path / "root", keep_last=2, keep_best=0, **OLD)
    assert len(caught) == 1 and "CheckpointManager()" in str(caught[0].message)
    entry = manager.save(state, step=1, metrics={"val_loss": 1.0})
    manifest = sk.read_manifest(entry.path)
    assert (manifest.digest_algorithm, manifest.model_id, manifest.epoch) == ("sha256", "m", 3)


def test_an_unknown_keyword_is_a_typed_error(tmp_path: Path) -> None:
    for call in (sk.save, sk.async_save):
        with pytest.raises(sk.UnknownOptionError, match=r"\['digets'\]") as raised:
            call({"w": torch.zeros(2)}, tmp_path / "c", digets="sha256")
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, sk.ShardkeepError)
        assert isinstance(raised.value, sk.ConfigError)
    assert not (tmp_path / "c").exists()


def test_each_group_names_its_bad_field() -> None:
    cases: list[tuple[Any, str]] = [
        (lambda: sk.WriteOptions(progress="yes"), "progress='yes'"),
        (lambda: sk.WriteOptions(storage_options=["anon"]), "storage_options"),
        (lambda: sk.TierPlan(tiers="hot"), "tiers='hot'"),
        (lambda: sk.TierPlan(tiers=[sk.Tier(tier_id=1, name="hot")], placement=[("*",)]), "placement rule"),
        (lambda: sk.TierPlan(placement=[("*", "hot")]), "placement= needs tiers="),
        (lambda: sk.Incremental(base=3), "incremental=3"),
        (lambda: sk.Incremental(trust_versions="yes"), "trust_versions='yes'"),
        (lambda: sk.ManifestFields(epoch="1"), "epoch='1'"),
        (lambda: sk.ManifestFields(model_id=5), "model_id=5"),
        (lambda: sk.ManifestFields(custom_fields=[1]), "custom_fields"),
    ]
    for build, name in cases:
        with pytest.raises(sk.ConfigError, match=name):
            build()
    with pytest.raises(sk.ConfigError, match=r"options= must be a shardkeep\.WriteOptions"):
        sk.save({"w": torch.zeros(2)}, "unused", options={"digest": "sha256"})  # type: ignore[arg-type]


def _one_deprecation(caught: Any, call: str, *spellings: str) -> None:
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith(f"{call}(): "), message
    for spelling in spellings:
        assert spelling in message, message


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_the_dcp_writer_takes_the_groups_and_its_old_keywords(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from shardkeep.dcp import ShardkeepWriter

    state = {"w": torch.arange(6.0), "b": torch.ones(3)}
    with pytest.warns(DeprecationWarning) as caught:
        old_writer = ShardkeepWriter(tmp_path / "old", digest="sha256", model_id="m", epoch=2)
    _one_deprecation(caught, "ShardkeepWriter", "digest= is now options=WriteOptions(digest=...)")
    dcp.save(state, storage_writer=old_writer)
    new_writer = ShardkeepWriter(
        tmp_path / "new", options=sk.WriteOptions(digest="sha256"), fields=sk.ManifestFields(model_id="m", epoch=2)
    )
    dcp.save(state, storage_writer=new_writer)
    old, new = sk.read_manifest(tmp_path / "old"), sk.read_manifest(tmp_path / "new")
    _same_checkpoint(old, new)
    with pytest.raises(sk.UnknownOptionError, match="compression"):
        ShardkeepWriter(tmp_path / "x", compression="zstd")
    with pytest.raises(sk.ConfigError, match="compression"):
        ShardkeepWriter(tmp_path / "x", options=sk.WriteOptions(compression="zstd"))


def test_the_lightning_plugin_takes_the_groups_and_its_old_keywords(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from shardkeep.lightning import ShardkeepCheckpointIO

    checkpoint = {"state_dict": {"w": torch.arange(64.0)}, "epoch": 1, "global_step": 8}
    with pytest.warns(DeprecationWarning) as caught:
        old_io = ShardkeepCheckpointIO(digest="sha256", compression="zstd", save_options={"io_threads": 1})
    _one_deprecation(caught, "ShardkeepCheckpointIO", "save_options= is now", "compression= is now options=")
    old_io.save_checkpoint(checkpoint, tmp_path / "old.ckpt")
    new_io = ShardkeepCheckpointIO(options=sk.WriteOptions(digest="sha256", compression="zstd", io_threads=1))
    new_io.save_checkpoint(checkpoint, tmp_path / "new.ckpt")
    old, new = sk.read_manifest(tmp_path / "old.ckpt"), sk.read_manifest(tmp_path / "new.ckpt")
    assert old.digest_algorithm == new.digest_algorithm == "sha256"
    assert [(r.path, r.size, r.digest) for r in old.files] == [(r.path, r.size, r.digest) for r in new.files]
    assert all(record.path.endswith(".zst") for record in new.files)
    assert torch.equal(new_io.load_checkpoint(tmp_path / "old.ckpt")["state_dict"]["w"], torch.arange(64.0))


def test_accelerate_save_state_takes_the_groups_and_its_old_keywords(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")
    from shardkeep.accelerate import save_state

    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    assert model is not None
    with pytest.warns(DeprecationWarning) as caught:
        old = save_state(accelerator, tmp_path / "old", digest="sha256", model_id="m")
    _one_deprecation(caught, "save_state", "model_id= is now fields=ManifestFields(model_id=...)")
    new = save_state(
        accelerator, tmp_path / "new", options=sk.WriteOptions(digest="sha256"), fields=sk.ManifestFields(model_id="m")
    )
    assert (old.digest_algorithm, old.model_id) == (new.digest_algorithm, new.model_id) == ("sha256", "m")
    with pytest.raises(sk.UnknownOptionError, match="digets"):
        save_state(accelerator, tmp_path / "bad", digets="sha256")


def test_save_batch_takes_the_groups_and_its_old_keywords(tmp_path: Path) -> None:
    ledger = sk.ProgressLedger(tmp_path / "job" / "progress.json", 2)
    ledger.initialize()
    state = {"w": torch.arange(4.0)}
    with pytest.warns(DeprecationWarning) as caught:
        old = sk.save_batch(
            ledger, state, shard=0, batch_idx=0, num_sequences=4, process_group=sk.LOCAL, digest="sha256"
        )
    _one_deprecation(caught, "save", "digest= is now options=WriteOptions(digest=...)")
    new = sk.save_batch(
        ledger,
        state,
        shard=0,
        batch_idx=1,
        num_sequences=4,
        process_group=sk.LOCAL,
        options=sk.WriteOptions(digest="sha256"),
    )
    assert old.digest_algorithm == new.digest_algorithm == "sha256"
    assert [(r.size, r.digest) for r in old.files] == [(r.size, r.digest) for r in new.files]


def test_old_load_keywords_fold_into_the_selection(tmp_path: Path) -> None:
    tiers = sk.TierPlan(
        tiers=[sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold")], placement=[("w", "cold"), ("*", "hot")]
    )
    sk.save({"w": torch.arange(4.0), "b": torch.ones(2)}, tmp_path / "c", tiers=tiers)
    with pytest.warns(DeprecationWarning) as caught:
        old = sk.load(tmp_path / "c", tiers={"hot"}, lazy=True)
    _one_deprecation(caught, "load", "tiers= is now select=LoadSelection(tiers=...)", "lazy= is now")
    new = sk.load(tmp_path / "c", select=sk.LoadSelection(tiers={"hot"}, lazy=True))
    assert set(old) == set(new) == {"w", "b"}
    assert isinstance(old["w"], sk.LazyTensor) and isinstance(new["w"], sk.LazyTensor)
    assert torch.equal(old["b"], new["b"])
    with pytest.raises(sk.UnknownOptionError, match="tier_location"):
        sk.load(tmp_path / "c", tier_location={})
    with pytest.raises(sk.ConfigError, match="extra='sometimes'"):
        sk.LoadSelection(extra="sometimes")  # type: ignore[arg-type]
