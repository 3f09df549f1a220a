# The two commands: `make test` (set up from nothing and run every check) and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned CPU build of torch: pip finds it in the configured local wheel folder. An unpinned
# torch pulls gigabytes of CUDA packages.
TORCH_PIN := torch==2.13.0

.PHONY: test test-fast lint typecheck unit demo bench bench-distributed bench-ledger bench-tiers bench-reliability bench-scale bench-dcp-metadata bench-async bench-cold-start bench-memory clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q --durations=15

# Every check, set up from nothing: lint, types and the whole suite (7–21 minutes on 2 cores,
# depending on load).
test: lint typecheck unit

# The fast loop for development: every check but the tests marked slow (1.5–2 minutes on 2 cores).
test-fast: lint typecheck
	$(PY) -m pytest -q -m "not slow"

# The main job: train a mixture-of-experts model on 2 ranks, kill one in the middle of a save,
# resume on 3 (measuring each rank's reads), inspect, corrupt and recover (about 35 s on 2 cores).
# Each run works in a fresh directory under $TMPDIR (or DEMO_ARGS="--workdir NEW_DIR"); nothing
# is deleted. DEMO_ARGS=--s3 puts the cold tier on a local S3 server.
demo: $(STAMP)
	$(PY) examples/demo.py $(DEMO_ARGS)

# Every benchmark with a target, then one table of every target, met or not (about 30 minutes on
# 2 cores). A benchmark that fails shows its targets as "not measured"; each also runs alone below.
bench: $(STAMP)
	mkdir -p .bench && rm -f .bench/*.json
	-$(PY) bench/save_load.py --json .bench/save_load.json
	-$(PY) bench/distributed.py --json .bench/distributed.json
	-$(PY) bench/async_save.py --json .bench/async_save.json
	-$(PY) bench/cold_start.py --json .bench/cold_start.json
	-$(PY) bench/memory.py --json .bench/memory.json
	-$(PY) bench/tiers.py --json .bench/tiers.json
	$(PY) bench/summary.py .bench

bench-distributed: $(STAMP)
	$(PY) bench/distributed.py

bench-ledger: $(STAMP)
	$(PY) bench/ledger.py

bench-tiers: $(STAMP)
	$(PY) bench/tiers.py

# How long async_save blocks training, step by step: 4 MiB, 64 MiB and 1 GiB on 1 process and
# 3 gloo ranks (a few minutes); ASYNC_ARGS=--quick for 4 and 64 MiB.
bench-async: $(STAMP)
	$(PY) bench/async_save.py $(ASYNC_ARGS)

# The first save of 1 MiB in a fresh process against torch.save, both from process start.
bench-cold-start: $(STAMP)
	$(PY) bench/cold_start.py

# Peak memory beyond the state for save, async save and load of 1 GiB, each in a fresh process.
bench-memory: $(STAMP)
	$(PY) bench/memory.py

# Metadata growth with tensors and ranks (the target: tensors plus ranks, not tensors times ranks):
# the real save, read and load-plan code for R
# simulated ranks in one process, R = 8 ... 4096 (about 40 minutes on 2 cores); SCALE_ARGS=--quick
# for a few minutes.
bench-scale: $(STAMP)
	$(PY) bench/scale.py $(SCALE_ARGS)

# The same growth for DCP: the size of torch.distributed.checkpoint's .metadata and its save/load planning
# time for bench/scale.py's dense-70b layout, R = 8 ... 1024 simulated ranks in one process (about 35 minutes,
# R = 1024 alone 25, on 2 cores); DCP_METADATA_ARGS=--quick for 8, 64, 256 (about 8 minutes).
bench-dcp-metadata: $(STAMP)
	$(PY) bench/dcp_metadata.py $(DCP_METADATA_ARGS)

# The reliability figures at full size (1000 kill -9 trials, 10,000+ fuzz inputs ...); --ci for CI sizes.
bench-reliability: $(STAMP)
	$(PY) bench/reliability.py --markdown docs/reliability-figures.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
