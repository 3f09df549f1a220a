"""Tensor families (format 2.1) on the reading side: a 2.x root whose described tensors are
families loads exactly as the same checkpoint described tensor by tensor (whole, by section,
with ``extra="ignore"``, resharded 2 -> 3 on real gloo ranks), verifies, and inspect shows each
family once with its instance count."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import shardkeep as sk
from shardkeep.integrity import digest_bytes, seal_manifest
from shardkeep.manifest import INDEX_FORMAT, INDEXED_VERSION, IndexedManifest, RankIndex, ShardedTensor
from shardkeep.manifest.families import detect_tensor_families
from shardkeep.names import index_path
from shardkeep.storage import ForwardingStore, LocalStore, ReadHandle
from tests.support.distributed_harness import results_or_raise, run_ranks

LAYERS, EXPERTS, PARAMS = 3, 4, 5


def _full(layers: int = LAYERS, experts: int = EXPERTS) -> dict[str, torch.Tensor]:
    """Every tensor of the state by key: experts (row- and column-split), an embedding, a
    replicated norm, optimizer moments under integer ids, and plain (whole) tensors."""
    out: dict[str, torch.Tensor] = {}
    seed = 0
    for layer in range(layers):
        for expert in range(experts):
            seed += 1
            out[f"model.layers.{layer}.experts.{expert}.w1"] = (
                torch.arange(24, dtype=torch.float32).reshape(6, 4) + seed
            )
            out[f"model.layers.{layer}.experts.{expert}.w2"] = (
                torch.arange(28, dtype=torch.float64).reshape(4, 7) - seed
            )
        out[f"model.layers.{layer}.norm"] = torch.full((5,), float(layer))
    out["model.embed"] = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    out["model.bias"] = torch.full((3,), 7.0)
    for param in range(PARAMS):
        out[f"optim.state.{param}.exp_avg"] = torch.arange(10, dtype=torch.float32).reshape(5, 2) * (param + 1)
        out[f"optim.state.{param}.step"] = torch.tensor(float(param))
    return out


def _placement(key: str) -> str | None:
    if key.endswith((".w1", "embed", "exp_avg")):
        return "S0"
    if key.endswith(".w2"):
        return "S1"
    if key.endswith(".norm"):
        return "R"
    return None  # a plain tensor every rank holds


def _state(
    world_size: int, fill: bool = True, keep: Any = None, size: tuple[int, int] = (LAYERS, EXPERTS)
) -> dict[str, Any]:
    """The nested state on a 1-D mesh of ``world_size`` ranks (``keep(key)``: which tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state: dict[str, Any] = {}
    for key, value in _full(*size).items():
        if keep is not None and not keep(key):
            continue
        value = value if fill else torch.zeros_like(value)
        placement = _placement(key)
        if placement is not None:
            value = distribute_tensor(value, mesh, [Shard(int(placement[1])) if placement != "R" else Replicate()])
        parts: list[str | int] = list(key.split("."))
        if parts[:2] == ["optim", "state"]:
            parts[2] = int(parts[2])  # an optimizer's integer parameter ids
        node = state
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    state["note"] = "families"
    return state


def _save(rank: int, world_size: int, path: str) -> str:
    """A format 2.0 save (``block_size=0``: no families), which :func:`with_families` turns into
    2.1 by hand."""
    return sk.save(_state(world_size), path, step=5, options=sk.WriteOptions(block_size=0)).metadata_version


def with_families(source: Path, dest: Path) -> IndexedManifest:
    """A copy of the format 2.0 checkpoint ``source`` at ``dest`` whose described tensors are
    tensor families where they can be (root and indexes stamped 2.1, re-digested and re-sealed:
    what a 2.1 writer produces, built by hand)."""
    shutil.copytree(source, dest)
    raw = json.loads((dest / "manifest.json").read_bytes())
    raw.pop("manifest_digest")
    sharded = msgspec.convert(raw["sharded"], list[ShardedTensor])
    families, singles = detect_tensor_families(sharded)
    assert families, "nothing to make a family of"
    raw["sharded"] = msgspec.to_builtins(singles)
    raw["families"] = msgspec.to_builtins(families)
    raw["metadata_version"] = INDEXED_VERSION
    table = raw["indexes"]
    for position, rank in enumerate(table["ranks"]):
        where = dest / table.get("prefix", "") / index_path(rank)
        index = msgspec.json.decode(where.read_bytes(), type=RankIndex)
        assert index.format == INDEX_FORMAT
        index.metadata_version = INDEXED_VERSION
        data = msgspec.json.encode(index) + b"\n"
        where.write_bytes(data)
        table["sizes"][position] = len(data)
        table["digests"][position] = digest_bytes(table["algorithm"], data).partition(":")[2]
    (dest / "manifest.json").write_bytes(seal_manifest(msgspec.json.encode(raw), raw["digest_algorithm"]))
    manifest = sk.read_manifest(dest)
    assert isinstance(manifest, IndexedManifest)
    return manifest


class _IndexReads(ForwardingStore):
    """Records which index files a load opens."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.opened: list[str] = []

    def open_read(self, path: str) -> ReadHandle:
        if "/index/" in path:
            self.opened.append(path.rpartition("/")[2])
        return self.inner.open_read(path)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= _flat(value, f"{prefix}{key}.")
        return out
    if isinstance(tree, DTensor):
        return {prefix[:-1]: ("dtensor", tree.to_local().clone(), tree.full_tensor())}
    return {prefix[:-1]: tree}


def _loads(rank: int, world_size: int, plain: str, families: str) -> list[Any]:
    """The same loads of both checkpoints on this rank: into DTensors (resharded), by section,
    and with ``extra="ignore"`` into a target holding only this rank's experts."""
    results = []
    for path in (plain, families):
        store = _IndexReads(LocalStore(str(Path(path).parent)))
        target = _state(world_size, fill=False)
        sk.load(Path(path).name, into=target, storage=store)
        whole = _flat(target)
        model_only = _flat(sk.load(path, select=sk.LoadSelection(sections={"model"})))
        mine = _state(world_size, fill=False, keep=lambda key: f".experts.{rank}." in key)
        ignore_store = _IndexReads(LocalStore(str(Path(path).parent)))
        sk.load(Path(path).name, into=mine, storage=ignore_store, select=sk.LoadSelection(extra="ignore"))
        results.append((whole, sorted(store.opened), model_only, _flat(mine), sorted(ignore_store.opened)))
    return results


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_a_root_with_families_loads_as_the_same_checkpoint_without(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    assert results_or_raise(run_ranks(2, _save, str(plain), outbox=tmp_path / "save")) == ["2.0", "2.0"]
    manifest = with_families(plain, tmp_path / "families")
    raw = json.loads((tmp_path / "families" / "manifest.json").read_bytes())
    # 12 experts x 2 weights, 3 norms and 5 moments become 4 families; the embedding is single.
    assert sorted(f["key"] for f in raw["families"]) == [
        "model.layers.{0}.experts.{1}.w1",
        "model.layers.{0}.experts.{1}.w2",
        "model.layers.{0}.norm",
        "optim.state.{0}.exp_avg",
    ]
    assert [t["key"] for t in raw["sharded"]] == ["model.embed"]
    original = sk.read_manifest(plain)
    assert isinstance(original, IndexedManifest)
    key = lambda t: t.key  # noqa: E731
    assert sorted(manifest.described(), key=key) == sorted(original.sharded, key=key)
    assert manifest.find("optim.state.3.exp_avg") == next(
        t for t in original.sharded if t.key == "optim.state.3.exp_avg"
    )
    assert manifest.find("optim.state.5.exp_avg") is None and manifest.find("model.embed") is not None
    assert sk.validate_manifest(manifest).errors == []
    report = sk.verify(tmp_path / "families")
    assert report.ok, report.problems
    # One process, no group: whole tensors, every key and value alike.
    assert _same(_flat(sk.load(tmp_path / "families")), _flat(sk.load(plain)))
    for sections in ({"model"}, {"optim"}):
        select = sk.LoadSelection(sections=sections)
        assert _same(_flat(sk.load(tmp_path / "families", select=select)), _flat(sk.load(plain, select=select)))
    # Three ranks: resharded into DTensors, by section, and extra="ignore", with the same index reads.
    for rank, (without, with_) in enumerate(
        results_or_raise(run_ranks(3, _loads, str(plain), str(tmp_path / "families"), outbox=tmp_path / "load3"))
    ):
        assert _same(with_, without), rank
        assert with_[0]["model.layers.2.experts.3.w2"][2].equal(_full()["model.layers.2.experts.3.w2"])


def test_inspect_shows_each_family_once_with_its_count(tmp_path: Path) -> None:
    from shardkeep.cli import main

    plain = tmp_path / "plain"
    results_or_raise(run_ranks(2, _save, str(plain), outbox=tmp_path / "save"))
    with_families(plain, tmp_path / "families")
    out = io.StringIO()
    assert main(["inspect", str(tmp_path / "families")], out=out) == 0
    text = out.getvalue()
    assert "family     model.layers.{0}.experts.{1}.w1  12 instance(s)" in text
    assert "family     optim.state.{0}.exp_avg  5 instance(s)" in text
    assert f"{2 * LAYERS * EXPERTS + LAYERS + PARAMS + 1} sharded tensor(s) described once" in text
    out = io.StringIO()
    assert main(["inspect", "--json", str(tmp_path / "families")], out=out) == 0
    document = json.loads(out.getvalue())
    assert document["summary"]["sharded_tensors"] == 2 * LAYERS * EXPERTS + LAYERS + PARAMS + 1
    assert {f["key"]: f["instances"] for f in document["summary"]["tensor_families"]}["model.layers.{0}.norm"] == 3


def _save_moe(rank: int, world_size: int, path: str, families: bool) -> list[str]:
    """A 4-layer x 8-expert save as a 2.1 writer makes it, with families on or off."""
    import shardkeep.indexes
    import shardkeep.saving.manifest_build as build

    # The writers of this version still stamp 2.0 (no family); a 2.1 save, root and indexes:
    shardkeep.indexes.WRITTEN_INDEXED_VERSION = build.WRITTEN_INDEXED_VERSION = INDEXED_VERSION  # type: ignore[misc]
    build.WRITE_FAMILIES = families
    manifest = sk.save(_state(world_size, size=(4, 8)), path, step=9)
    assert isinstance(manifest, IndexedManifest)
    return sorted(tensor.key for tensor in manifest.described())


def test_a_save_describes_families_and_loads_as_a_save_without(tmp_path: Path) -> None:
    on, off = tmp_path / "on", tmp_path / "off"
    keys_on = results_or_raise(run_ranks(2, _save_moe, str(on), True, outbox=tmp_path / "s_on"))[0]
    keys_off = results_or_raise(run_ranks(2, _save_moe, str(off), False, outbox=tmp_path / "s_off"))[0]
    assert keys_on == keys_off and len(keys_on) == 2 * 4 * 8 + 4 + PARAMS + 1
    raw_on = json.loads((on / "manifest.json").read_bytes())
    raw_off = json.loads((off / "manifest.json").read_bytes())
    assert raw_on["metadata_version"] == raw_off["metadata_version"] == INDEXED_VERSION
    assert "families" not in raw_off and len(raw_off["sharded"]) == len(keys_off)
    assert [f["key"] for f in raw_on["families"]] == [
        "model.layers.{0}.experts.{1}.w1",
        "model.layers.{0}.experts.{1}.w2",
        "model.layers.{0}.norm",
        "optim.state.{0}.exp_avg",
    ]
    assert [t["key"] for t in raw_on["sharded"]] == ["model.embed"]
    # The optimizer's step scalars, whole tensors of root files: entry families where a file
    # holds a run of them, the same entries once decoded.
    entry_families = [f["key"] for record in raw_on["files"] for f in record.get("families", [])]
    assert entry_families and set(entry_families) == {"optim.state.{0}.step"}, raw_on["files"]
    assert all("families" not in record for record in raw_off["files"])
    assert (on / "manifest.json").stat().st_size < (off / "manifest.json").stat().st_size / 3
    # The indexes are the same but for the files' digests (the data is the same bytes).
    for rank in (0, 1):
        index_on = msgspec.json.decode((on / index_path(rank)).read_bytes(), type=RankIndex)
        index_off = msgspec.json.decode((off / index_path(rank)).read_bytes(), type=RankIndex)
        assert [[e.key for e in f.tensors] for f in index_on.files] == [
            [e.key for e in f.tensors] for f in index_off.files
        ]
    manifest_on, manifest_off = sk.read_manifest(on), sk.read_manifest(off)
    assert isinstance(manifest_on, IndexedManifest) and isinstance(manifest_off, IndexedManifest)
    key = lambda t: t.key  # noqa: E731
    assert sorted(manifest_on.described(), key=key) == sorted(manifest_off.described(), key=key)
    assert [(r.path, r.tensors) for r in manifest_on.files if not r.path.endswith("_sharded.safetensors")] == [
        (r.path, r.tensors) for r in manifest_off.files if not r.path.endswith("_sharded.safetensors")
    ]
    assert sk.verify(on).ok
    assert _same(_flat(sk.load(on)), _flat(sk.load(off)))
    select = sk.LoadSelection(sections={"optim"})
    assert _same(_flat(sk.load(on, select=select)), _flat(sk.load(off, select=select)))
    # A reader that does not know families (their members ignored as unknown fields) never
    # loads a partial state: a file's header lists the family's tensors, the indexes chunks of
    # tensors it does not see described.
    old_reader = tmp_path / "old_reader"
    shutil.copytree(on, old_reader)
    raw = dict(raw_on)
    raw.pop("manifest_digest")
    raw["files"] = [{k: v for k, v in record.items() if k != "families"} for record in raw["files"]]
    (old_reader / "manifest.json").write_bytes(seal_manifest(msgspec.json.encode(raw), raw["digest_algorithm"]))
    with pytest.raises(sk.IntegrityError, match="header lists"):
        sk.load(old_reader, select=sk.LoadSelection(sections={"optim"}))
    raw.pop("families")
    (old_reader / "manifest.json").write_bytes(seal_manifest(msgspec.json.encode(raw), raw["digest_algorithm"]))
    with pytest.raises(sk.ManifestError, match="not a sharded tensor the manifest describes"):
        sk.load(old_reader)


def test_families_are_written_only_into_roots_of_the_version_that_has_them() -> None:
    from shardkeep.manifest import WRITTEN_INDEXED_VERSION
    from shardkeep.saving.manifest_build import families_of

    tensors = [
        ShardedTensor(key=f"l.{i}.w", path=["l", str(i), "w"], dtype="F32", global_shape=[4], mesh=0, placements=["S0"])
        for i in range(3)
    ]
    families, singles = families_of(tensors, INDEXED_VERSION)
    assert [f.key for f in families] == ["l.{0}.w"] and singles == []
    assert families_of(tensors, "2.0") == ([], tensors)  # WriteOptions(block_size=0) writes 2.0: no family
    if WRITTEN_INDEXED_VERSION != INDEXED_VERSION:
        assert families_of(tensors, WRITTEN_INDEXED_VERSION) == ([], tensors)
