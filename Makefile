# The README's two commands: `make lab` (set up, then open JupyterLab on the project) and `make test`
# (set up, then run every test and notebook). Everything installs into a project-local .venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.llmlab-installed
PORT   ?= 8888

.PHONY: setup lab test lint exercises doctor site busy-check flake gpu-suite gpu-suite-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/install-torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	sh tools/install-torch.sh $(BIN)/python
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

# JupyterLab rooted at the project (chapters/, exercises/, solutions/), opening START.md, on localhost with a
# token; as root (containers) it adds --allow-root and says so. tools/lab.py builds the command line.
lab: $(STAMP)
	$(BIN)/python tools/lab.py --port=$(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check llmlab kernels tests tools conftest.py

exercises: $(STAMP)
	$(BIN)/llmlab exercises build

doctor: $(STAMP)
	$(BIN)/llmlab doctor

# the self-study pages: every chapter executed, as HTML with its outputs, in site/ (open site/index.html)
site: $(STAMP)
	$(BIN)/llmlab site --out site

# every chapter built twice, quiet then beside 2 busy processes, into build/busy-check/; fails when the builds decide
# a claim differently (neither reading "inconclusive"), a page shows an InvariantWarning or a frozen progress bar,
# or a chapter fails or runs over 60 s quiet. Long, and it loads the machine: not part of `make test`.
busy-check: $(STAMP)
	$(BIN)/python tools/busy_check.py

# every exercise check N times each way on fresh random inputs (the reference passes, a planted mistake is named),
# tools/flake.py; prints runs and failures per check and chapter, fails on any. Not part of `make test`.
N ?= 300
flake: $(STAMP)
	$(BIN)/python tools/flake.py -n $(N)

# On a GPU node (PyTorch and Triton installed, maybe no network): doctor, the gpu tests, the benches and every chapter,
# each part time-boxed, 9 minutes in all (tools/gpu_suite.py). No .venv: the node's python3 and its torch.
# WHEELS=folder installs what the node lacks first (prepare it with `python3 tools/gpu_suite.py wheels FOLDER`).
gpu-suite:
	$(PYTHON) tools/gpu_suite.py $(if $(WHEELS),--wheels $(WHEELS))

# The same suite on this CPU, every GPU-only branch run with tiny sizes and CPU stand-ins (LLMLAB_GPU_SMOKE=2); CI.
gpu-suite-cpu: $(STAMP)
	$(BIN)/python tools/gpu_suite.py --smoke --budget 1500

clean:
	rm -rf $(VENV) build dist site *.egg-info
