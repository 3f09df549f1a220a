"""Hugging Face Accelerate: save and restore what ``Accelerator.save_state`` saves, as one
verified shardkeep checkpoint instead of a folder of pickles.

``Accelerator.save_state`` writes ``model.safetensors``, then ``optimizer.bin``,
``scheduler.bin``, ``sampler.bin``, ``random_states_<i>.pkl`` and ``custom_checkpoint_<i>.pkl``
with ``torch.save`` (pickles). :func:`save_state` saves the same things through
:func:`shardkeep.save`:

- every prepared model (unwrapped), optimizer and scheduler, in the order Accelerate holds them;
- the grad scaler, when mixed precision uses one;
- each stateful data loader's state, and each seedable sampler's epoch and seed;
- every object registered with ``accelerator.register_for_checkpointing``;
- ``accelerator.step``;
- the RNG states of this process: Python's ``random``, numpy's, torch's CPU generator and, with
  CUDA, every CUDA device's, stored as JSON bytes, so nothing is pickled.

:func:`load_state` fills the live objects in place after checking every digest, and puts the
RNG states and the step back. Accelerate itself is never imported here: the functions read the
``Accelerator``'s own attributes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardkeep.api import load, save
from shardkeep.errors import CheckpointFieldError, UnsupportedValueError
from shardkeep.manifest import Manifest
from shardkeep.training import TrainingCheckpoint

__all__ = ["accelerator_state", "load_state", "save_state"]


def _process_key(accelerator: Any) -> str:
    return f"process_{int(getattr(accelerator, 'process_index', 0))}"


def _inner_optimizer(optimizer: Any) -> Any:
    """Accelerate's ``AcceleratedOptimizer`` wraps the optimizer that holds the state."""
    return getattr(optimizer, "optimizer", optimizer)


def _sampler_of(loader: Any) -> Any:
    """The seedable sampler of a prepared data loader, if it has one (``epoch`` and
    ``initial_seed`` are all of its state)."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if sampler is not None and hasattr(sampler, "epoch") and hasattr(sampler, "initial_seed"):
            return sampler
    return None


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The live objects :func:`save_state` saves and :func:`load_state` fills, keyed by kind and
    position (``models.0``, ``optimizers.0``, ``custom.0`` ...)."""
    state: dict[str, Any] = {
        "models": {str(i): accelerator.unwrap_model(model) for i, model in enumerate(accelerator._models)},
        "optimizers": {str(i): _inner_optimizer(opt) for i, opt in enumerate(accelerator._optimizers)},
        "schedulers": {str(i): scheduler for i, scheduler in enumerate(accelerator._schedulers)},
        "dataloaders": {
            str(i): loader
            for i, loader in enumerate(accelerator._dataloaders)
            if getattr(loader, "use_stateful_dataloader", False)
        },
        "custom": {},
    }
    for i, obj in enumerate(accelerator._custom_objects):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UnsupportedValueError(
                f"custom object {i} ({type(obj).__name__}) registered for checkpointing has no "
                "state_dict()/load_state_dict()"
            )
        state["custom"][str(i)] = obj
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    return state


def _rng_bytes() -> torch.Tensor:
    """This process's RNG states (:meth:`TrainingCheckpoint.capture_rng`) as UTF-8 JSON bytes."""
    captured = TrainingCheckpoint.capture_rng()
    plain = {
        "python": captured["python"],
        "numpy": {**captured["numpy"], "key": captured["numpy"]["key"].tolist()},
        "torch": captured["torch"].tolist(),
    }
    if "cuda" in captured:
        plain["cuda"] = [state.tolist() for state in captured["cuda"]]
    return torch.frombuffer(bytearray(json.dumps(plain).encode()), dtype=torch.uint8)


class _ProcessRng:
    """This process's RNG states as a stateful object of the saved state: restored by the fill
    itself (``load_state_dict``), so a refused state rolls back everything the load changed."""

    def state_dict(self) -> dict[str, Any]:
        return {"states": _rng_bytes()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _restore_rng(state["states"])


class _Counters:
    """``accelerator.step`` and the samplers' epochs and seeds, restored inside the fill."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.samplers = {
            str(i): sampler
            for i, loader in enumerate(accelerator._dataloaders)
            if (sampler := _sampler_of(loader)) is not None
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": int(self.accelerator.step),
            "samplers": {
                index: {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
                for index, sampler in self.samplers.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            step = int(state["step"])
            samplers = {
                index: (int(state["samplers"][index]["epoch"]), int(state["samplers"][index]["initial_seed"]))
                for index in self.samplers
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFieldError("counters", f"the saved step or sampler states are unusable: {exc!r}") from exc
        self.accelerator.step = step
        for index, (epoch, seed) in samplers.items():
            self.samplers[index].epoch, self.samplers[index].initial_seed = epoch, seed


def _state_with_counters(accelerator: Any) -> dict[str, Any]:
    state = accelerator_state(accelerator)
    state["counters"] = _Counters(accelerator)
    state["rng"] = {_process_key(accelerator): _ProcessRng()}
    return state


def save_state(accelerator: Any, path: str | os.PathLike[str], **save_options: Any) -> Manifest:
    """Save what ``accelerator.save_state`` would save as one shardkeep checkpoint at ``path``
    and return its manifest. ``save_options`` go to :func:`shardkeep.save` (``signer=``,
    ``digest=``, ``compression=`` ...). With several processes, every process calls it, as it
    calls ``save_state``; each keeps its own RNG states."""
    return save(_state_with_counters(accelerator), path, **save_options)


def load_state(accelerator: Any, path: str | os.PathLike[str], **load_options: Any) -> None:
    """Restore a checkpoint written by :func:`save_state` into ``accelerator``'s prepared
    objects, its step and samplers, and this process's RNG states, in place, after every digest
    is checked; all or nothing (a refused RNG state, say for another number of CUDA devices,
    leaves everything as it was). The objects must be prepared in the same order as when it
    was saved; other processes' RNG states are not read (``extra="ignore"``). ``load_options``
    go to :func:`shardkeep.load` (``public_key=`` ...)."""
    load(path, into=_state_with_counters(accelerator), extra="ignore", **load_options)


def _restore_rng(rng: Any) -> None:
    try:
        plain: Mapping[str, Any] = json.loads(bytes(np.asarray(rng, dtype=np.uint8)).decode())
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        raise CheckpointFieldError("rng", f"the saved RNG states are not JSON: {exc}") from exc
    TrainingCheckpoint.restore_rng(plain)
