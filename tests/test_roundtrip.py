"""save/load round trips: every dtype and shape, nested state, in-place loading, options."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardkeep as sk
from shardkeep.saving import SaveSettings, run_save
from shardkeep.tensors.convert import TORCH_TO_NAME
from shardkeep.tensors.shardfile import header_form
from shardkeep.writes import ByteBudget

ALL_TORCH_DTYPES = list(TORCH_TO_NAME)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator)
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.randn(shape, generator=generator).to(dtype)
    if str(dtype).startswith("torch.bits") or dtype.is_floating_point:
        # fp8, fp4 and raw bit dtypes: random bytes
        count = math.prod(shape) * dtype.itemsize
        return torch.randint(0, 256, (count,), generator=generator, dtype=torch.uint8).view(dtype).reshape(shape)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe) of two tensors of the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips(tmp_path: Path, dtype: torch.dtype) -> None:
    base = _random(dtype, (6, 5, 4))
    state = {
        "scalar": _random(dtype, ()),
        "empty": _random(dtype, (0, 3)),
        "vector": _random(dtype, (17,)),
        "matrix": base[0],
        "non_contiguous": base.transpose(0, 2),
        "strided": base[::2, 1:, ::3],
        "expanded": _random(dtype, (1, 4)).expand(3, 4),
    }
    sk.save(state, tmp_path / "ckpt")
    loaded = sk.load(tmp_path / "ckpt")
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert _same(loaded[key], tensor), key
    # Every shard is a valid safetensors file that the safetensors library reads back exactly
    # (a dtype safetensors has no name for: its bytes, under the dtype that carries them).
    with safe_open(str(tmp_path / "ckpt" / "shards" / "rank_00000.safetensors"), framework="pt") as handle:
        for key, tensor in state.items():
            found = handle.get_tensor(key)
            header_dtype, header_shape = header_form(TORCH_TO_NAME[dtype], list(tensor.shape))
            assert TORCH_TO_NAME[found.dtype] == header_dtype and list(found.shape) == header_shape, key
            assert _same(found.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize(
    "dtype",
    [
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
    ],
)
def test_numpy_arrays_round_trip_as_numpy(tmp_path: Path, dtype: Any) -> None:
    array = (np.arange(60).reshape(3, 4, 5) % 7).astype(dtype)
    state = {
        "array": array,
        "view": array[:, ::2, 1:],
        "zero_d": np.array(3, dtype=dtype),
        "empty": np.zeros((0, 2), dtype),
    }
    sk.save(state, tmp_path / "ckpt")
    loaded = sk.load(tmp_path / "ckpt")
    for key, value in state.items():
        assert isinstance(loaded[key], np.ndarray), key
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
        np.testing.assert_array_equal(loaded[key], value)


def test_nested_state_round_trips_exactly(tmp_path: Path) -> None:
    state = {
        "ints": {0: torch.ones(2), 1: {"deep": torch.zeros(1)}},
        "tuple": (1, "two", torch.arange(3)),
        "list": [1.5, [2, 3], {"a": None}],
        "specials": [math.inf, -math.inf],
        "nan": math.nan,
        "empty_dict": {},
        "empty_list": [],
        "bools": [True, False],
        "big": 2**63 - 1,
        "text": "héllo ✓",
        "np_scalar": np.float32(2.5),
    }
    sk.save(state, tmp_path / "ckpt")
    loaded = sk.load(tmp_path / "ckpt")
    assert list(loaded) == list(state)  # key order is preserved
    assert torch.equal(loaded["ints"][0], torch.ones(2))
    assert torch.equal(loaded["ints"][1]["deep"], torch.zeros(1))
    assert isinstance(loaded["tuple"], tuple) and loaded["tuple"][:2] == (1, "two")
    assert torch.equal(loaded["tuple"][2], torch.arange(3))
    assert loaded["list"] == [1.5, [2, 3], {"a": None}]
    assert loaded["specials"] == [math.inf, -math.inf]
    assert math.isnan(loaded["nan"])
    assert loaded["empty_dict"] == {} and loaded["empty_list"] == []
    assert loaded["bools"] == [True, False] and loaded["big"] == 2**63 - 1
    assert loaded["text"] == "héllo ✓"
    assert loaded["np_scalar"] == 2.5


def test_modules_and_optimizers_expand_and_load_in_place(
    tmp_path: Path, make_state: Callable[..., dict[str, Any]]
) -> None:
    original = make_state(seed=1)
    sk.save(original, tmp_path / "ckpt")
    target = make_state(seed=2)
    weight_before = target["model"][0].weight
    result = sk.load(tmp_path / "ckpt", into=target)
    assert result is target
    assert target["model"][0].weight is weight_before  # filled in place, not replaced
    for (name, mine), (_, theirs) in zip(
        target["model"].state_dict().items(), original["model"].state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    loaded_optim = target["optim"].state_dict()
    original_optim = original["optim"].state_dict()
    for index, values in original_optim["state"].items():
        for name, tensor in values.items():
            assert torch.equal(loaded_optim["state"][index][name], tensor), (index, name)
    assert loaded_optim["param_groups"][0]["betas"] == original_optim["param_groups"][0]["betas"]
    assert target["step"] == original["step"]
    assert torch.equal(target["ema"]["0.weight"], original["ema"]["0.weight"])
    assert torch.equal(target["rng"], original["rng"])


def test_extra_ignore_fills_what_into_holds_and_adds_nothing(
    tmp_path: Path, make_state: Callable[..., dict[str, Any]]
) -> None:
    """load(into=..., extra="ignore"): what into= holds is filled (a module, an optimizer and
    plain tensors alike); saved state it lacks (tensors, JSON values) is neither read into it
    nor added; a key of into= the checkpoint lacks is still an error, before anything changes."""
    original = make_state(seed=1)
    sk.save(original, tmp_path / "ckpt")
    target = make_state(seed=2)
    del target["ema"], target["step"]
    target["model"] = torch.nn.Sequential(torch.nn.Linear(8, 6))  # the first of its layers
    result = sk.load(tmp_path / "ckpt", into=target, select=sk.LoadSelection(extra="ignore"))
    assert result is target and "ema" not in target and "step" not in target
    assert torch.equal(target["model"][0].weight, original["model"][0].weight)
    assert torch.equal(target["rng"], original["rng"])
    added = make_state(seed=2)
    del added["ema"]
    sk.load(tmp_path / "ckpt", into=added)  # the default adds what into= lacks
    assert torch.equal(added["ema"]["0.weight"], original["ema"]["0.weight"])
    rng_before = target["rng"].clone()
    with pytest.raises(sk.UnsupportedValueError, match="not_saved"):
        sk.load(
            tmp_path / "ckpt", into={**target, "not_saved": torch.zeros(1)}, select=sk.LoadSelection(extra="ignore")
        )
    assert torch.equal(target["rng"], rng_before)
    with pytest.raises(sk.UnsupportedValueError, match="extra='sometimes'"):
        sk.load(tmp_path / "ckpt", into=target, select=sk.LoadSelection(extra="sometimes"))
    with pytest.raises(sk.UnsupportedValueError, match="needs into="):
        sk.load(tmp_path / "ckpt", select=sk.LoadSelection(extra="ignore"))


@pytest.mark.parametrize("extra", ["add", "ignore"])
def test_lists_in_into_are_filled_in_place_and_optimizers_whole(tmp_path: Path, extra: str) -> None:
    """Tensors and modules inside lists of into= are filled in place (never replaced by their
    loaded state), an optimizer gets all of its state (a tensor learning rate too), and a None
    slot takes the saved value: with the default and with extra="ignore"."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = {"bufs": [torch.ones(3), torch.full((2,), 7.0)], "m": [torch.nn.Linear(2, 2)], "o": optimizer}
    saved["slot"] = torch.arange(4.0)
    sk.save(saved, tmp_path / "ckpt")

    new_model = torch.nn.Linear(2, 2)
    into = {
        "bufs": [torch.zeros(3), torch.zeros(2)],
        "m": [torch.nn.Linear(2, 2)],
        "o": torch.optim.Adam(new_model.parameters(), lr=torch.tensor(0.5)),
        "slot": None,
    }
    buffer, module = into["bufs"][0], into["m"][0]
    sk.load(tmp_path / "ckpt", into=into, select=sk.LoadSelection(extra=extra))

    assert into["bufs"][0] is buffer and torch.equal(buffer, torch.ones(3))
    assert torch.equal(into["bufs"][1], torch.full((2,), 7.0))
    assert into["m"][0] is module and torch.equal(module.weight, saved["m"][0].weight)
    assert float(into["o"].param_groups[0]["lr"]) == pytest.approx(0.01)
    assert torch.equal(into["slot"], torch.arange(4.0))


def test_a_list_of_live_objects_of_another_length_is_refused(tmp_path: Path) -> None:
    sk.save({"m": [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]}, tmp_path / "ckpt")
    into = {"m": [torch.nn.Linear(2, 2)]}
    before = into["m"][0].weight.detach().clone()
    with pytest.raises(sk.UnsupportedValueError, match=r"'m': into= holds a list of 1 .* a list of 2"):
        sk.load(tmp_path / "ckpt", into=into)
    assert len(into["m"]) == 1 and torch.equal(into["m"][0].weight, before)


def test_load_into_checks_everything_before_modifying_anything(
    tmp_path: Path, make_state: Callable[..., dict[str, Any]]
) -> None:
    sk.save(make_state(seed=1), tmp_path / "ckpt")
    target = make_state(seed=2)
    target["model"] = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    ema_before = target["ema"]["0.weight"].clone()
    with pytest.raises(sk.UnsupportedValueError, match=r"model\.2\.weight"):
        sk.load(tmp_path / "ckpt", into=target)
    assert torch.equal(target["ema"]["0.weight"], ema_before)
    with pytest.raises(sk.UnsupportedValueError, match="not_saved"):
        sk.load(tmp_path / "ckpt", into={**make_state(), "not_saved": torch.zeros(1)})
    wrong_dtype = make_state()
    wrong_dtype["ema"]["0.weight"] = torch.zeros(6, 8, dtype=torch.float64)
    with pytest.raises(sk.UnsupportedValueError, match=r"ema\.0\.weight"):
        sk.load(tmp_path / "ckpt", into=wrong_dtype)


def test_unsupported_values_are_refused_with_their_key(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match=r"'config\.callback'"):
        sk.save({"config": {"callback": print}}, tmp_path / "a")
    with pytest.raises(sk.UnsupportedValueError, match="keys must be str or int"):
        sk.save({"bad": {(1, 2): 3}}, tmp_path / "b")
    with pytest.raises(sk.UnsupportedValueError, match=r"both flatten to the key 'a\.b'"):
        sk.save({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}, tmp_path / "c")
    with pytest.raises(sk.UnsupportedValueError, match=r"sparse|layout"):
        sk.save({"sparse": torch.eye(3).to_sparse()}, tmp_path / "d")
    with pytest.raises(sk.UnsupportedValueError, match="state must be a mapping"):
        sk.save([torch.zeros(1)], tmp_path / "e")  # type: ignore[arg-type]  # deliberately wrong type
    with pytest.raises(sk.UnsupportedValueError, match="digest"):
        sk.save({"x": torch.zeros(1)}, tmp_path / "f", options=sk.WriteOptions(digest="md5"))
    cycle: dict[str, Any] = {}
    cycle["self"] = [cycle, torch.zeros(1)]
    with pytest.raises(sk.UnsupportedValueError, match="deeper"):
        sk.save(cycle, tmp_path / "g")
    # Nothing was left behind by any refused save.
    assert os.listdir(tmp_path) == []


def test_saving_onto_a_committed_checkpoint_raises_and_changes_nothing(
    tmp_path: Path, tree_listing: Callable[[Path], list[str]]
) -> None:
    sk.save({"x": torch.ones(3)}, tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "manifest.json").read_bytes()
    with pytest.raises(sk.CheckpointExistsError, match="ckpt"):
        sk.save({"x": torch.zeros(3)}, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "manifest.json").read_bytes() == before
    assert torch.equal(sk.load(tmp_path / "ckpt")["x"], torch.ones(3))
    assert tree_listing(tmp_path) == ["ckpt", "ckpt/manifest.json", "ckpt/shards", "ckpt/shards/rank_00000.safetensors"]


@pytest.mark.parametrize("digest", ["blake3", "xxh3-128", "sha256"])
def test_digest_algorithm_is_selectable_and_recorded(tmp_path: Path, digest: str) -> None:
    manifest = sk.save({"x": torch.arange(10)}, tmp_path / "ckpt", options=sk.WriteOptions(digest=digest))
    assert manifest.digest_algorithm == digest
    assert all(record.digest and record.digest.startswith(digest + ":") for record in manifest.files)
    assert sk.read_manifest(tmp_path / "ckpt").files[0].digest == manifest.files[0].digest
    assert sk.verify(tmp_path / "ckpt").ok
    assert torch.equal(sk.load(tmp_path / "ckpt")["x"], torch.arange(10))


def test_large_states_split_into_several_aligned_files(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(256, 256) for i in range(8)}
    state.update({f"h{i}": torch.randn(100).half() for i in range(5)})
    state["flag"] = torch.tensor([True, False, True])
    manifest = sk.save(state, tmp_path / "ckpt", options=sk.WriteOptions(file_size_target=600_000))
    assert len(manifest.files) >= 3
    assert manifest.sharding.shard_count == len(manifest.files)
    for record in manifest.files:
        for entry in record.tensors:
            itemsize = entry.nbytes // max(1, math.prod(entry.shape))
            assert entry.offset % max(itemsize, 1) == 0, entry.key
        loaded = load_file(str(tmp_path / "ckpt" / record.path))
        for entry in record.tensors:
            assert torch.equal(loaded[entry.key], state[entry.key])
    result = sk.load(tmp_path / "ckpt", mmap=False)
    assert all(torch.equal(result[k], v) for k, v in state.items())


def test_manifest_records_absolute_offsets_and_training_fields(tmp_path: Path, state: dict[str, Any]) -> None:
    manifest = sk.save(
        state,
        tmp_path / "ckpt",
        step=7,
        fields=sk.ManifestFields(model_id="tiny-mlp", epoch=2, custom_fields={"run": "abc"}),
    )
    data = (tmp_path / "ckpt" / manifest.files[0].path).read_bytes()
    weight = state["model"][0].weight.detach()
    entry = next(e for e in manifest.files[0].tensors if e.key == "model.0.weight")
    assert data[entry.offset : entry.offset + entry.nbytes] == weight.numpy().tobytes()
    assert (manifest.step, manifest.epoch, manifest.model_id) == (7, 2, "tiny-mlp")
    assert manifest.training.optimizer_type == "AdamW" and manifest.training.learning_rate == pytest.approx(1e-3)
    assert manifest.optim_state is not None and manifest.optim_state.prefixes == ["optim"]
    assert manifest.sharding.precision == "fp32"
    assert sk.read_manifest(tmp_path / "ckpt").custom_fields == {"run": "abc"}


def test_expert_and_router_tensors_are_classified(tmp_path: Path) -> None:
    state = {
        "layers.3.experts.5.w1": torch.zeros(2),
        "layers.3.router.weight": torch.zeros(2),
        "layers.0.attn.q": torch.zeros(2),
    }
    manifest = sk.save(state, tmp_path / "ckpt")
    entries = {entry.key: entry for _, entry in manifest.iter_tensors()}
    assert entries["layers.3.experts.5.w1"].kind == "expert"
    assert entries["layers.3.experts.5.w1"].expert_key == [1, 3, 5]
    assert entries["layers.0.attn.q"].kind == "dense"
    assert manifest.router_state is not None and manifest.router_state.prefixes == ["layers.3.router"]


def test_byte_budget_bounds_copies_of_non_contiguous_tensors(tmp_path: Path) -> None:
    big = torch.randn(2048, 1024).t()  # 8 MiB, non-contiguous: must be copied to be written
    small = {f"s{i}": torch.randn(64) for i in range(500)}
    budget = ByteBudget(2 << 20)
    run_save({"big": big, **small}, tmp_path / "ckpt", SaveSettings(byte_budget=2 << 20, budget=budget))
    assert 0 < budget.peak <= 2 << 20
    assert torch.equal(sk.load(tmp_path / "ckpt")["big"], big)


def test_loaded_tensors_are_writable_and_never_write_back(tmp_path: Path) -> None:
    sk.save({"x": torch.zeros(4)}, tmp_path / "ckpt")
    loaded = sk.load(tmp_path / "ckpt")
    loaded["x"] += 1
    assert torch.equal(sk.load(tmp_path / "ckpt")["x"], torch.zeros(4))
    assert sk.verify(tmp_path / "ckpt").ok


def test_state_with_only_json_leaves(tmp_path: Path) -> None:
    manifest = sk.save({"epoch": 3, "note": "no tensors"}, tmp_path / "ckpt")
    assert manifest.sharding.shard_count == len(manifest.files) == 0
    assert sk.load(tmp_path / "ckpt") == {"epoch": 3, "note": "no tensors"}
    assert sk.verify(tmp_path / "ckpt").ok


def test_load_of_missing_or_staging_path_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(sk.CheckpointNotFoundError, match="nothing_here"):
        sk.load(tmp_path / "nothing_here")
    staging = tmp_path / f"step_1.tmp-{'abc0' * 8}"
    staging.mkdir()
    with pytest.raises(sk.CheckpointNotFoundError, match="staging"):
        sk.load(staging)
    (tmp_path / "empty").mkdir()
    with pytest.raises(sk.CheckpointNotFoundError, match=r"manifest\.json"):
        sk.read_manifest(tmp_path / "empty")


@pytest.mark.parametrize("direct_io", [False, True], ids=["page-cache", "o-direct"])
def test_peak_memory_of_a_save_stays_within_the_byte_budget(tmp_path: Path, direct_io: bool) -> None:
    """Measured in a fresh process: saving a 256 MiB non-contiguous tensor (which must be copied
    to be written) with a 16 MiB budget grows the peak RSS by far less than the tensor. Written
    with O_DIRECT, the file also holds its aligned buffers (outside the budget, documented)."""
    program = f"""
import resource, torch, shardkeep as sk
from shardkeep.storage.local import LocalStore
tensor = torch.ones(8192, 8192).t()  # 256 MiB, transposed: not contiguous
save = sk.save  # import the saving modules before measuring
store = LocalStore({str(tmp_path)!r}, direct_io={direct_io!r})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save({{"t": tensor}}, "ckpt", storage=store, options=sk.WriteOptions(byte_budget=16 << 20))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024, dict(store.write_paths))
"""
    import subprocess
    import sys

    from shardkeep.storage.direct_io import DIRECT_IN_FLIGHT, DIRECT_IO_BLOCK

    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    growth, paths = result.stdout.strip().split(" ", 1)
    growth_mib = int(growth)
    allowed = 64 + ((DIRECT_IN_FLIGHT + 1) * DIRECT_IO_BLOCK >> 20 if direct_io else 0)
    assert growth_mib < allowed, f"peak RSS grew by {growth_mib} MiB for a 16 MiB budget ({paths})"
    assert ("'direct': 1" in paths) == direct_io, paths
    assert sk.verify(tmp_path / "ckpt").ok


def test_targets_that_cannot_be_filled_are_refused_before_anything_changes(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=0.1)
    sk.save({"model": model, "optim": optimizer, "a": torch.ones(3), "n": np.ones(3)}, tmp_path / "ckpt")

    fresh = torch.nn.Linear(4, 2)
    before = fresh.weight.detach().clone()
    one_group = torch.optim.SGD([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(sk.UnsupportedValueError, match="parameter groups"):
        sk.load(tmp_path / "ckpt", into={"model": fresh, "optim": one_group, "a": torch.zeros(3), "n": np.zeros(3)})
    assert torch.equal(fresh.weight, before)

    with torch.inference_mode():
        frozen = torch.zeros(3)
    plain = torch.zeros(3)
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    for bad, message in ((frozen, "inference"), (torch.zeros(1).expand(3), "expanded")):
        with pytest.raises(sk.UnsupportedValueError, match=message):
            sk.load(tmp_path / "ckpt", into={"model": fresh, "optim": optimizer, "a": bad, "n": np.zeros(3)})
    with pytest.raises(sk.UnsupportedValueError, match="read-only"):
        sk.load(tmp_path / "ckpt", into={"model": fresh, "optim": optimizer, "a": plain, "n": read_only})
    assert torch.equal(fresh.weight, before) and torch.equal(plain, torch.zeros(3))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
def test_non_contiguous_tensors_save_under_deterministic_algorithms(tmp_path: Path, dtype: torch.dtype) -> None:
    # Lightning's Trainer(deterministic=True) turns this on for the whole process; copying a
    # bits8 or float4 tensor then failed inside torch ("fill_empty_deterministic_").
    base = _random(dtype, (6, 5, 4))
    state = {"non_contiguous": base.transpose(0, 2), "strided": base[::2, 1:, ::3]}
    width = torch.empty(0, dtype=dtype).element_size()
    into = {
        key: torch.zeros(*tensor.shape, width, dtype=torch.uint8).view(dtype)[..., 0] for key, tensor in state.items()
    }
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        sk.save(state, tmp_path / "ckpt")
        loaded = sk.load(tmp_path / "ckpt")
        sk.load(tmp_path / "ckpt", into=into)
    finally:
        torch.use_deterministic_algorithms(previous)
    for key, tensor in state.items():
        assert _same(loaded[key], tensor), key
        assert _same(into[key], tensor), key
