"""``save(..., incremental=Incremental(base=..., trust_versions=True))``: files whose tensors provably did not change
since this process saved them are referenced without hashing (:mod:`shardkeep.versions`).

Each test counts the files the save hashed (``shardkeep.saving.incremental.digest_of``), and checks that what
was saved is what the state holds. The fast path must apply to tensors changed by nothing, and
must not apply to: a tensor changed in place through torch (itself or through a view), a new
tensor object, a storage swapped in with ``.data =``, another process, shared memory, an
inference tensor, an async save. Writes through ``.data`` are not seen: that documented limit
is pinned here too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk
from shardkeep.saving import incremental

EXPERTS = 10


def moe(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(8, 64, generator=generator)}
    for expert in range(EXPERTS):
        state[f"layers.0.experts.{expert}.w1"] = torch.randn(64, 256, generator=generator)
    return state


FILES = EXPERTS + 1  # one file per expert, and one for the rest


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many files each save hashed to compare with its base (appended per call)."""
    calls: list[int] = []
    real = incremental.digest_of

    def counting(*args: Any, **kwargs: Any) -> str:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(incremental, "digest_of", counting)
    return calls


def _save_twice(root: Path, model: dict[str, torch.Tensor], change: Any, hashed: list[int]) -> sk.Manifest:
    """Save, apply ``change``, save again on top of the first; return the second manifest, after
    checking that it loads exactly what the model holds. ``hashed`` then counts the second save."""
    sk.save({"model": model}, root / "step_1", incremental=sk.Incremental(trust_versions=True))
    change(model)
    hashed.clear()
    second = sk.save(
        {"model": model}, root / "step_2", incremental=sk.Incremental(base=root / "step_1", trust_versions=True)
    )
    loaded = sk.load(root / "step_2")["model"]
    for key, value in model.items():
        assert torch.equal(loaded[key], value), key
    assert sk.verify(root / "step_2").ok
    return second


def _referenced(manifest: sk.Manifest) -> int:
    return sum(record.ref is not None for record in manifest.files)


def test_unchanged_experts_are_proved_without_hashing(tmp_path: Path, hashed: list[int]) -> None:
    def train_two(model: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():  # as an optimizer step does
            model["layers.0.experts.3.w1"].add_(0.5)
            model["layers.0.experts.7.w1"].mul_(2.0)

    second = _save_twice(tmp_path, moe(), train_two, hashed)
    assert len(hashed) == 2  # only the two trained experts were hashed (and found changed)
    assert _referenced(second) == FILES - 2


def test_without_trust_versions_every_file_is_hashed(tmp_path: Path, hashed: list[int]) -> None:
    model = moe()
    sk.save({"model": model}, tmp_path / "step_1", incremental=True)
    hashed.clear()
    second = sk.save({"model": model}, tmp_path / "step_2", incremental=tmp_path / "step_1")
    assert len(hashed) == FILES
    assert _referenced(second) == FILES


def test_an_in_place_change_through_a_view_is_seen(tmp_path: Path, hashed: list[int]) -> None:
    big = torch.randn(128, 256)
    model = moe()
    model["layers.0.experts.2.w1"] = big[:64]  # a view: it shares big's version counter

    second = _save_twice(tmp_path, model, lambda m: big[:64].add_(1.0), hashed)
    assert len(hashed) == 1
    assert _referenced(second) == FILES - 1


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.__setitem__("embed.weight", m["embed.weight"].clone()), id="new-object-same-bytes"),
        pytest.param(lambda m: setattr(m["embed.weight"], "data", m["embed.weight"] + 1), id="data-swap"),
        pytest.param(
            lambda m: setattr(m["embed.weight"], "data", m["embed.weight"].clone()), id="data-swap-same-bytes"
        ),
        pytest.param(lambda m: m["embed.weight"].share_memory_(), id="shared-memory"),
    ],
)
def test_no_proof_without_the_same_object_on_the_same_private_storage(
    tmp_path: Path, hashed: list[int], change: Any
) -> None:
    _save_twice(tmp_path, moe(), change, hashed)
    assert len(hashed) == 1  # the file holding embed.weight was hashed; the experts were proved


def test_inference_tensors_are_always_hashed(tmp_path: Path, hashed: list[int]) -> None:
    with torch.inference_mode():
        model = moe()
    second = _save_twice(tmp_path, model, lambda m: None, hashed)
    assert len(hashed) == FILES
    assert _referenced(second) == FILES


def test_another_process_hashes_everything(tmp_path: Path) -> None:
    """A fresh process has nothing recorded: it hashes every file, and references them all."""
    sk.save({"model": moe()}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    program = textwrap.dedent(
        f"""
        import shardkeep as sk
        from shardkeep.saving import incremental
        calls = []
        real = incremental.digest_of
        incremental.digest_of = lambda *a, **k: calls.append(1) or real(*a, **k)
        state = sk.load({str(tmp_path / "step_1")!r})
        manifest = sk.save(state, {str(tmp_path / "step_2")!r}, incremental=sk.Incremental(base="step_1", trust_versions=True))
        print(len(calls), sum(r.ref is not None for r in manifest.files))
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.split() == [str(FILES), str(FILES)]


def _dot_data_write(weight: torch.Tensor) -> None:
    weight.data.add_(1.0)


def _storage_write(weight: torch.Tensor) -> None:
    weight.untyped_storage().copy_((weight + 1.0).untyped_storage())


def _alias_write(weight: torch.Tensor) -> None:
    torch.empty(0).set_(weight.untyped_storage(), 0, weight.shape, weight.stride()).add_(1.0)


@pytest.mark.parametrize("write", [_dot_data_write, _storage_write, _alias_write], ids=["data", "storage", "set-alias"])
def test_writes_that_bypass_the_counter_are_not_seen_documented_limit(
    tmp_path: Path, hashed: list[int], write: Any
) -> None:
    """Writes through ``tensor.data``, through the storage object, or through another tensor
    set onto the same storage do not move the counter: with ``trust_versions`` such a change is
    missed and the earlier bytes are referenced (docs/tiers.md says so). Without the option it
    is found, which is why the option is off by default."""
    model = moe()
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    write(model["embed.weight"])
    trusted = sk.save(
        {"model": model}, tmp_path / "step_2", incremental=sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    )
    assert _referenced(trusted) == FILES  # missed: what the documentation warns about
    hashed_save = sk.save({"model": model}, tmp_path / "step_3", incremental=tmp_path / "step_1")
    assert _referenced(hashed_save) == FILES - 1
    assert torch.equal(sk.load(tmp_path / "step_3")["model"]["embed.weight"], model["embed.weight"])


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(16, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 64) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, routed: list[int]) -> torch.Tensor:
        hidden = self.embed(x)
        return sum(self.experts[index](hidden).sum() for index in routed)  # type: ignore[return-value]


@pytest.mark.parametrize("mode", ["fused", "foreach", "single"])
def test_a_module_trained_by_any_optimizer_kind_saves_what_it_holds(
    tmp_path: Path, hashed: list[int], mode: str
) -> None:
    """A module and its optimizer passed as they are (the proof follows their parameters and
    state, not detached copies), trained with AdamW in each implementation. The fused kernel
    changes parameters and state without moving their version counters: the optimizer step
    hook makes the save hash them. Experts without a gradient are proved unchanged."""
    model = Experts()
    options = {"fused": True} if mode == "fused" else {"foreach": mode == "foreach"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **options)

    def train(routed: list[int]) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 16), routed).backward()
        optimizer.step()

    train([1, 2])
    state = {"model": model, "optim": optimizer}
    sk.save(state, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    train([1, 2])  # the same two experts: their weights and Adam moments change
    hashed.clear()
    second = sk.save(
        state, tmp_path / "step_2", incremental=sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    )
    loaded = sk.load(tmp_path / "step_2")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["model"][key], value), key
    for index, moments in optimizer.state_dict()["state"].items():
        for name, value in moments.items():
            assert torch.equal(loaded["optim"]["state"][index][name], value), (index, name)
    by_file = {record.path.rsplit("/", 1)[-1]: record.ref for record in second.files}
    frozen = [name for name in by_file if "_E" in name and not name.endswith(("E001.safetensors", "E002.safetensors"))]
    assert len(frozen) == EXPERTS - 2 and all(by_file[name] == "step_1" for name in frozen), by_file
    assert len(hashed) <= len(second.files) - len(frozen)  # the frozen experts were not hashed


def test_a_parameter_that_views_a_flat_buffer_is_always_hashed(tmp_path: Path, hashed: list[int]) -> None:
    """FSDP1, DeepSpeed and Megatron give parameters views of one flat buffer (``p.data =
    flat[...]``) and update the buffer: the parameter's own counter never moves, so no proof
    is made for a tensor that is not alone on its storage."""
    model = moe()
    flat = torch.cat([value.reshape(-1) for value in model.values()])
    start = 0
    for value in model.values():
        value.data = flat[start : start + value.numel()].view_as(value)
        start += value.numel()

    second = _save_twice(tmp_path, model, lambda m: flat.add_(1.0), hashed)
    assert len(hashed) == FILES  # nothing proved; everything hashed, found changed, written
    assert _referenced(second) == 0


def test_async_saves_never_use_the_proof(tmp_path: Path, hashed: list[int]) -> None:
    """The manager forwards trust_versions to every save; an async save's state is a staged copy
    in reused buffers, so it hashes."""
    model = moe()
    manager = sk.CheckpointManager(tmp_path, keep_last=3, incremental=sk.Incremental(trust_versions=True))
    manager.save({"model": model}, step=1)
    hashed.clear()
    manager.save({"model": model}, step=2)
    assert len(hashed) == 0  # a synchronous manager save uses the proof
    manager.async_save({"model": model}, step=3).result(timeout=60)
    assert len(hashed) == FILES


def test_trust_versions_is_checked(tmp_path: Path) -> None:
    with pytest.raises(sk.UnsupportedValueError, match="trust_versions=True needs incremental="):
        sk.save({"w": torch.ones(2)}, tmp_path / "a", incremental=sk.Incremental(base=False, trust_versions=True))
    with pytest.raises(sk.UnsupportedValueError, match="trust_versions='yes' must be True or False"):
        sk.save({"w": torch.ones(2)}, tmp_path / "b", incremental=sk.Incremental(trust_versions="yes"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # not an option of async_save, in the old spelling either
        sk.async_save({"w": torch.ones(2)}, tmp_path / "c", trust_versions=True)
    with pytest.raises(sk.ConfigError, match="trust_versions"):
        sk.async_save({"w": torch.ones(2)}, tmp_path / "d", incremental=sk.Incremental(trust_versions=True))


def test_records_of_tensors_that_are_gone_are_dropped() -> None:
    """A process that saves into many roots keeps only the records that can still prove something."""
    from shardkeep.versions import KnownDigests, capture

    known = KnownDigests()
    known._min_prune = known._prune_at = 3
    kept = torch.ones(3)
    known.record(("root", "t", "kept"), b"h", capture([kept]), "blake3:aa")
    for index in range(4):
        gone = torch.ones(3)
        known.record(("root", "t", f"gone{index}"), b"h", capture([gone]), "blake3:bb")
        del gone
    assert len(known._entries) < 4  # pruned on the way: at most kept, the live one, and one after
    assert known.digest(("root", "t", "kept"), b"h", [kept]) == "blake3:aa"
    assert known.digest(("root", "t", "kept"), b"other header", [kept]) is None
    kept.add_(1)
    assert known.digest(("root", "t", "kept"), b"h", [kept]) is None


def test_module_buffers_are_always_hashed(tmp_path: Path, hashed: list[int]) -> None:
    """BatchNorm's forward updates running_mean and running_var without moving their version
    counters (the native op writes an argument other than its first): buffers get no proof."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    model[0].requires_grad_(False)
    options = sk.WriteOptions(file_size_target=1024)
    sk.save({"model": model}, tmp_path / "step_1", options=options, incremental=sk.Incremental(trust_versions=True))
    model(torch.randn(8, 32))  # train mode: the running statistics move
    incremental = sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    sk.save({"model": model}, tmp_path / "step_2", options=options, incremental=incremental)
    loaded = sk.load(tmp_path / "step_2")["model"]
    for key, value in model.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_an_optimizer_that_frees_gradients_inside_its_step_is_still_seen(tmp_path: Path) -> None:
    """The step hooks run before the step too: parameters that had a gradient when the step
    began are forgotten even if the step frees the gradient (and writes without moving the
    counter, as a fused kernel does; ``.data`` stands in for one here)."""

    class Freeing(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.data.sub_(param.grad)  # no counter moves
                        param.grad = None

    model = torch.nn.Linear(16, 16)
    optimizer = Freeing(model.parameters())
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    sk.save(
        {"model": model}, tmp_path / "step_2", incremental=sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    )
    loaded = sk.load(tmp_path / "step_2")["model"]
    assert torch.equal(loaded["weight"], model.weight.detach())
    assert torch.equal(loaded["bias"], model.bias.detach())


def test_a_module_whose_state_dict_takes_no_keep_vars_still_saves(tmp_path: Path) -> None:
    class Legacy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
            return {"weight": self.weight.detach()}

    model = Legacy()
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    assert torch.equal(sk.load(tmp_path / "step_1")["model"]["weight"], torch.ones(4))


_COLLECTIVES = ("broadcast", "all_reduce", "recv", "irecv", "scatter", "all_gather_single", "all_to_all_single")


def _change_by_collective(rank: int, weight: torch.Tensor, collective: str) -> None:
    """Write ``weight`` on every rank through ``collective`` (rank 0 changes its own first where
    the collective sends from it), as a parameter sync does."""
    import torch.distributed as dist

    if collective == "broadcast":
        if rank == 0:
            with torch.no_grad():
                weight.add_(1.0)
        dist.broadcast(weight, src=0)
    elif collective == "all_reduce":
        dist.all_reduce(weight)
    elif collective in ("recv", "irecv"):
        if rank == 0:
            with torch.no_grad():
                weight.add_(1.0)
            dist.send(weight.clone(), dst=1)
        elif collective == "recv":
            dist.recv(weight, src=0)
        else:
            dist.irecv(weight, src=0).wait()
    elif collective == "scatter":
        parts = [torch.full_like(weight, 5.0 + r) for r in range(2)] if rank == 0 else None
        dist.scatter(weight, parts, src=0)
    elif collective == "all_gather_single":
        dist.all_gather_single(weight, torch.full((weight.numel() // 2,), float(rank + 3)))
    elif collective == "all_to_all_single":
        dist.all_to_all_single(weight, torch.full_like(weight, float(rank + 7)))
    else:  # pragma: no cover
        raise AssertionError(collective)


def _save_collective_save(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    """Per collective: save, write every rank's weight through the collective, save again with
    the proof; return what each rank's weight holds after the collective."""
    after: dict[str, list[float]] = {}
    for collective in _COLLECTIVES:
        weight = torch.ones(4096)
        state = {"model": {f"w{rank}": weight}}  # each rank saves its own weight
        sk.save(state, f"{root}/{collective}/step_1", incremental=sk.Incremental(trust_versions=True))
        _change_by_collective(rank, weight, collective)
        sk.save(
            state,
            f"{root}/{collective}/step_2",
            incremental=sk.Incremental(base=f"{root}/{collective}/step_1", trust_versions=True),
        )
        after[collective] = weight.tolist()
    return after


def test_a_tensor_written_by_a_collective_is_never_proved_unchanged(tmp_path: Path) -> None:
    # Collectives write tensors without moving their version counters: with a process group, the
    # proof must not be trusted, or the second save references the first save's stale bytes.
    from tests.support.distributed_harness import results_or_raise, run_ranks

    results = results_or_raise(run_ranks(2, _save_collective_save, str(tmp_path), outbox=tmp_path / "outbox"))
    stale = []
    for collective in _COLLECTIVES:
        checkpoint = tmp_path / collective / "step_2"
        assert sk.verify(checkpoint).ok, collective
        loaded = sk.load(checkpoint)["model"]
        for rank in range(2):
            if loaded[f"w{rank}"].tolist() != results[rank][collective]:
                stale.append(f"{collective} (rank {rank})")
    assert stale == []


def test_swap_tensors_works_on_parameters_a_proved_save_holds(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    replacement = torch.nn.Parameter(torch.full((8, 8), 3.0))
    torch.utils.swap_tensors(model.weight, replacement)
    sk.save(
        {"model": model}, tmp_path / "step_2", incremental=sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    )
    assert torch.equal(sk.load(tmp_path / "step_2")["model"]["weight"], torch.full((8, 8), 3.0))


def test_load_state_dict_with_the_swap_flag_works_after_a_proved_save(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict({"weight": torch.full((8, 8), 2.0), "bias": torch.zeros(8)})
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    sk.save(
        {"model": model}, tmp_path / "step_2", incremental=sk.Incremental(base=tmp_path / "step_1", trust_versions=True)
    )
    assert torch.equal(sk.load(tmp_path / "step_2")["model"]["weight"], torch.full((8, 8), 2.0))


def test_a_new_object_at_a_reused_address_is_never_proved(tmp_path: Path) -> None:
    # ``param.data`` makes a new tensor object on the parameter's storage, with a version counter
    # of its own starting at 0: freed after each save, the next one can land at the same address.
    param = torch.nn.Parameter(torch.ones(4096))
    previous = None
    stale = 0
    for step in range(60):
        state = {"w": param.data}
        path = tmp_path / f"step_{step}"
        sk.save(
            state,
            path,
            incremental=sk.Incremental(base=previous if previous is not None else True, trust_versions=True),
        )
        if not torch.equal(sk.load(path)["w"], param.detach()):
            stale += 1
        del state
        with torch.no_grad():
            param.mul_(1.01)
        previous = path
    assert stale == 0


def test_a_proved_tensor_still_round_trips_through_torch_save_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    sk.save({"model": model}, tmp_path / "step_1", incremental=sk.Incremental(trust_versions=True))
    torch.save(model.state_dict(keep_vars=True), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(loaded["weight"], model.weight)
