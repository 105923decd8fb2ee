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
$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(VENV)/bin/streamrec setup all
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/streamrec demo

# Two pytest-xdist workers take whole files (longest first, tests/conftest.py), then the tests
# marked serial (the whole loop under broker kills, the installed demo, latency bounds) run
# alone. On more cores: make test TEST_WORKERS=4.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -v -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=30
	$(PY) -m pytest -v -m serial --durations=10

test-fast: setup
	$(PY) -m pytest -m "not slow"

# On a CUDA machine (2 GPUs for the NCCL cases): every test marked gpu. Not through `setup`:
# that pip-installs torch==2.13.0 from PyPI (PyPI's CUDA build, which the machine's driver
# may not run, over the CUDA torch the machine already has) and builds Kafka's and Flink's
# jars (Java, Maven), which no GPU test needs. Instead a virtualenv that sees the packages of
# $(PYTHON) (point PYTHON at the interpreter whose torch sees the GPUs; a .pth file, which
# also works where that interpreter is itself a virtualenv's) gets the runtime dependencies
# but torch, apache-flink and pandas (Flink's alone) and pytest; the tests import the
# checkout (`python -m pytest` from its root). PIP_FLAGS: e.g. `--no-index --find-links DIR`
# offline; PYTEST_ARGS: more pytest arguments.
GPU_VENV    ?= .venv-gpu
GPU_PY      := $(GPU_VENV)/bin/python
PIP_FLAGS   ?=
PYTEST_ARGS ?=
GPU_DEPS    := import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
               print(*(d.replace(" ", "") for d in deps if re.match(r"[A-Za-z0-9_.-]+", d)[0] not in {"torch", "apache-flink", "pandas"}))

test-gpu:
	@test -x $(GPU_PY) || { $(PYTHON) -m venv $(GPU_VENV) && $(PYTHON) -c 'import site; print(*site.getsitepackages(), sep="\n")' \
		> "$$($(GPU_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/over-$(notdir $(PYTHON)).pth"; }
	@$(GPU_PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "torch " + torch.__version__ + " of $(PYTHON) sees no GPU: make test-gpu PYTHON=<a python whose torch has CUDA>")'
	$(GPU_PY) -m pip install -q $(PIP_FLAGS) $$($(GPU_PY) -c '$(GPU_DEPS)') 'pytest>=8' 'pytest-timeout>=2.3'
	$(GPU_PY) -m pytest -v -m gpu $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/streamrec bench generator

clean:
	-$(VENV)/bin/streamrec kafka down 2>/dev/null
	rm -rf var/ .pytest_cache

distclean: clean
	rm -rf $(VENV) $(GPU_VENV) *.egg-info
