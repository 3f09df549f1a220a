"""Objects with ``state_dict()``/``load_state_dict()`` beyond modules and optimizers: DCP's
``Stateful`` protocol and torchdata's ``StatefulDataLoader`` resume exactly through shardkeep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

import shardkeep as sk

# torchdata 0.11 calls its own deprecated set_vital() on every new iterator.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Counter:
    """A minimal DCP ``Stateful``: no module, no optimizer, just the protocol."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = int(state_dict["seen"])
        self.history = state_dict["history"].clone()


def test_a_dcp_stateful_object_round_trips(tmp_path: Path) -> None:
    counter = Counter()
    assert isinstance(counter, Stateful)
    counter.seen, counter.history = 5, torch.tensor([1.0, 2.0, 3.0])
    sk.save({"counter": counter}, tmp_path / "ckpt")
    restored = Counter()
    sk.load(tmp_path / "ckpt", into={"counter": restored})
    assert restored.seen == 5 and torch.equal(restored.history, counter.history)


def _loader(num_workers: int, seed: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    return StatefulDataLoader(
        data,  # a tensor is a map-style dataset of its rows
        batch_size=2,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloader_resumes_at_the_next_batch(tmp_path: Path, num_workers: int) -> None:
    """Save a StatefulDataLoader after 3 of its 10 batches; a new loader (another seed) filled
    from the checkpoint yields exactly the 7 batches the original had left, in order."""
    reference = [batch.clone() for batch in _loader(num_workers, seed=1)]
    loader = _loader(num_workers, seed=1)
    iterator = iter(loader)
    consumed = [next(iterator) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(consumed, reference[:3], strict=True))
    sk.save({"loader": loader, "step": 3}, tmp_path / "ckpt")
    del iterator

    resumed = _loader(num_workers, seed=99)  # its own order would differ
    sk.load(tmp_path / "ckpt", into={"loader": resumed, "step": 0})
    rest = [batch.clone() for batch in resumed]

    assert len(rest) == 7
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[3:], strict=True))
    assert sk.verify(tmp_path / "ckpt").ok


def test_rng_capture_restores_exactly_and_cuda_states_are_only_used_with_cuda() -> None:
    """capture_rng/restore_rng put back Python's, numpy's and torch's generators; this machine
    has no CUDA, so no "cuda" states are captured, and a checkpoint's CUDA states (from a GPU
    run) are left unused rather than refused."""
    import random

    import numpy as np

    captured = sk.TrainingCheckpoint.capture_rng()
    assert "cuda" not in captured  # torch.cuda.is_available() is false here
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    from_gpu_run = {**captured, "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    sk.TrainingCheckpoint.restore_rng(from_gpu_run)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
