"""load(into=...) is all or nothing: when any object of ``into`` refuses its state, nothing in
``into`` has changed, through ``sk.load`` and ``CheckpointManager.restore``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk


class Counter:
    """A custom stateful object whose load_state_dict refuses a negative count."""

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls += 1
        self.count = state["count"]  # changes itself first, then refuses: the rollback must undo it
        if state["count"] < 0:
            raise ValueError("count must not be negative")


class HookedModule(torch.nn.Module):
    """A module with loading code of its own (taken through load_state_dict, with a snapshot)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
    return model, optim


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in optim.state_dict()["state"].items()}
    return weights, state


def _assert_unchanged(model: torch.nn.Module, optim: torch.optim.Optimizer, before: Any) -> None:
    weights, state = before
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    now = optim.state_dict()["state"]
    assert now.keys() == state.keys()
    for index, values in state.items():
        for key, value in values.items():
            assert torch.equal(now[index][key], value), (index, key)


def test_a_custom_object_failing_last_leaves_module_and_optimizer_untouched(tmp_path: Path) -> None:
    model, optim = _trained(0)
    sk.save({"model": model, "optim": optim, "counter": Counter(-5), "note": "saved"}, tmp_path / "ckpt")
    target_model, target_optim = _trained(1)
    counter = Counter(7)
    into = {"model": target_model, "optim": target_optim, "counter": counter, "note": "mine"}
    before = _snapshot(target_model, target_optim)
    with pytest.raises(sk.UnsupportedValueError, match=r"'counter'.*Counter.load_state_dict refused.*negative"):
        sk.load(tmp_path / "ckpt", into=into)
    _assert_unchanged(target_model, target_optim, before)
    assert counter.count == 7 and counter.calls == 2  # the refused load, then the rollback
    assert into["note"] == "mine"


def test_a_grad_scaler_saved_disabled_restored_enabled_changes_nothing(tmp_path: Path) -> None:
    """The real case: a GradScaler saved while disabled has an empty state, which an enabled
    scaler refuses."""
    model, optim = _trained(0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    sk.save({"model": model, "optim": optim, "scaler": scaler}, tmp_path / "ckpt")
    target_model, target_optim = _trained(1)
    target_scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    before = _snapshot(target_model, target_optim)
    with pytest.raises(sk.UnsupportedValueError, match="GradScaler"):
        sk.load(tmp_path / "ckpt", into={"model": target_model, "optim": target_optim, "scaler": target_scaler})
    _assert_unchanged(target_model, target_optim, before)
    assert target_scaler.get_scale() == 1024.0


def test_a_module_with_its_own_loading_code_is_rolled_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = HookedModule()
    sk.save({"model": source, "optim": torch.optim.SGD(source.parameters()), "counter": Counter(-1)}, tmp_path / "c")
    torch.manual_seed(1)
    target = HookedModule()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(sk.UnsupportedValueError, match="negative"):
        sk.load(
            tmp_path / "c", into={"model": target, "optim": torch.optim.SGD(target.parameters()), "counter": Counter()}
        )
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_successful_load_fills_everything(tmp_path: Path) -> None:
    model, optim = _trained(0)
    sk.save({"model": model, "optim": optim, "counter": Counter(3)}, tmp_path / "ckpt")
    target_model, target_optim = _trained(1)
    counter = Counter()
    sk.load(tmp_path / "ckpt", into={"model": target_model, "optim": target_optim, "counter": counter})
    _assert_unchanged(target_model, target_optim, _snapshot(model, optim))
    assert counter.count == 3


def test_restore_through_the_manager_is_all_or_nothing(tmp_path: Path) -> None:
    model, optim = _trained(0)
    manager = sk.CheckpointManager(tmp_path / "root", keep_last=2, keep_best=0)
    manager.save({"model": model, "optim": optim, "counter": Counter(-2)}, step=1)
    target_model, target_optim = _trained(1)
    before = _snapshot(target_model, target_optim)
    counter = Counter(4)
    with pytest.raises(sk.UnsupportedValueError, match="negative"):
        manager.restore({"model": target_model, "optim": target_optim, "counter": counter})
    _assert_unchanged(target_model, target_optim, before)
    assert counter.count == 4


class RefusingModule(torch.nn.Module):
    """A module whose own loading code refuses, after copying its weights in: it runs after the
    optimizer and with a plain field already assigned, so their rollback is what is tested."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.refuse = False

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        if self.refuse:
            raise ValueError("this module refuses")


def test_a_module_refusing_after_the_optimizer_restores_the_optimizer_and_everything_else(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = RefusingModule()
    optim = torch.optim.AdamW(source.parameters())
    source.linear(torch.randn(2, 4)).sum().backward()
    optim.step()
    sk.save({"optim": optim, "model": source, "counter": Counter(3), "note": "saved", "new": 1}, tmp_path / "c")
    torch.manual_seed(1)
    target = RefusingModule()
    target.refuse = True
    target_optim = torch.optim.AdamW(target.parameters())
    target.linear(torch.randn(2, 4)).sum().backward()
    target_optim.step()
    counter = Counter(9)
    into: dict[str, Any] = {"optim": target_optim, "model": target, "counter": counter, "note": "mine"}
    before = _snapshot(target, target_optim)
    with pytest.raises(sk.UnsupportedValueError, match="this module refuses"):
        sk.load(tmp_path / "c", into=into)
    _assert_unchanged(target, target_optim, before)
    assert counter.count == 9 and into["note"] == "mine" and "new" not in into


class NoSnapshot:
    """An object that can load state but has no state_dict() to take a snapshot from."""

    def __init__(self) -> None:
        self.value = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["count"]


def test_what_cannot_be_restored_is_named_and_the_rest_is_restored(tmp_path: Path) -> None:
    model, optim = _trained(0)
    sk.save({"model": model, "optim": optim, "plain": Counter(5), "counter": Counter(-1)}, tmp_path / "c")
    target_model, target_optim = _trained(1)
    plain = NoSnapshot()
    before = _snapshot(target_model, target_optim)
    with pytest.raises(
        sk.UnsupportedValueError, match=r"restoring the previous state failed for 'plain'.*no state_dict"
    ):
        sk.load(
            tmp_path / "c", into={"model": target_model, "optim": target_optim, "plain": plain, "counter": Counter()}
        )
    assert plain.value == 5  # loaded, and it could not be undone: the error says so
    _assert_unchanged(target_model, target_optim, before)


class OwnStateDict(torch.nn.Module):
    """A module with a state_dict() of its own (an older signature without keep_vars)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def state_dict(self, destination: Any = None, prefix: str = "") -> Any:  # type: ignore[override]  # the old signature on purpose
        return super().state_dict(destination=destination, prefix=prefix)


def test_a_module_with_its_own_state_dict_still_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = OwnStateDict()
    sk.save({"model": source}, tmp_path / "c")
    target = OwnStateDict()
    sk.load(tmp_path / "c", into={"model": target})
    assert torch.equal(target.linear.weight, source.linear.weight)


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (lambda: {"model": torch.nn.Linear(4, 5)}, r"'model.weight'.*torch.float32\[5, 4\].*torch.float32\[3, 4\]"),
        (lambda: {"model": torch.nn.Linear(4, 3).double()}, r"'model.weight'.*torch.float64\[3, 4\].*torch.float32"),
        (lambda: {"model": torch.nn.Linear(4, 3), "other": torch.zeros(1)}, r"'other'.*not in the checkpoint"),
        (lambda: {"model": torch.nn.Linear(4, 3, bias=False)}, r"'model'.*unexpected \['bias'\]"),
        (lambda: {"w": torch.zeros(2)}, r"'w'.*float32\[2\].*float32\[3\]"),
    ],
)
def test_shape_dtype_and_key_mismatches_raise_a_mismatch_error(tmp_path: Path, target: Any, match: str) -> None:
    torch.manual_seed(0)
    sk.save({"model": torch.nn.Linear(4, 3), "w": torch.zeros(3)}, tmp_path / "ckpt")
    into = target()
    before = {key: value.clone() for key, value in into["model"].state_dict().items()} if "model" in into else {}
    with pytest.raises(sk.StateMismatchError, match=match) as caught:
        sk.load(tmp_path / "ckpt", into=into)
    assert isinstance(caught.value, sk.UnsupportedValueError)  # code that catches the base still works
    for key, value in before.items():
        assert torch.equal(into["model"].state_dict()[key], value)  # nothing changed
