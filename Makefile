# Two commands do everything on a fresh machine (Python 3.11+ with venv):
#   make demo   set up, fetch the sample model and video, run the pipeline on them
#   make test   set up, fetch the samples, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/file.yaml

.PHONY: demo test setup setup-test samples lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# What the pipeline needs to run (the demo runs on the CPU: no GPU or TensorRT packages).
setup: $(BIN)/python
	$(BIN)/python -m pip install -q -e .

# The tests also build TensorRT engines on the CPU with TensorRT-RTX (about 258 MB), and
# test tracking, analytics, MQTT, the live view and the Ray cluster mode (their extras).
setup-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[dev,tensorrt,analytics,live,ray]"

samples: setup
	$(BIN)/python -m samples.fetch

demo: samples
	$(BIN)/python run.py --config $(CONFIG)

# Two test files at a time (pytest-xdist; a file's tests stay together, so its module
# fixtures run once): on 2 cores the suite took 683-693 s so, 1,066 s one at a time. The
# slowest tests are listed at the end (CI must stay under 15 minutes).
TEST_WORKERS ?= 2
test: setup-test samples
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

lint: setup-test
	$(BIN)/ruff check .
