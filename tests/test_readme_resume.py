"""The README's training loop, run verbatim: a run interrupted and resumed from its checkpoint
gives bit for bit the losses and weights of an uninterrupted run, dropout and random batches
included (the RNG states are recorded at each save and put back on restore)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"

# What the README's loop leaves to the reader, as a fresh process would set it up: seeded at
# start, a model with dropout, an EMA, random batches.
PRELUDE = textwrap.dedent(
    """
    import copy, random
    import numpy as np
    import torch
    import torch.nn.functional as F
    import shardkeep as sk

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = copy.deepcopy(model)
    args = {"width": 32}
    cfg = {"lr": 1e-2}
    every = 10
    validation = torch.randn(32, 8)

    def train_step():
        x = torch.randn(16, 8) + float(np.random.rand()) + random.random()
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for average, current in zip(ema.parameters(), model.parameters()):
                average.lerp_(current, 0.1)
        losses[step] = loss.item()

    def validate():
        model.eval()
        with torch.no_grad():
            value = F.mse_loss(model(validation), validation.sum(1, keepdim=True)).item()
        model.train()
        return value
    """
)


def _readme_loop() -> str:
    section = README.read_text().split("## In a training loop: CheckpointManager", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _run(total_steps: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {"total_steps": total_steps, "losses": {}}
    exec(compile(PRELUDE + _readme_loop(), "README.md", "exec"), namespace)
    return namespace


def test_a_resumed_run_is_bit_exact_following_the_readme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "whole").mkdir()
    monkeypatch.chdir(tmp_path / "whole")
    whole = _run(40)
    assert sorted(whole["losses"]) == list(range(1, 41))

    (tmp_path / "resumed").mkdir()
    monkeypatch.chdir(tmp_path / "resumed")
    first = _run(25)  # interrupted after step 25: the newest checkpoint is step 20
    assert first["losses"] == {step: whole["losses"][step] for step in range(1, 26)}
    second = _run(40)  # a new process: seeded as at the start, then restored
    assert sorted(second["losses"]) == list(range(21, 41))  # resumed after step 20
    assert second["losses"] == {step: whole["losses"][step] for step in range(21, 41)}  # step 36 included
    for name, value in whole["model"].state_dict().items():
        assert torch.equal(second["model"].state_dict()[name], value), name
    for name, value in whole["ema"].state_dict().items():
        assert torch.equal(second["ema"].state_dict()[name], value), name
