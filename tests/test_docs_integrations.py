"""Every code block of docs/integrations.md runs: each ```python block is executed with ``exec``
and each ```bash block with ``bash -e``, in a fresh working directory (tmp_path), against the
installed packages, with tiny models built in code; so the page cannot drift from the code.
```console blocks (a prompt and its output) and unlabelled blocks (file trees, error text) are
illustrations, not programs, and are not run.

What a block needs (a model, a checkpoint, a process group) comes from a *setup* below, which
prepares the directory, gives the names the block uses, and checks afterwards that the block did
what the page says. The setup of a block is chosen by an HTML comment on the line just before
its fence, which the rendered page does not show:

- ``<!-- docs-test: setup=NAME -->``: the setup ``NAME`` of :data:`SETUPS`;
- ``<!-- docs-test: skip=REASON -->``: not run, for the reason given (it must say why: a GPU,
  several hosts ...); the test lists it as skipped with that reason.

A block without a comment takes the setup of its ``##`` section in :data:`SECTION_SETUPS`, or,
in a section not listed there, none: it runs with no names given. A block that fails is a
failure, never a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import shardkeep as sk

DOC = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
_FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>setup|skip)=(?P<value>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of the page."""

    line: int
    lang: str
    code: str
    section: str
    marker: tuple[str, str] | None

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.lang}"


def _blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    section = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            section = line[3:].strip()
        fence = _FENCE.match(line)
        if fence is None:
            index += 1
            continue
        start = index
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            index += 1
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        blocks.append(
            Block(
                line=start + 1,
                lang=fence.group("lang"),
                code="\n".join(lines[start + 1 : index]) + "\n",
                section=section,
                marker=(marker.group("kind"), marker.group("value")) if marker else None,
            )
        )
        index += 1
    return blocks


BLOCKS = [block for block in _blocks(DOC.read_text(encoding="utf-8")) if block.lang in ("python", "bash")]


# ------------------------------------------------------------------------------------- setups


@dataclass
class Prepared:
    """What a setup gives a block: the names it uses, a check run after it, and cleanups."""

    names: dict[str, Any] = field(default_factory=dict)
    check: Callable[[], None] = lambda: None
    cleanup: list[Callable[[], None]] = field(default_factory=list)


def _committed_checkpoints_verify() -> None:
    """Every committed checkpoint under the working directory verifies, and there is one."""
    found = [
        root
        for root, directories, files in os.walk(".")
        if "manifest.json" in files and not any(part.startswith(".") for part in Path(root).parts[1:])
    ]
    assert found, "the block committed no checkpoint"
    for root in found:
        report = sk.verify(root)
        assert report.ok, (root, report.problems)


def _tiny_gpt2(seed: int) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 17, 42, 5, 60, 1]])).logits


def _hf_folders(tmp_path: Path) -> Prepared:
    """The Hugging Face section: a signed training checkpoint ``ckpt/step_00001000`` of a tiny
    GPT-2 (with an optimizer), its ``config.json`` as ``config.to_json_file`` writes it, the
    signer's ``signer.pub``, a ``save_pretrained`` folder ``hf-model``, and ``model``: a GPT-2
    with other weights. Afterwards every folder written loads with ``from_pretrained`` to the
    trained model, and ``model`` holds the trained weights when the block loaded into it."""
    import transformers

    from shardkeep.cli import main

    assert main(["keygen", "signer", "--public", "signer.pub"]) == 0
    trained = _tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(trained.parameters())
    trained.config.to_json_file("config.json")
    sk.save({"model": trained, "optim": optimizer, "step": 1000}, "ckpt/step_00001000", signer="signer")
    trained.save_pretrained("hf-model")
    model = _tiny_gpt2(seed=1)
    expected = _logits(trained)

    def check() -> None:
        written = [name for name in ("hf-out", "hf-out2", "hf-again") if os.path.isdir(name)]
        assert written, "the block wrote no Hugging Face folder"
        for name in written:
            loaded, info = transformers.AutoModelForCausalLM.from_pretrained(name, output_loading_info=True)
            assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
            assert torch.equal(_logits(loaded.eval()), expected), name
        if os.path.isdir("ckpt/imported"):
            assert sk.verify("ckpt/imported").ok
        if not torch.equal(_logits(model), _logits(_tiny_gpt2(seed=1))):
            assert torch.equal(_logits(model), expected)

    return Prepared({"model": model}, check)


def _dcp_one_rank(tmp_path: Path) -> Prepared:
    """The DCP section on one gloo rank (the page's code runs on every rank): ``model``,
    ``optimizer`` (stepped once), ``step`` and ``path`` for the background save. Afterwards both
    checkpoints verify and the model holds the weights it had when saved (a block that loads
    puts them back)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    saved = {key: tensor.clone() for key, tensor in model.state_dict().items()}

    def check() -> None:
        _committed_checkpoints_verify()
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, saved[key]), key

    return Prepared(
        {"model": model, "optimizer": optimizer, "step": 1000, "path": "ckpts/async"},
        check,
        [dist.destroy_process_group],
    )


def _dcp_saved(tmp_path: Path) -> Prepared:
    """The DCP section's conversion block on one gloo rank: ``state`` (the model's state dict)
    and ``path``, a checkpoint ``dcp.save`` wrote there through ``ShardkeepWriter``. Afterwards
    ``model.pt`` holds what was saved, and loads with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp

    from shardkeep.dcp import ShardkeepWriter

    prepared = _dcp_one_rank(tmp_path)
    model = prepared.names["model"]
    path = "ckpts/step_00001000"
    dcp.save({"model": model.state_dict()}, storage_writer=ShardkeepWriter(path))
    saved = {key: tensor.clone() for key, tensor in model.state_dict().items()}

    def check() -> None:
        prepared.check()
        converted = torch.load("model.pt", weights_only=True)
        for key, tensor in saved.items():
            assert torch.equal(converted["model"][key], tensor), key

    names = {"state": {"model": model.state_dict()}, "path": path}
    return Prepared(names, check, prepared.cleanup)


def _lightning_fit(tmp_path: Path) -> Prepared:
    """The Lightning section: ``model``, a tiny LightningModule that logs ``val_loss``.
    Afterwards every checkpoint written verifies."""
    import lightning.pytorch as pl

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def _loss(self, batch: Any) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.layer(inputs), targets)

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            return self._loss(batch)

        def validation_step(self, batch: Any, batch_index: int) -> None:
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def _loader(self) -> Any:
            generator = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(
                torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
            )
            return torch.utils.data.DataLoader(data, batch_size=4)

        def train_dataloader(self) -> Any:
            return self._loader()

        def val_dataloader(self) -> Any:
            return self._loader()

    return Prepared({"model": TinyModule()}, _committed_checkpoints_verify)


def _accelerate(tmp_path: Path) -> Prepared:
    """The Accelerate section: ``model``, ``optimizer``, ``loader``, ``scheduler``, ``ema`` (an
    object with state_dict/load_state_dict) and ``step``. Afterwards every checkpoint written
    verifies, and the accelerator's state is reset for the tests that follow."""
    from accelerate.state import AcceleratorState

    class Ema:
        def __init__(self) -> None:
            self.value = torch.zeros(2)

        def state_dict(self) -> dict[str, Any]:
            return {"value": self.value}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.value = state["value"].clone()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    names = {
        "model": model,
        "optimizer": optimizer,
        "loader": torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
        "ema": Ema(),
        "step": 1000,
    }

    return Prepared(names, _committed_checkpoints_verify, [lambda: AcceleratorState._reset_state(True)])


def _stateful_loader(tmp_path: Path) -> Prepared:
    """The `Stateful` section: ``dataset``, ``model``, ``optim``, ``step`` and ``path``.
    Afterwards every checkpoint written verifies."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    names = {
        "dataset": torch.utils.data.TensorDataset(torch.randn(320, 4)),
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.1),
        "step": 3,
        "path": "ckpt",
    }
    return Prepared(names, _committed_checkpoints_verify)


SETUPS: dict[str, Callable[[Path], Prepared]] = {
    "hf-folders": _hf_folders,
    "dcp-one-rank": _dcp_one_rank,
    "dcp-saved": _dcp_saved,
    "lightning-fit": _lightning_fit,
    "accelerate": _accelerate,
    "stateful-loader": _stateful_loader,
}

#: The setup of a block without a ``docs-test`` comment, by the title of its ``##`` section.
SECTION_SETUPS = {
    "PyTorch distributed checkpoint (DCP): `shardkeep.integrations.dcp`": "dcp-one-rank",
    "PyTorch Lightning: `ShardkeepCheckpointIO`": "lightning-fit",
    "Hugging Face (transformers) folders": "hf-folders",
    "Hugging Face Accelerate": "accelerate",
    "`Stateful` objects and `StatefulDataLoader`": "stateful-loader",
}


def _setup_of(block: Block) -> str | None:
    if block.marker is not None:
        kind, value = block.marker
        if kind == "skip":
            pytest.skip(f"docs/integrations.md line {block.line}: {value}")
        return value
    return SECTION_SETUPS.get(block.section)


@pytest.fixture
def _workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    yield tmp_path


def _run_python(code: str, names: dict[str, Any], where: str) -> None:
    with warnings.catch_warnings():
        # Lightning 2.6.6 with torch 2.13 warns from its own code on every fit, about the tiny
        # loaders of the setup and the default logger; torchdata 0.11 calls its own deprecated
        # set_vital(). Nothing else is let through.
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", r"The '\w+_dataloader' does not have many workers")
        warnings.filterwarnings("ignore", r"The number of training batches \(\d+\) is smaller than the logging")
        warnings.filterwarnings("ignore", r"Starting from v1\.9\.0, `tensorboardX` has been removed")
        warnings.filterwarnings("ignore", r"'set_vital' is deprecated", UserWarning)
        # The page fits, then resumes with the same ModelCheckpoint directory: Lightning says so.
        warnings.filterwarnings("ignore", r"Checkpoint directory .* exists and is not empty")
        exec(compile(code, where, "exec"), {"__name__": "__docs__", **names})  # the page's own code


def _run_bash(code: str, where: str) -> None:
    import shardkeep

    source = str(Path(shardkeep.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    done = subprocess.run(["bash", "-e", "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{where} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"


def test_every_block_is_found_and_every_marker_is_known() -> None:
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        if block.marker is not None:
            kind, value = block.marker
            assert kind != "setup" or value in SETUPS, f"line {block.line}: no setup {value!r}"
            assert kind != "skip" or len(value.split()) >= 3, f"line {block.line}: say why it is skipped"
    assert all(name in SETUPS for name in SECTION_SETUPS.values())


# A bash block starts a Python process (torch, transformers) per command: ~30 s under load.
@pytest.mark.parametrize(
    "block",
    [pytest.param(block, marks=[pytest.mark.slow] if block.lang == "bash" else []) for block in BLOCKS],
    ids=[block.id for block in BLOCKS],
)
def test_the_block_runs(block: Block, _workdir: Path) -> None:
    name = _setup_of(block)
    prepared = SETUPS[name](_workdir) if name is not None else Prepared()
    where = f"docs/integrations.md:{block.line}"
    try:
        if block.lang == "python":
            _run_python(block.code, prepared.names, where)
        else:
            _run_bash(block.code, where)
        prepared.check()
    finally:
        for cleanup in prepared.cleanup:
            cleanup()
