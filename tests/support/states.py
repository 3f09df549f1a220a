"""A small deterministic training state, and a comparison of two state trees."""

from __future__ import annotations

from typing import Any

import torch


def make_state(seed: int = 0) -> dict[str, Any]:
    """A small training-like state: a module, an optimizer with state, JSON leaves, odd tensors."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8, generator=generator)).sum().backward()
    optimizer.step()
    return {
        "model": model,
        "optim": optimizer,
        "step": 7 + seed,
        "best_val_loss": float("inf"),
        "config": {"name": "tiny", "layers": [8, 6, 2], "dropout": 0.0},
        "ema": {"0.weight": torch.randn(6, 8, generator=generator)},
        "rng": torch.get_rng_state(),
    }


def assert_same_tree(found: Any, expected: Any, where: str = "") -> None:
    """``found`` holds exactly ``expected``: the same keys, lengths, values, and tensors of the
    same dtype and values (a DTensor is compared by its full tensor)."""
    if isinstance(expected, torch.Tensor) or isinstance(found, torch.Tensor):
        assert isinstance(found, torch.Tensor) and isinstance(expected, torch.Tensor), where
        found = found.full_tensor() if hasattr(found, "full_tensor") else found
        assert found.dtype == expected.dtype and torch.equal(found, expected), where
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and set(found) == set(expected), (where, sorted(found), sorted(expected))
        for key in expected:
            assert_same_tree(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(found) == len(expected), where
        for index, (a, b) in enumerate(zip(found, expected, strict=True)):
            assert_same_tree(a, b, f"{where}[{index}]")
    else:
        assert found == expected, (where, found, expected)


#: Rows of :func:`row_sharded`'s tensor (divisible by 1, 2, 3, 4 and 6 ranks).
ROWS = 24


def full_rows(step: int) -> torch.Tensor:
    """The whole ``[ROWS, 4]`` tensor a run saves at ``step`` (its values name the step)."""
    return torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) + 1000 * step


def row_sharded(step: int, *, zeros: bool = False) -> dict[str, Any]:
    """On a rank of an initialized process group: ``full_rows(step)`` (or zeros, as a restore
    target) sharded by rows over every rank, and the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.zeros(ROWS, 4) if zeros else full_rows(step)
    return {"weights": distribute_tensor(full, mesh, [Shard(0)]), "step": 0 if zeros else step}
