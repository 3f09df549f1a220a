"""shardkeep.dcp: torch.distributed.checkpoint's save, async_save and load write and read real
shardkeep checkpoints (FSDP2 on gloo ranks, one process without a process group, sk.save
checkpoints, damage, existing checkpoints, signatures, non-tensor values without pickle,
failed saves)."""

from __future__ import annotations

import dataclasses
import errno
import gc
import io
import json
import math
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import shardkeep as sk
from shardkeep.dcp import ShardkeepReader, ShardkeepWriter
from shardkeep.storage import direct_io
from tests.support.distributed_harness import results_or_raise, run_ranks

# DCP on one process (no process group) warns once per call; only that warning is expected.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)

EXTRA = {"epoch": 3, "tag": "run-a", "ratios": [0.5, 0.25], "best": float("-inf"), "window": (2, 3)}
#: The extra state a load starts from (the same keys, other values).
BLANK_EXTRA = {"epoch": 0, "tag": "", "ratios": [0.0, 0.0], "best": 0.0, "window": (0, 0)}


def _model(world_size: int | None, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP (5 output rows: uneven shards on 2 and 3 ranks), FSDP2 when ``world_size``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, 8, generator=generator)  # the same batch on every rank
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "extra": dict(extra)}


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) model and optimizer state, on rank 0 (empty elsewhere)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def _save_fsdp(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    model, optimizer = _model(world_size, seed=0)
    _train_one_step(model, optimizer)
    state = _state(model, optimizer, EXTRA)
    if mode == "async":
        # The background save runs DCP's collectives on a group of its own, so that training's
        # collectives on the default group go on meanwhile.
        group = torch.distributed.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=ShardkeepWriter(path), process_group=group)
        _train_one_step(model, optimizer)  # training goes on: the save holds its own copy
        future.result()
        model, optimizer = _model(world_size, seed=0)  # the reference is the state as saved
        _train_one_step(model, optimizer)
    elif mode == "sk":
        sk.save(state, path)
    else:
        dcp.save(state, storage_writer=ShardkeepWriter(path))
    return _full(model, optimizer)


def _load_fsdp(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optimizer = _model(world_size, seed=123)
    state = _state(model, optimizer, BLANK_EXTRA)
    dcp.load(state, storage_reader=ShardkeepReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {**_full(model, optimizer), "extra": state["extra"]}


def _load_one_process(path: str) -> dict[str, Any]:
    model, optimizer = _model(None, seed=123)
    state = _state(model, optimizer, BLANK_EXTRA)
    dcp.load(state, storage_reader=ShardkeepReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "extra": state["extra"]}


def _manifest(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / "manifest.json").read_bytes())
    return data


def test_fsdp2_save_on_two_ranks_loads_on_one_process_and_on_three_ranks(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    path = tmp_path / "step_1"
    reference = results_or_raise(run_ranks(2, _save_fsdp, str(path), "sync", outbox=tmp_path / "save"))[0]
    assert not list(tmp_path.glob("*.tmp-*")), "the staging directory was left behind"
    report = sk.verify(path)
    assert report.ok, report.problems
    manifest = _manifest(path)
    assert manifest["metadata_version"] == "1.4" and manifest["world_size"] == 2
    entries = {}
    for record in manifest["files"]:
        assert record["path"].startswith("shards/rank_0000") and record["digest"].startswith("blake3:")
        for entry in record["tensors"]:
            entries.setdefault(entry["key"], []).append(entry)
    # Each FSDP2 parameter and its AdamW moments: one chunk per rank, with its own block digests.
    for key in ("model.2.weight", "optim.state.2.weight.exp_avg", "optim.state.2.bias.exp_avg_sq"):
        chunks = sorted(entries[key], key=lambda entry: entry["global_offset"])
        assert [chunk["global_offset"][0] for chunk in chunks] == [0, 3], key
        assert all(chunk["global_shape"][0] == 5 and chunk["blocks"] for chunk in chunks), key
    # DCP's non-tensor items (param_groups, the extra values) are all JSON-able: they are the
    # manifest's JSON values, and no opaque (pickled) bytes are left; nested paths are kept too.
    recorded = manifest["custom_fields"]["dcp"]
    assert recorded.get("bytes", []) == []
    assert not any(entry["dtype"] == "U8" for found in entries.values() for entry in found)
    values = {value["key"]: value for value in manifest["values"]}
    assert values["extra.tag"]["value"] == "run-a" and values["extra.tag"]["path"] == ["extra", "tag"]
    assert values["extra.best"]["special"] == "-inf" and values["optim.param_groups.0.lr"]["value"] == 0.01
    assert values["optim.param_groups.0.betas.1"]["value"] == 0.999
    kinds = {tuple(container["path"]): container.get("kind", "dict") for container in manifest["structure"]}
    assert kinds[("optim", "param_groups", 0, "betas")] == "tuple"
    assert recorded["planner_data"]["model.2.weight"] == ["model", "2.weight"]
    # sk.load reads it: chunks assembled, DCP's non-tensor values as the values they were.
    loaded = sk.load(path)
    assert_same_tree(loaded["model"]["2.weight"], reference["model"]["2.weight"])
    assert_same_tree(loaded["extra"], EXTRA)
    assert loaded["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)

    # The default reader (no trust_pickle) loads it: nothing read from storage is unpickled.
    on_one = _load_one_process(str(path))
    assert_same_tree(on_one, {**reference, "extra": EXTRA})
    on_three = results_or_raise(run_ranks(3, _load_fsdp, str(path), outbox=tmp_path / "load3"))[0]
    assert_same_tree(on_three, {**reference, "extra": EXTRA})


def test_async_save_on_two_ranks_commits_a_verifiable_checkpoint(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    path = tmp_path / "step_2"
    reference = results_or_raise(run_ranks(2, _save_fsdp, str(path), "async", outbox=tmp_path / "save"))[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_2"]
    report = sk.verify(path)
    assert report.ok, report.problems
    assert _manifest(path)["world_size"] == 2
    assert_same_tree(sk.load(path)["model"], reference["model"])
    assert_same_tree(_load_one_process(str(path)), {**reference, "extra": EXTRA})


def test_the_reader_loads_a_sharded_sk_save_checkpoint(tmp_path: Path, assert_same_tree: Callable[..., None]) -> None:
    path = tmp_path / "by_sk_save"
    reference = results_or_raise(run_ranks(2, _save_fsdp, str(path), "sk", outbox=tmp_path / "save"))[0]
    assert_same_tree(_load_one_process(str(path)), {**reference, "extra": EXTRA})


def test_the_reader_loads_a_checkpoint_written_by_sk_save(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    saved = {
        "model": layer.state_dict(),
        "step": 5,
        "meta": {"name": "x", "betas": (0.9, 0.95), "loss": float("inf")},
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    sk.save(saved, tmp_path / "ckpt")
    target = {
        "model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)},
        "step": 0,
        "meta": {"name": "", "betas": (0.0, 0.0), "loss": 0.0},
        "ids": torch.zeros(2, 3, dtype=torch.int64),
    }
    dcp.load(target, storage_reader=ShardkeepReader(tmp_path / "ckpt"))
    assert_same_tree(target, saved)


def _flip_byte(path: Path, key: str) -> None:
    """Flip one byte of ``key``'s data in its file (the manifest is left as it is)."""
    for record in _manifest(path)["files"]:
        for entry in record["tensors"]:
            if entry["key"] == key:
                file = path / record["path"]
                data = bytearray(file.read_bytes())
                data[entry["offset"]] ^= 0xFF
                file.write_bytes(bytes(data))
                return
    raise AssertionError(f"{key} not found")


def _small_state(scale: float) -> dict[str, Any]:
    return {
        "model": {"weight": torch.full((4, 3), scale), "bias": torch.full((4,), scale)},
        "extra": {"epoch": int(scale)},
    }


def test_a_flipped_byte_fails_the_load_before_any_value_changes(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path))
    assert sk.verify(path).ok
    _flip_byte(path, "model.bias")
    assert not sk.verify(path).ok
    target = _small_state(0.0)
    with pytest.raises(CheckpointException) as raised:
        dcp.load(target, storage_reader=ShardkeepReader(path))
    # DCP wraps every storage error; the one inside is shardkeep's, naming the file.
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, sk.IntegrityError) and "shards/rank_00000.safetensors" in str(error)
    assert_same_tree(target, _small_state(0.0))  # nothing was loaded, not even the intact weight


def test_a_damaged_manifest_is_refused_when_the_reader_is_built(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path))
    manifest = path / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"world_size":1', b'"world_size":2'))
    with pytest.raises(sk.IntegrityError):
        ShardkeepReader(path)


def test_a_second_save_to_the_same_path_is_refused_and_leaves_the_first(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path))
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(sk.CheckpointExistsError, match="ckpt"):
        dcp.save(_small_state(3.0), storage_writer=ShardkeepWriter(path))
    # A writer built before the checkpoint appeared: the commit refuses it (DCP wraps the error).
    late = ShardkeepWriter(tmp_path / "other")
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(tmp_path / "other"))
    with pytest.raises(CheckpointException) as raised:
        dcp.save(_small_state(3.0), storage_writer=late)
    assert any(isinstance(error, sk.CheckpointExistsError) for error, _ in raised.value.failures.values())
    assert {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert not list(tmp_path.glob("*.tmp-*"))
    target = _small_state(0.0)
    dcp.load(target, storage_reader=ShardkeepReader(path))
    assert_same_tree(target, _small_state(2.0))


def test_a_signed_save_verifies_with_the_public_key(tmp_path: Path, assert_same_tree: Callable[..., None]) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    path = tmp_path / "signed"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path, signer=key))
    assert (path / "manifest.sig").is_file()
    assert sk.verify(path, public_key=key.public_key()).ok
    assert not sk.verify(path, public_key=Ed25519PrivateKey.generate().public_key()).ok
    target = _small_state(0.0)
    dcp.load(target, storage_reader=ShardkeepReader(path, public_key=key.public_key()))
    assert_same_tree(target, _small_state(2.0))
    with pytest.raises(sk.SignatureError):
        ShardkeepReader(path, public_key=Ed25519PrivateKey.generate().public_key())
    with pytest.raises(sk.UnsupportedValueError, match="cryptographic"):
        ShardkeepWriter(tmp_path / "weak", signer=key, options=sk.WriteOptions(digest="xxh3-128"))


# -- non-tensor values: JSON, never an unpickled byte from storage by default -----------------


@dataclasses.dataclass
class _Point:
    """A value that is not JSON-able (DCP's planner pickles it; weights_only refuses it)."""

    x: int
    y: int


class _RunsACommand:
    """Unpickling this runs a shell command (what a hostile checkpoint would hold)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def test_a_hostile_checkpoint_that_verifies_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned.txt"
    buffer = io.BytesIO()
    torch.save(_RunsACommand(f"touch {shlex.quote(str(marker))}"), buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    # A plain sk.save checkpoint, unsigned, that claims its uint8 tensor is one of DCP's items.
    hostile = tmp_path / "hostile"
    sk.save(
        {"w": torch.ones(2), "step": payload},
        hostile,
        fields=sk.ManifestFields(custom_fields={"dcp": {"bytes": ["step"]}}),
    )
    assert sk.verify(hostile).ok
    with pytest.raises(sk.UnsupportedValueError, match=r"'step'.*unpickle.*trust_pickle=True"):
        ShardkeepReader(hostile)
    # Through DCP's checkpoint_id (the reader's reset): refused too, before DCP starts, unwrapped.
    good = tmp_path / "good"
    sk.save({"w": torch.full((2,), 3.0), "step": 7}, good)
    state: dict[str, Any] = {"w": torch.zeros(2), "step": 0}
    with pytest.raises(sk.UnsupportedValueError, match="'step'"):
        dcp.load(state, checkpoint_id=hostile, storage_reader=ShardkeepReader(good))
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert state["step"] == 0 and torch.equal(state["w"], torch.zeros(2))
    # The reader of the good checkpoint still loads it.
    dcp.load(state, storage_reader=ShardkeepReader(good))
    assert state["step"] == 7 and torch.equal(state["w"], torch.full((2,), 3.0))


def test_values_that_are_not_json_stay_opaque_and_load_only_with_trust_pickle(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    path = tmp_path / "ckpt"
    saved = {
        "w": torch.arange(4.0),
        "extra": {"seen": {1, 2}, "point": _Point(1, 2), "epoch": 3, "loss": float("nan"), "shape": (2, [3, None])},
    }
    dcp.save(saved, storage_writer=ShardkeepWriter(path))
    assert sk.verify(path).ok
    manifest = _manifest(path)
    assert manifest["custom_fields"]["dcp"]["bytes"] == ["extra.point", "extra.seen"]
    assert {value["key"] for value in manifest["values"]} >= {"extra.epoch", "extra.loss", "extra.shape.1"}
    with pytest.raises(sk.UnsupportedValueError, match=r"'extra\.point', 'extra\.seen'.*trust_pickle"):
        ShardkeepReader(path)
    target: dict[str, Any] = {
        "w": torch.zeros(4),
        "extra": {"seen": set(), "point": None, "epoch": 0, "loss": 0.0, "shape": (0, [0, 0])},
    }
    dcp.load(target, storage_reader=ShardkeepReader(path, trust_pickle=True))
    loss = target["extra"].pop("loss")
    assert loss != loss  # nan
    assert_same_tree(target, {**saved, "extra": {k: v for k, v in saved["extra"].items() if k != "loss"}})
    # sk.load never unpickles: the opaque items are uint8 tensors, the JSON ones values.
    loaded = sk.load(path)
    assert loaded["extra"]["seen"].dtype == torch.uint8 and loaded["extra"]["shape"] == (2, [3, None])


# -- failed saves: nothing left where the cleanup promises ----------------------------------------


def _failing_commit(original: Any) -> Any:
    def commit(self: Any) -> None:
        original(self)  # the file is written, fsynced and closed: it is on disk
        raise OSError(errno.EIO, "injected: the disk failed after the file was written")

    return commit


def test_a_failed_write_on_one_process_leaves_no_staging_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    writer = ShardkeepWriter(path)
    monkeypatch.setattr(direct_io.LocalWriter, "commit", _failing_commit(direct_io.LocalWriter.commit))
    with pytest.raises(CheckpointException) as raised:
        dcp.save(_small_state(2.0), storage_writer=writer)
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, OSError) and "injected" in str(error)
    # Removed at once (the writer is still alive): one rank, so nobody else writes there.
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    dcp.save(_small_state(2.0), storage_writer=writer)  # the same writer saves again
    assert sk.verify(path).ok and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _save_failing_on(rank: int, world_size: int, path: str, failing_rank: int, cleanup: str) -> Any:
    if rank == failing_rank:  # this forked rank only
        direct_io.LocalWriter.commit = _failing_commit(direct_io.LocalWriter.commit)  # type: ignore[method-assign]
    model, optimizer = _model(world_size, seed=0)  # FSDP2: every rank writes chunks of its own
    writer = ShardkeepWriter(path)
    try:
        dcp.save(_state(model, optimizer, EXTRA), storage_writer=writer)
    except CheckpointException as exc:
        failed = sorted(exc.failures)
    else:
        raise AssertionError("the save did not fail")
    torch.distributed.barrier()  # every rank is past the failed save
    parent = Path(path).parent
    left = sorted(str(p.relative_to(parent)) for p in parent.glob("*.tmp-*/**/*") if p.is_file())
    torch.distributed.barrier()
    if cleanup == "reset":
        writer.reset()  # as DCP does at the next save with checkpoint_id=
    else:
        del writer  # dropped: the exception DCP raised is a reference cycle, hence collect()
        gc.collect()
    torch.distributed.barrier()
    return failed, left


@pytest.mark.parametrize(("failing_rank", "cleanup"), [(1, "drop"), (0, "reset")])
def test_a_failed_write_on_one_of_two_ranks_is_cleaned_up(tmp_path: Path, failing_rank: int, cleanup: str) -> None:
    path = tmp_path / "ckpts" / "step_1"
    outcomes = results_or_raise(
        run_ranks(2, _save_failing_on, str(path), failing_rank, cleanup, outbox=tmp_path / "out")
    )
    failed, left = outcomes[0]
    assert failed == [failing_rank]
    # The failing rank removed its own files at once; the other rank's stay until the coordinator
    # aborts the save (it alone knows, and only once every rank is done writing).
    other = 1 - failing_rank
    assert left and all(f"rank_{other:05d}" in name for name in left), left
    # Then the coordinator removed the staging directory, with what every rank wrote.
    assert list((tmp_path / "ckpts").iterdir()) == []


def test_a_signed_checkpoint_is_never_read_without_its_digests(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    """The signature covers the data only through the digests: with ``public_key``, a reader
    that skips them (``verify=False``) is refused, as ``sk.load`` refuses it."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    path = tmp_path / "signed"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path, signer=key))
    _flip_byte(path, "model.weight")  # forged data under an intact, validly signed manifest
    with pytest.raises(sk.ConfigError, match="verify=False") as from_load:
        sk.load(path, public_key=key.public_key(), verify=False)
    with pytest.raises(sk.ConfigError, match="verify=False") as from_reader:
        ShardkeepReader(path, public_key=key.public_key(), verify=False)
    assert type(from_reader.value) is type(from_load.value)
    with pytest.raises(sk.ConfigError, match="verify=False"):
        ShardkeepReader(path, require_signature=True, public_key=key.public_key(), verify=False)
    # With the digests checked, the forged byte is found before any value is loaded.
    target = _small_state(0.0)
    with pytest.raises(CheckpointException) as raised:
        dcp.load(target, storage_reader=ShardkeepReader(path, public_key=key.public_key()))
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, sk.IntegrityError)
    assert_same_tree(target, _small_state(0.0))
    # Unsigned reading without digests stays possible (the size and header are still checked).
    unsigned = tmp_path / "unsigned"
    dcp.save(_small_state(3.0), storage_writer=ShardkeepWriter(unsigned))
    dcp.load(target, storage_reader=ShardkeepReader(unsigned, verify=False))
    assert_same_tree(target, _small_state(3.0))


# -- ShardedTensors with several local shards on one rank ------------------------------------------

#: ShardedTensor is deprecated in favour of DTensor, and says so on every use.
_SHARDED_TENSOR_WARNING = "ignore:Please use DTensor instead:FutureWarning"


def _sharding_spec(world_size: int, plan: str) -> Any:
    """``chunks``: 4 chunks of rows over ``world_size`` ranks (two on each of two ranks);
    ``enumerable``: 4 blocks of 4x2 on a 8x4 tensor, placed crosswise; ``one``: a chunk a rank."""
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata

    if plan == "enumerable":
        blocks = [([0, 0], 0), ([0, 2], 1), ([4, 0], 1), ([4, 2], 0)]
        return EnumerableShardingSpec(
            [
                ShardMetadata(shard_offsets=offsets, shard_sizes=[4, 2], placement=f"rank:{owner % world_size}/cpu")
                for offsets, owner in blocks
            ]
        )
    count = world_size if plan == "one" else 4
    return ChunkShardingSpec(dim=0, placements=[f"rank:{index % world_size}/cpu" for index in range(count)])


def _numbered(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def _sharded_tensor(world_size: int, plan: str, fill: torch.Tensor) -> Any:
    """A ShardedTensor of ``fill``'s shape whose local shards hold ``fill``'s values there."""
    from torch.distributed._shard import sharded_tensor

    tensor = sharded_tensor.empty(_sharding_spec(world_size, plan), *fill.shape)
    for shard in tensor.local_shards():
        region = fill
        for dim, (start, size) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)):
            region = region.narrow(dim, start, size)
        shard.tensor.copy_(region)
    return tensor


def _gathered(tensor: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor of a ShardedTensor, from every rank's local shards (all_gather)."""
    pieces = [(list(s.metadata.shard_offsets), s.tensor.clone()) for s in tensor.local_shards()]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, pieces)
    full = torch.full(shape, float("nan"))
    for rank_pieces in everyone:
        for offsets, piece in rank_pieces:
            region = full
            for dim, start in enumerate(offsets):
                region = region.narrow(dim, start, piece.shape[dim])
            region.copy_(piece)
    return full


def _save_and_reload_sharded(rank: int, world_size: int, path: str, save_plan: str, load_plan: str) -> Any:
    shape = (8, 4)
    saved = {"st": _sharded_tensor(world_size, save_plan, _numbered(shape)), "plain": _numbered((3,))}
    dcp.save(saved, storage_writer=ShardkeepWriter(path))
    torch.distributed.barrier()
    target = {"st": _sharded_tensor(world_size, load_plan, torch.zeros(shape)), "plain": torch.zeros(3)}
    dcp.load(target, storage_reader=ShardkeepReader(path))
    return _gathered(target["st"], shape), target["plain"]


@pytest.mark.filterwarnings(_SHARDED_TENSOR_WARNING)
@pytest.mark.parametrize(("save_plan", "load_plan"), [("chunks", "enumerable"), ("enumerable", "one")])
def test_a_sharded_tensor_with_several_shards_on_a_rank_commits_a_loadable_checkpoint(
    tmp_path: Path, save_plan: str, load_plan: str
) -> None:
    path = tmp_path / "ckpt"
    outcomes = results_or_raise(
        run_ranks(2, _save_and_reload_sharded, str(path), save_plan, load_plan, outbox=tmp_path / "out")
    )
    report = sk.verify(path)
    assert report.ok, report.problems
    for full, plain in outcomes:  # loaded on two ranks with another shard plan
        assert torch.equal(full, _numbered((8, 4))) and torch.equal(plain, _numbered((3,)))
    loaded = sk.load(path)
    assert torch.equal(loaded["st"], _numbered((8, 4))) and torch.equal(loaded["plain"], _numbered((3,)))
    # Each rank held two chunks of "st": no file's safetensors header lists a key twice.
    chunks = [entry for record in _manifest(path)["files"] for entry in record["tensors"] if entry["key"] == "st"]
    assert len(chunks) == 4
    for record in _manifest(path)["files"]:
        keys = [entry["key"] for entry in record["tensors"]]
        assert len(keys) == len(set(keys)), record["path"]
    # On one process, into a plain tensor (a ShardedTensor saved, a tensor loaded).
    whole = {"st": torch.zeros(8, 4), "plain": torch.zeros(3)}
    dcp.load(whole, storage_reader=ShardkeepReader(path))
    assert torch.equal(whole["st"], _numbered((8, 4)))


def test_a_writer_whose_header_disagrees_with_the_manifest_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkeep import layout

    original = layout.build_header
    # Every tensor of a file named like the first: the header lists one, the manifest two.
    monkeypatch.setattr(
        layout, "build_header", lambda spans, version=None: original([(spans[0][0], *s[1:]) for s in spans], version)
    )
    with pytest.raises(CheckpointException) as raised:
        dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(tmp_path / "ckpt"))
    (error, _), *_ = raised.value.failures.values()
    assert isinstance(error, sk.IntegrityError) and "header lists 1 tensors, manifest lists 2" in str(error)
    assert list(tmp_path.iterdir()) == []


# -- a torch.save file of a shardkeep checkpoint: DCP's dcp_to_torch_save and the CLI -------------


def test_dcp_finds_a_shardkeep_checkpoint_only_through_the_reader_and_converts_it_to_torch_save(
    tmp_path: Path,
    assert_same_tree: Callable[..., None],
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as dcp_own_conversion

    from shardkeep.cli import main
    from shardkeep.dcp import dcp_to_torch_save

    saved = {**_small_state(2.0), "meta": {"name": "run", "betas": (0.9, 0.95)}}
    path, native = tmp_path / "ckpt", tmp_path / "native"
    dcp.save(saved, storage_writer=ShardkeepWriter(path))
    dcp.save(saved, checkpoint_id=native)  # DCP's own FileSystemWriter: the reference
    # DCP's defaults look for its own .metadata: a shardkeep checkpoint needs the reader passed.
    with pytest.raises(CheckpointException) as raised:
        dcp.load(_small_state(0.0), checkpoint_id=path)
    assert ".metadata" in str(list(raised.value.failures.values()))
    with pytest.raises(CheckpointException) as raised:
        dcp_own_conversion(path, tmp_path / "fails.pt")
    assert ".metadata" in str(list(raised.value.failures.values()))
    target = {**_small_state(0.0), "meta": {"name": "", "betas": (0.0, 0.0)}}
    dcp.load(target, checkpoint_id=path, storage_reader=ShardkeepReader(path))
    assert_same_tree(target, saved)

    dcp_own_conversion(native, tmp_path / "reference.pt")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    dcp_to_torch_save(path, tmp_path / "converted.pt")
    assert_same_tree(torch.load(tmp_path / "converted.pt", weights_only=True), reference)
    # The CLI: --format torch (another name for pt) writes the same state.
    assert main(["export", str(path), str(tmp_path / "exported.bin"), "--format", "torch"]) == 0
    assert_same_tree(torch.load(tmp_path / "exported.bin", weights_only=True), reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt",
        "converted.pt",
        "exported.bin",
        "native",
        "reference.pt",
    ]


def test_dcp_to_torch_save_writes_through_a_fresh_temporary_and_takes_long_names(
    tmp_path: Path, assert_same_tree: Callable[..., None]
) -> None:
    """A symlink planted where a predictable temporary name would be is never followed, and a
    destination name of 250 bytes (a legal name) is written."""
    from shardkeep.dcp import dcp_to_torch_save

    path = tmp_path / "ckpt"
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(path))
    victim = tmp_path / "victim"
    victim.write_bytes(b"not to be overwritten")
    target = tmp_path / "out.pt"
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")
    dcp_to_torch_save(path, target)
    assert victim.read_bytes() == b"not to be overwritten"
    assert not target.is_symlink()
    assert_same_tree(torch.load(target, weights_only=True), _small_state(2.0))
    long_target = tmp_path / ("n" * 247 + ".pt")
    dcp_to_torch_save(path, long_target)
    assert_same_tree(torch.load(long_target, weights_only=True), _small_state(2.0))
    with pytest.raises(sk.UnsafePathError, match="255"):
        dcp_to_torch_save(path, tmp_path / ("n" * 253 + ".pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", "victim", "out.pt", f"out.pt.tmp-{os.getpid()}", long_target.name]
    )


def test_dcp_plan_caching_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """A cached plan carries an earlier save's staging directory: refused on the first save
    already (and a plan DCP marks unusable, a cached one, is refused in global planning)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _FreshCache(DefaultSavePlanner):  # DCP caches plans per planner class name
        pass

    for attempt in range(2):
        with pytest.raises(CheckpointException) as raised:
            dcp.save(
                _small_state(2.0),
                storage_writer=ShardkeepWriter(tmp_path / "ckpt"),
                planner=_FreshCache(enable_plan_caching=True),
            )
        (error, _), *_ = raised.value.failures.values()
        assert isinstance(error, sk.UnsupportedValueError) and "enable_plan_caching" in str(error), attempt
        assert list(tmp_path.iterdir()) == [], attempt
    dcp.save(_small_state(2.0), storage_writer=ShardkeepWriter(tmp_path / "ckpt"))
    assert sk.verify(tmp_path / "ckpt").ok


def test_the_writer_records_what_sk_save_records_of_the_same_state(tmp_path: Path) -> None:
    """The DCP writer builds its manifest with sk.save's own builder: of the same plain state,
    both record the same optimizer section, sharding strategy, precision, tiers and fields."""
    state = {
        "model": {"w": torch.zeros(64, dtype=torch.bfloat16), "b": torch.zeros(2)},
        "optimizer": {"state": {"0": {"exp_avg": torch.zeros(64, dtype=torch.bfloat16)}}},
    }
    dcp.save(
        state, storage_writer=ShardkeepWriter(tmp_path / "dcp", step=3, fields=sk.ManifestFields(model_id="m", epoch=1))
    )
    written = sk.read_manifest(tmp_path / "dcp")
    saved = sk.save(state, tmp_path / "sk", step=3, fields=sk.ManifestFields(model_id="m", epoch=1))
    for manifest in (written, saved):
        assert manifest.optim_state is not None and manifest.optim_state.prefixes == ["optimizer"]
        assert (manifest.sharding.strategy, manifest.sharding.precision) == ("none", "bf16")
    assert written.router_state == saved.router_state is None
    assert written.tiers == saved.tiers
    assert written.training == saved.training
    assert (written.model_id, written.step, written.epoch) == (saved.model_id, saved.step, saved.epoch)
