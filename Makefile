# The two README commands: `make demo` (main job, embedded defaults) and `make test`.
# Both create/refresh the virtualenv first; nothing else needs to be installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.streamrec-installed

.PHONY: setup demo test test-fast test-gpu bench clean distclean

# torch first, pinned (PyPI's build is the CUDA one, several GB): pip's cache keeps the wheel,
# so a second virtualenv on this machine does not download it again. `setup all` resolves
# Apache Kafka's jars and builds the Flink job with Maven, into the user cache.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(VENV)/bin/streamrec setup all
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/streamrec demo

test: setup
	$(PY) -m pytest -v --durations=15

test-fast: setup
	$(PY) -m pytest -m "not slow"

# On a CUDA machine (2 GPUs for the NCCL cases): every test marked gpu.
test-gpu: setup
	$(PY) -m pytest -v -m gpu

bench: setup
	$(VENV)/bin/streamrec bench generator

clean:
	-$(VENV)/bin/streamrec kafka down 2>/dev/null
	rm -rf var/ bench/out/ .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info
