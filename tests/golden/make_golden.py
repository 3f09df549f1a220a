"""How the golden files in this folder were made (run once per released format version).

Golden files are never regenerated for a version that has been released: the tests decode the
committed bytes so that a reader change that breaks old checkpoints fails loudly.

    .venv/bin/python tests/golden/make_golden.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import shardkeep as sk
from shardkeep.integrity import seal_manifest

HERE = Path(__file__).parent


def main() -> None:
    checkpoint = HERE / "v1.0" / "step_00000042"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    state = {
        "model": {"weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "bias": torch.tensor([1, 2, 3])},
        "half": torch.tensor([0.5, -2.0], dtype=torch.bfloat16),
        "step": 42,
        "config": {"lr": 0.1, "name": "golden"},
        "pair": (1, 2),
        "best": float("inf"),
    }
    sk.save(
        state,
        checkpoint,
        step=42,
        fields=sk.ManifestFields(model_id="golden-model", epoch=3, custom_fields={"owner": "tests"}),
    )

    body = json.loads((checkpoint / "manifest.json").read_bytes())
    body.pop("manifest_digest")
    body["metadata_version"] = "1.1"
    body["future_top_level"] = {"hint": "added in 1.1"}
    body["files"][0]["future_file_field"] = 7
    body["files"][0]["tensors"][0]["future_tensor_field"] = [1, 2]
    (HERE / "manifest-v1.1-unknown-fields.json").write_bytes(
        seal_manifest(json.dumps(body, separators=(",", ":")).encode(), "blake3")
    )
    body["metadata_version"] = "3.0"  # 2.0 is readable since format 2.0 (rank indexes)
    (HERE / "manifest-v3.0-newer-major.json").write_bytes(
        seal_manifest(json.dumps(body, separators=(",", ":")).encode(), "blake3")
    )


if __name__ == "__main__":
    main()
