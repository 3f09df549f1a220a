"""Storage tiers: placement rules and callables, expert keys, size budgets, files written to each
tier's location (a second directory, or S3), partial and lazy loads that read only what they
need (bytes counted through a storage wrapper), sections, remapped tier locations, stale files."""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.errors import ConfigError, IntegrityError
from shardkeep.lazy import LazyTensor
from shardkeep.storage import ByteStore, LocalStore
from shardkeep.tiers import PlacementInfo, TierBudgetError, parse_size


class CountingStore:
    """Counts the bytes read through a store (every read handle's ``map`` and ``read_into``)."""

    def __init__(self, inner: ByteStore) -> None:
        self.inner = inner
        self.read_bytes = 0
        self.opened: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, path: str) -> Any:
        handle = self.inner.open_read(path)
        counter = self
        with self._lock:
            self.opened.append(path)

        class Counted:
            size = handle.size

            def map(self) -> memoryview:
                with counter._lock:
                    counter.read_bytes += handle.size
                return handle.map()

            def read_into(self, offset: int, buffer: memoryview, /) -> None:
                with counter._lock:
                    counter.read_bytes += len(buffer.cast("B"))
                handle.read_into(offset, buffer)

            def close(self) -> None:
                handle.close()

        return Counted()


def moe_state(layers: int = 4, experts: int = 4, width: int = 32) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        model[f"layers.{layer}.attn.weight"] = torch.randn(width, width, generator=generator)
        model[f"layers.{layer}.router.weight"] = torch.randn(experts, width, generator=generator)
        for expert in range(experts):
            model[f"layers.{layer}.experts.{expert}.w1"] = torch.randn(width, 2 * width, generator=generator)
    return {"model": model, "optim": {"exp_avg": torch.randn(width, generator=generator)}, "step": 3}


TIERS = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold")]
RULES = [("*.experts.*", "cold"), ("*", "hot")]


def test_placement_rules_put_each_tier_in_its_location(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    state = moe_state()
    manifest = sk.save(state, tmp_path / "root" / "step_00000003", tiers=sk.TierPlan(tiers=tiers, placement=RULES))
    by_key = {entry.key: (record.tier, entry) for record in manifest.files for entry in record.tensors}
    assert by_key["model.layers.2.experts.3.w1"][0] == "cold"
    assert by_key["model.layers.2.experts.3.w1"][1].expert_key == [2, 2, 3]  # [tier, group (layer), expert]
    assert by_key["model.layers.2.experts.3.w1"][1].kind == "expert"
    assert by_key["model.layers.0.attn.weight"][0] == "hot"
    assert {tier.name: tier.location for tier in manifest.tiers} == {"hot": None, "cold": str(cold)}
    cold_files = sorted(p.relative_to(cold).as_posix() for p in cold.rglob("*") if p.is_file())
    expected = sorted(f"step_00000003/{r.path}" for r in manifest.files if r.tier == "cold")
    assert cold_files == expected and expected
    hot_dir = tmp_path / "root" / "step_00000003"
    assert not [p for p in hot_dir.rglob("*experts*")]
    assert sk.verify(tmp_path / "root" / "step_00000003").ok
    loaded = sk.load(tmp_path / "root" / "step_00000003")
    assert torch.equal(loaded["model"]["layers.1.experts.2.w1"], state["model"]["layers.1.experts.2.w1"])


def test_a_placement_callable_sees_kind_layer_and_section(tmp_path: Path) -> None:
    seen: list[PlacementInfo] = []

    def place(info: PlacementInfo) -> str:
        seen.append(info)
        if info.section == "optim":
            return "cold"
        return "warm" if info.kind == "expert" and info.layer is not None and info.layer >= 2 else "hot"

    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="warm"), sk.Tier(tier_id=3, name="cold")]
    manifest = sk.save(moe_state(), tmp_path / "step_00000001", tiers=sk.TierPlan(tiers=tiers, placement=place))
    tier_of = {entry.key: record.tier for record in manifest.files for entry in record.tensors}
    assert tier_of["model.layers.3.experts.0.w1"] == "warm"
    assert tier_of["model.layers.1.experts.0.w1"] == "hot"
    assert tier_of["optim.exp_avg"] == "cold"
    info = next(i for i in seen if i.key == "model.layers.3.experts.1.w1")
    assert (info.kind, info.layer, info.expert, info.section) == ("expert", 3, 1, "model")
    assert next(i for i in seen if i.key == "model.layers.0.router.weight").section == "router"


def test_bad_tier_definitions_and_rules_are_refused_by_name(tmp_path: Path) -> None:
    state = moe_state(layers=1, experts=1)
    with pytest.raises(ConfigError, match="unknown tier 'warm'"):
        sk.save(state, tmp_path / "a", tiers=sk.TierPlan(tiers=TIERS, placement=[("*", "warm")]))
    with pytest.raises(ConfigError, match=r"no placement rule matches tensor 'model\.layers\.0\.attn\.weight'"):
        sk.save(state, tmp_path / "b", tiers=sk.TierPlan(tiers=TIERS, placement=[("*.experts.*", "cold")]))
    with pytest.raises(ConfigError, match="defined twice"):
        sk.save(state, tmp_path / "c", tiers=[sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="hot")])
    with pytest.raises(ConfigError, match="placement_policy='lru'"):
        sk.save(state, tmp_path / "d", tiers=[sk.Tier(tier_id=1, name="hot", placement_policy="lru")])
    with pytest.raises(ConfigError, match="not a size"):
        sk.save(state, tmp_path / "e", tiers=[sk.Tier(tier_id=1, name="hot", size_budget="lots")])
    assert not list(tmp_path.iterdir())  # nothing written for any refused save
    assert parse_size("40GB") == 40 * 10**9 and parse_size("1.5MiB") == 1572864 and parse_size(7) == 7


def test_size_budgets_spill_or_refuse_as_the_policy_says(tmp_path: Path) -> None:
    state = {"a": torch.zeros(256), "b": torch.zeros(256), "c": torch.zeros(256)}  # 1 KiB each
    spill = [sk.Tier(tier_id=1, name="hot", size_budget="2KiB"), sk.Tier(tier_id=2, name="cold")]
    manifest = sk.save(state, tmp_path / "spill", tiers=spill)
    tier_of = {entry.key: record.tier for record in manifest.files for entry in record.tensors}
    assert tier_of == {"a": "hot", "b": "hot", "c": "cold"}
    strict = [
        sk.Tier(tier_id=1, name="hot", size_budget="2KiB", placement_policy="strict"),
        sk.Tier(tier_id=2, name="cold"),
    ]
    with pytest.raises(TierBudgetError, match=r"tensor 'c' \(1024 bytes\) does not fit in tier 'hot'.*'strict'"):
        sk.save(state, tmp_path / "strict", tiers=strict)
    full = [sk.Tier(tier_id=1, name="hot", size_budget="1KiB"), sk.Tier(tier_id=2, name="cold", size_budget="1KiB")]
    with pytest.raises(TierBudgetError, match="fits in no tier"):
        sk.save(state, tmp_path / "full", tiers=full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spill"]


def test_loading_only_the_hot_tier_reads_only_its_files(tmp_path: Path) -> None:
    root, cold_dir = tmp_path / "root", tmp_path / "cold"
    root.mkdir()
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold_dir))]
    state = moe_state(layers=4, experts=8, width=64)
    manifest = sk.save(
        state, "step_00000001", storage=LocalStore(root), tiers=sk.TierPlan(tiers=tiers, placement=RULES)
    )
    hot_bytes = sum(r.size for r in manifest.files if r.tier == "hot")
    cold_bytes = sum(r.size for r in manifest.files if r.tier == "cold")
    assert cold_bytes > 5 * hot_bytes

    main, cold = CountingStore(LocalStore(root)), CountingStore(LocalStore(cold_dir))
    loaded = sk.load(
        "step_00000001", storage=main, select=sk.LoadSelection(tiers={"hot"}), tier_locations={"cold": cold}
    )
    assert cold.read_bytes == 0 and cold.opened == []
    manifest_size = (root / "step_00000001" / "manifest.json").stat().st_size
    assert main.read_bytes == hot_bytes + manifest_size
    assert "layers.0.experts.0.w1" not in loaded["model"]  # absent: its tier was not loaded
    assert torch.equal(loaded["model"]["layers.2.attn.weight"], state["model"]["layers.2.attn.weight"])

    main, cold = CountingStore(LocalStore(root)), CountingStore(LocalStore(cold_dir))
    everything = sk.load("step_00000001", storage=main, tier_locations={"cold": cold})
    assert cold.read_bytes == cold_bytes
    assert torch.equal(everything["model"]["layers.3.experts.7.w1"], state["model"]["layers.3.experts.7.w1"])
    with pytest.raises(ConfigError, match="unknown tier"):
        sk.load("step_00000001", storage=main, select=sk.LoadSelection(tiers={"warm"}))


def test_lazy_tensors_fetch_and_verify_on_first_use(tmp_path: Path) -> None:
    cold_dir = tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold_dir))]
    state = moe_state(layers=2, experts=2)
    sk.save(state, tmp_path / "root" / "step_00000001", tiers=sk.TierPlan(tiers=tiers, placement=RULES))
    cold = CountingStore(LocalStore(cold_dir))
    loaded = sk.load(
        tmp_path / "root" / "step_00000001",
        select=sk.LoadSelection(tiers={"hot"}, lazy=True),
        tier_locations={"cold": cold},
    )
    lazy = loaded["model"]["layers.1.experts.0.w1"]
    assert isinstance(lazy, LazyTensor) and not lazy.loaded
    assert lazy.shape == torch.Size([32, 64]) and lazy.dtype == torch.float32 and lazy.tier == "cold"
    assert cold.read_bytes == 0
    expected = state["model"]["layers.1.experts.0.w1"]
    assert torch.equal(torch.add(lazy, 0), expected)  # any torch function materializes it
    assert torch.equal(lazy.sum(), expected.sum())
    assert lazy.loaded and cold.read_bytes > 0
    first = cold.read_bytes
    assert torch.equal(lazy.materialize(), expected) and cold.read_bytes == first  # read once

    # A damaged cold file fails on first use, naming the file; the hot tier loaded fine.
    damaged = next(cold_dir.rglob("*.safetensors"))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.chmod(0o644)
    damaged.write_bytes(bytes(data))
    again = sk.load(tmp_path / "root" / "step_00000001", select=sk.LoadSelection(tiers={"hot"}, lazy=True))
    lazies = [v for v in again["model"].values() if isinstance(v, LazyTensor)]
    with pytest.raises(IntegrityError, match="digest mismatch"):
        for value in lazies:
            value.materialize()


def test_router_and_optimizer_sections_load_on_their_own(tmp_path: Path) -> None:
    model = torch.nn.ModuleDict({"router": torch.nn.Linear(4, 2), "body": torch.nn.Linear(4, 4)})
    optimizer = torch.optim.AdamW(model.parameters())
    model["body"](torch.randn(2, 4)).sum().backward()
    model["router"](torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sk.save({"model": model, "optim": optimizer}, tmp_path / "root" / "step_00000001")
    manifest = sk.read_manifest(tmp_path / "root" / "step_00000001")
    assert manifest.router_state is not None and manifest.optim_state is not None
    store = CountingStore(LocalStore(tmp_path / "root"))
    router_only = sk.load("step_00000001", storage=store, select=sk.LoadSelection(sections={"router"}))
    assert set(router_only["model"]) == {"router.weight", "router.bias"}
    router_files = [r for r in manifest.files if any(".router." in e.key for e in r.tensors)]
    manifest_size = (tmp_path / "root" / "step_00000001" / "manifest.json").stat().st_size
    assert store.read_bytes == sum(r.size for r in router_files) + manifest_size
    optim_only = sk.load(tmp_path / "root" / "step_00000001", select=sk.LoadSelection(sections={"optim"}))
    assert not optim_only.get("model")  # no model tensor was read (the section is empty or absent)
    assert torch.equal(optim_only["optim"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    # A partial load into live objects fills what it read and leaves the rest alone.
    fresh = torch.nn.ModuleDict({"router": torch.nn.Linear(4, 2), "body": torch.nn.Linear(4, 4)})
    body_before = fresh["body"].weight.detach().clone()
    sk.load(tmp_path / "root" / "step_00000001", into={"model": fresh}, select=sk.LoadSelection(sections={"router"}))
    assert torch.equal(fresh["router"].weight, model["router"].weight)
    assert torch.equal(fresh["body"].weight, body_before)
    with pytest.raises(sk.UnsupportedValueError, match="unknown section"):
        sk.load(tmp_path / "root" / "step_00000001", select=sk.LoadSelection(sections={"experts"}))


def test_a_moved_tier_is_remapped_at_load(tmp_path: Path) -> None:
    old, new = tmp_path / "cold-old", tmp_path / "cold-new"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(old))]
    state = moe_state(layers=1, experts=2)
    sk.save(state, tmp_path / "root" / "step_00000001", tiers=sk.TierPlan(tiers=tiers, placement=RULES))
    old.rename(new)
    report = sk.verify(tmp_path / "root" / "step_00000001")
    assert not report.ok and any("cold-old" in problem for problem in report.problems)
    assert sk.verify(tmp_path / "root" / "step_00000001", tier_locations={"cold": str(new)}).ok
    loaded = sk.load(tmp_path / "root" / "step_00000001", tier_locations={"cold": str(new)})
    assert torch.equal(loaded["model"]["layers.0.experts.1.w1"], state["model"]["layers.0.experts.1.w1"])
    with pytest.raises(ConfigError, match="unknown tier"):
        sk.load(tmp_path / "root" / "step_00000001", tier_locations={"warm": str(new)})


def test_tiers_split_between_a_local_directory_and_s3(tmp_path: Path, s3_root: tuple[str, dict[str, Any]]) -> None:
    bucket_root, options = s3_root
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=bucket_root)]
    state = moe_state(layers=2, experts=4)
    manifest = sk.save(
        state,
        tmp_path / "root" / "step_00000001",
        options=sk.WriteOptions(storage_options=options),
        tiers=sk.TierPlan(tiers=tiers, placement=RULES),
    )
    assert {r.tier for r in manifest.files} == {"hot", "cold"}
    local_files = [p for p in (tmp_path / "root" / "step_00000001").rglob("*") if p.is_file()]
    assert not [p for p in local_files if "_E0" in p.name]  # expert files went to S3
    assert sk.verify(tmp_path / "root" / "step_00000001", storage_options=options).ok
    hot = sk.load(
        tmp_path / "root" / "step_00000001", select=sk.LoadSelection(tiers={"hot"})
    )  # no S3 access needed at all
    assert "layers.0.experts.0.w1" not in hot["model"]
    full = sk.load(tmp_path / "root" / "step_00000001", storage_options=options)
    assert torch.equal(full["model"]["layers.1.experts.3.w1"], state["model"]["layers.1.experts.3.w1"])


def test_a_stale_file_is_reported_and_read_again(tmp_path: Path) -> None:
    """A file whose header version is older than the manifest's is stale (SPEC-029 3.2)."""
    state = {"frozen": torch.ones(64), "moving": torch.zeros(64)}
    root = tmp_path / "root"
    sk.save(state, root / "step_00000001", incremental=True)
    state["moving"] += 1
    sk.save(state, root / "step_00000002", incremental=root / "step_00000001")
    second = sk.read_manifest(root / "step_00000002")
    moving = next(r for r in second.files if any(e.key == "moving" for e in r.tensors))
    assert moving.version == 2 and moving.ref is None
    # Put the older version's bytes where version 2 should be: same size, older header.
    first = sk.read_manifest(root / "step_00000001")
    old = next(r for r in first.files if any(e.key == "moving" for e in r.tensors))
    target = root / "step_00000002" / moving.path
    target.chmod(0o644)
    target.write_bytes((root / "step_00000001" / old.path).read_bytes())
    report = sk.verify(root / "step_00000002", io_threads=1)
    assert any("stale" in p and "version 1" in p and "version 2" in p for p in report.problems), report.problems
    with pytest.raises(IntegrityError, match="stale"):
        sk.load(root / "step_00000002")


def test_a_partial_load_into_lists_and_optimizers_keeps_what_it_did_not_read(tmp_path: Path) -> None:
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold")]
    state = {"bufs": [torch.ones(3), torch.full((3,), 2.0)], "n": 1}
    sk.save(state, tmp_path / "ckpt", tiers=sk.TierPlan(tiers=tiers, placement=[("bufs.1", "cold"), ("*", "hot")]))
    target = {"bufs": [torch.zeros(3), torch.zeros(3)], "n": 0}
    kept = target["bufs"][1]
    sk.load(tmp_path / "ckpt", into=target, select=sk.LoadSelection(tiers={"hot"}))
    assert torch.equal(target["bufs"][0], torch.ones(3))
    assert target["bufs"][1] is kept and torch.equal(kept, torch.zeros(3))  # not loaded: untouched
    assert target["n"] == 1

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sk.save(
        {"model": model, "optim": optimizer},
        tmp_path / "opt",
        tiers=sk.TierPlan(tiers=tiers, placement=[("*exp_avg_sq", "cold"), ("*", "hot")]),
    )
    with pytest.raises(sk.UnsupportedValueError, match="optimizer state"):
        sk.load(tmp_path / "opt", into={"model": model, "optim": optimizer}, select=sk.LoadSelection(tiers={"hot"}))


def test_bad_load_options_are_typed_errors(tmp_path: Path) -> None:
    sk.save({"w": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(ConfigError):
        sk.load(tmp_path / "c", select=sk.LoadSelection(tiers=1))  # type: ignore[arg-type]
    with pytest.raises(sk.UnsupportedValueError):
        sk.load(tmp_path / "c", select=sk.LoadSelection(sections=1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        sk.load(tmp_path / "c", tier_locations=["hot"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        sk.load(tmp_path / "c", tier_locations={"hot": 5})  # type: ignore[dict-item]
    with pytest.raises(sk.UnsupportedValueError, match="storage_options"):
        sk.load("s3://bucket/p/c", storage_options=[1])  # type: ignore[arg-type]


def test_a_manager_restores_from_a_moved_tier_with_tier_locations(tmp_path: Path) -> None:
    old, new = tmp_path / "cold-old", tmp_path / "cold-new"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(old))]
    state = moe_state(layers=1, experts=2)
    sk.CheckpointManager(tmp_path / "root", keep_best=0, tiers=sk.TierPlan(tiers=tiers, placement=RULES)).save(
        state, step=1
    )
    old.rename(new)
    with pytest.raises(sk.IntegrityError, match="cold"):
        sk.CheckpointManager(tmp_path / "root", keep_best=0, read_only=True).restore()
    moved = sk.CheckpointManager(tmp_path / "root", keep_best=0, read_only=True, tier_locations={"cold": str(new)})
    assert moved.latest(verify=True) is not None
    restored = moved.restore()
    assert torch.equal(restored.state["model"]["layers.0.experts.1.w1"], state["model"]["layers.0.experts.1.w1"])


class _DiesAtTheCommit(LocalStore):
    """A local root whose process is killed (os._exit, as by kill -9: nothing cleans up) at the
    commit rename, after every data file, in the root and in the tier location, is written."""

    def rename(self, src: str, dst: str) -> None:
        if ".tmp-" in src:
            os._exit(9)
        super().rename(src, dst)


def _crashing_save(root: str, cold: str, run_id: str) -> None:
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=cold)]
    storage = _DiesAtTheCommit(root)
    manager = sk.CheckpointManager(
        root, keep_best=0, storage=storage, tiers=sk.TierPlan(tiers=tiers, placement=RULES), run_id=run_id
    )
    manager.save(moe_state(layers=1, experts=2), step=2)


def test_a_crashed_save_leaves_nothing_in_a_tier_location_once_collected(tmp_path: Path) -> None:
    root, cold = tmp_path / "root", tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    manager = sk.CheckpointManager(
        root, keep_last=2, keep_best=0, tiers=sk.TierPlan(tiers=tiers, placement=RULES), staging_lease=0
    )
    manager.save(moe_state(layers=1, experts=2), step=1)
    child = multiprocessing.get_context("fork").Process(
        target=_crashing_save, args=(str(root), str(cold), manager.run_id)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 9
    (staging,) = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    attempt = f"attempt-{staging.partition('.tmp-')[2][:16]}"
    assert any((cold / "step_00000002" / attempt).rglob("*.safetensors"))  # what the crash left
    assert manager.prune() == []  # nothing to retire; the leftovers are collected on the way
    assert not (root / staging).exists() and not (cold / "step_00000002" / attempt).exists()
    assert sk.verify(root / "step_00000001").ok  # the committed checkpoint's tier files are untouched
    manager.save(moe_state(layers=1, experts=2), step=2)
    assert sk.verify(root / "step_00000002").ok


def test_a_crashed_first_save_to_a_new_tier_is_collected_and_a_live_one_is_not(tmp_path: Path) -> None:
    """No committed manifest names the cold tier yet: the manager's own tiers tell where to look.
    Files in the tier written within the lease keep the whole attempt (and its staging
    directory), as a save still writing there would."""
    root, cold = tmp_path / "root", tmp_path / "cold"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    root.mkdir()
    child = multiprocessing.get_context("fork").Process(target=_crashing_save, args=(str(root), str(cold), "run-1"))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    (staging,) = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    attempt = cold / "step_00000002" / f"attempt-{staging.partition('.tmp-')[2][:16]}"
    assert any(attempt.rglob("*.safetensors"))
    options: dict[str, Any] = {"keep_best": 0, "tiers": sk.TierPlan(tiers=tiers, placement=RULES), "run_id": "run-1"}
    sk.CheckpointManager(root, staging_lease=3600, **options).prune()
    assert (root / staging).exists() and attempt.exists()  # within the lease: kept
    old = time.time() - 7200
    for path in [root / staging, *(root / staging).rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    (attempt / "late").write_bytes(b"written just now")  # the tier's files are still changing
    sk.CheckpointManager(root, staging_lease=3600, **options).prune()
    assert (root / staging).exists() and attempt.exists()
    for path in [attempt, *attempt.rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    sk.CheckpointManager(root, staging_lease=3600, **options).prune()
    assert not (root / staging).exists() and not attempt.exists()


# -- retention never deletes a checkpoint whose tier it cannot see ------------------------------
def _two_saves_with_a_cold_tier(tmp_path: Path) -> tuple[Path, Path]:
    root, cold = tmp_path / "root", tmp_path / "cold-a"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    manager = sk.CheckpointManager(
        root, keep_last=1, keep_best=1, tiers=sk.TierPlan(tiers=tiers, placement=RULES), run_id="run-a"
    )
    manager.save(moe_state(layers=1, experts=2), step=1, metrics={"val_loss": 0.1})
    manager.save(moe_state(layers=1, experts=2), step=2, metrics={"val_loss": 0.9})
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002"]
    return root, cold


@pytest.mark.parametrize("continued", ["new-location", "remapped"])
def test_retention_keeps_the_best_checkpoint_when_its_tier_location_moved(tmp_path: Path, continued: str) -> None:
    root, cold = _two_saves_with_a_cold_tier(tmp_path)
    cold.rename(tmp_path / "cold-moved")
    other = tmp_path / "cold-b"
    if continued == "new-location":
        tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(other))]
        manager = sk.CheckpointManager(
            root, keep_last=1, keep_best=1, tiers=sk.TierPlan(tiers=tiers, placement=RULES), run_id="run-a"
        )
    else:
        other.mkdir()
        tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(other))]
        manager = sk.CheckpointManager(
            root,
            keep_last=1,
            keep_best=1,
            tiers=sk.TierPlan(tiers=tiers, placement=RULES),
            tier_locations={"cold": str(other)},
            run_id="run-a",
        )
    manager.save(moe_state(layers=1, experts=2), step=3, metrics={"val_loss": 0.5})
    for name in ("step_00000001", "step_00000002"):  # their tier unseen: kept, whatever the policy says
        assert (root / name / "manifest.json").is_file(), name
    entry = next(entry for entry in manager.list() if entry.name == "step_00000001")
    assert entry.missing_tiers == ("cold",) and not entry.is_best and not entry.is_last and not entry.is_newest


@pytest.mark.parametrize("what", ["moved", "unreadable"])
def test_prune_keeps_a_checkpoint_whose_tier_directory_is_unseen_and_ls_says_unreadable(
    tmp_path: Path, what: str
) -> None:
    from shardkeep.cli import main

    root, cold = _two_saves_with_a_cold_tier(tmp_path)
    (cold / "step_00000001").rename(tmp_path / "step_00000001-cold")
    if what == "unreadable":  # something else in its place: the check fails with an I/O error
        (cold / "step_00000001").write_text("not a directory")
    out = io.StringIO()
    assert (
        main(["prune", str(root), "--apply", "--keep-last", "1", "--keep-best", "0"], out=out, err=io.StringIO()) == 0
    )
    assert (root / "step_00000001" / "manifest.json").is_file(), out.getvalue()
    out = io.StringIO()
    assert main(["ls", str(root)], out=out, err=io.StringIO()) == 2
    line = next(line for line in out.getvalue().splitlines() if line.startswith("step_00000001"))
    assert "UNREADABLE" in line and "last" not in line and "best" not in line
    assert ("cannot be read" if what == "unreadable" else "is missing") in line


def test_a_tier_file_present_with_the_wrong_size_is_corrupt_for_retention(tmp_path: Path) -> None:
    root, cold = _two_saves_with_a_cold_tier(tmp_path)
    with open(next((cold / "step_00000001").rglob("*.safetensors")), "ab") as handle:
        handle.write(b"x")
    from shardkeep.cli import main

    out = io.StringIO()
    assert main(["ls", str(root)], out=out, err=io.StringIO()) == 1
    assert "CORRUPT" in out.getvalue()
    main(["prune", str(root), "--apply"], out=io.StringIO(), err=io.StringIO())
    assert not (root / "step_00000001").exists()  # older than the newest verified one, and corrupt


def test_a_tier_location_that_cannot_be_opened_is_unreadable_not_corrupt(tmp_path: Path) -> None:
    from shardkeep.cli import main

    root, _ = _two_saves_with_a_cold_tier(tmp_path)
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed: a gs:// location opens here")
    out = io.StringIO()
    code = main(["ls", str(root), "--tier-location", "cold=gs://bucket/cold"], out=out, err=io.StringIO())
    assert code == 2, out.getvalue()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step_")]
    assert len(lines) == 2 and all("UNREADABLE: tier 'cold' cannot be read" in line for line in lines), lines


def test_a_save_of_the_same_step_leaves_a_checkpoint_with_an_unseen_tier_in_place(tmp_path: Path) -> None:
    root, cold = tmp_path / "root", tmp_path / "cold-a"
    tiers = [sk.Tier(tier_id=1, name="hot"), sk.Tier(tier_id=2, name="cold", location=str(cold))]
    sk.CheckpointManager(root, keep_best=0, tiers=sk.TierPlan(tiers=tiers, placement=RULES), run_id="run-a").save(
        moe_state(layers=1, experts=2), step=1
    )
    cold.rename(tmp_path / "cold-moved")
    manager = sk.CheckpointManager(root, keep_best=0, tiers=sk.TierPlan(tiers=tiers, placement=RULES), run_id="run-a")
    with pytest.raises(sk.CheckpointExistsError, match="tier of it cannot be seen"):
        manager.save(moe_state(layers=1, experts=2), step=1)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(("last", "best"))) == ["step_00000001"]
