# One command to set up and run the main job, one to run the tests.
#   make demo   - build .venv, train the digits CNN with all four callbacks (configs/digits.yaml)
#   make test   - build .venv, run the test suite
#   make bench  - build .venv, measure the callbacks' overhead in wall time (about 20 minutes)
#   make bench-instructions - the same in instruction counts under valgrind (25-50 minutes, the workloads side by side)
#   make bench-logging-step - what one logging step of GradStats + ActivationStats costs on a 24-layer encoder (minutes)
#   make screenshot - regenerate the README's TensorBoard pictures in docs/ (needs Debian's chromium)
#   make docs   - build .venv, build the documentation site into site/ with `mkdocs build --strict` (offline)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is all the demo and the tests need; install it before anything asks for torch.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint docs bench bench-instructions bench-logging-step tensorboard screenshot clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,examples,docs]"
	touch $@

demo: setup
	$(VENV)/bin/lightning-hooks fit --config configs/digits.yaml

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: setup
	$(PY) benchmarks/overhead.py --frequencies 10 50

bench-instructions: setup
	$(PY) benchmarks/overhead.py --instructions 10 --workloads digits-cnn resnet

bench-logging-step: setup
	$(PY) benchmarks/logging_step.py --repeats 3 --steps 40 --floor

tensorboard: setup
	$(VENV)/bin/tensorboard --logdir lightning_logs --host 127.0.0.1

screenshot: setup
	$(PY) -m docs.screenshot

clean:
	rm -rf $(VENV) lightning_logs site *.egg-info
