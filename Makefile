# steptrace developer targets. Everything runs from a local virtualenv (.venv), created
# and installed on first use; changing pyproject.toml reinstalls.
#
#   make demo        the JAX demo: naive timing vs steptrace, then the steptrace report
#   make test        lint, then pytest (extra arguments: make test PYTEST_ARGS='-k report -x')
#   make test-stress the same suite with STRESS_LOOPS (2) busy processes beside it, stopped afterwards:
#                    timing tests must hold on a busy CI machine (docs/testing.md)
#   make lint        ruff on everything, mypy on the core (part of make test)
#   make bench       every bench/bench_*.py, then bench/collector_scale.py and bench/scale.py --quick
#   make clean       run directories, caches, build outputs
#   make distclean   clean + the virtualenv
#   make maxtext-env the Python 3.12 env (.venv-maxtext) the MaxText hook tests run in
#   make axlearn-env the Python 3.11 env (.venv-axlearn, ~1.8 GB) the AXLearn hook tests run in
#   make torchtitan-env  torchtitan 0.3.0 and its pinned dependencies in .venv (--no-deps), for its hook tests
#
# PYTHON picks the interpreter the virtualenv is made from (3.11 or newer).

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
EXTRAS ?= demo,torch,test
# DeepSpeed (in the test extra) installs as a pure-Python wheel: no op is compiled at install time
# (it compiles the one it uses, with g++ and ninja, on first use).
export DS_BUILD_OPS ?= 0
PYTEST_ARGS ?=
STRESS_LOOPS ?= 2
DEMO_ARGS ?=

VENV_PYTHON := $(VENV)/bin/python
# The install stamp carries a hash of pyproject.toml, so editing it (new extras, new
# dependencies) triggers a reinstall and an unchanged one installs only once.
PYPROJECT_HASH := $(shell $(PYTHON) -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:16])" 2>/dev/null || cksum < pyproject.toml | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(PYPROJECT_HASH)

.PHONY: demo test test-stress lint bench install clean distclean help maxtext-env axlearn-env torchtitan-env
.DEFAULT_GOAL := help

help:
	@sed -n '1,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed -n 's/^# \{0,1\}//p'

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

$(STAMP): | $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install "torch==$(TORCH_VERSION)" -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-*
	touch $@ $(HOTPATH_STAMP)

# The optional C extension (steptrace/_hotpath.c, the per-step calls) is built by the install above;
# editing it rebuilds it here. Where it cannot be built the same calls run in Python.
HOTPATH_STAMP := $(VENV)/.hotpath-built
$(HOTPATH_STAMP): steptrace/_hotpath.c setup.py | $(STAMP)
	$(VENV_PYTHON) -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP) $(HOTPATH_STAMP)

demo: $(STAMP) $(HOTPATH_STAMP)
	$(VENV_PYTHON) examples/train_jax.py $(DEMO_ARGS)

lint: $(STAMP) $(HOTPATH_STAMP)
	$(VENV_PYTHON) -m ruff check .
	$(VENV_PYTHON) -m mypy

test: $(STAMP) $(HOTPATH_STAMP) maxtext-env axlearn-env torchtitan-env lint
	@$(VENV_PYTHON) -c "import steptrace._handles as h; print('steptrace: the per-step calls run', 'compiled (steptrace/_hotpath.c)' if h._hotpath else 'in Python (the C extension is not built here)')"
	$(VENV_PYTHON) -m pytest $(PYTEST_ARGS)

# The busy loops are started here and stopped by their own pids when pytest ends (or fails, or is
# interrupted); the suite's exit status is make's.
test-stress: $(STAMP) $(HOTPATH_STAMP) maxtext-env axlearn-env torchtitan-env lint
	@pids=""; trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	for i in $$(seq $(STRESS_LOOPS)); do $(PYTHON) -c 'while 1: pass' & pids="$$pids $$!"; done; \
	echo "steptrace: $(STRESS_LOOPS) busy loops beside the suite (pids$$pids)"; \
	SUITE_BUSY_LOOPS=$(STRESS_LOOPS) $(VENV_PYTHON) -m pytest $(PYTEST_ARGS)

bench: $(STAMP) $(HOTPATH_STAMP)
	@set -e; found=0; \
	for script in bench/bench_*.py; do \
		[ -f "$$script" ] || continue; \
		found=1; \
		echo "== $$script"; \
		$(VENV_PYTHON) "$$script"; \
	done; \
	if [ "$$found" = 0 ]; then echo "no bench/bench_*.py scripts yet"; fi; \
	if [ -f bench/collector_scale.py ]; then echo "== bench/collector_scale.py"; $(VENV_PYTHON) bench/collector_scale.py; fi; \
	echo "== bench/scale.py --quick"; $(VENV_PYTHON) bench/scale.py --quick

clean:
	rm -rf steptrace-runs build dist .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(MAXTEXT_VENV) $(AXLEARN_VENV)

# --- MaxText (tests/test_maxtext.py) --------------------------------------------------
# maxtext needs Python >= 3.12 and keeps its dependencies in extras (maxtext[tpu] is ~2.8 GB
# with libtpu), so the MaxText tests run MaxText in its own venv, installed from the pinned
# CPU set in requirements-maxtext.txt with --no-deps, plus steptrace itself (-e .).
# PYTHON312: a working python3.12 on PATH, else pyenv's 3.12.x. The stamp carries a hash of
# requirements-maxtext.txt and pyproject.toml.
PYTHON312 ?= $(shell for c in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$c; break; }; done)
MAXTEXT_VENV ?= .venv-maxtext
# (_hotpath.c too: the env builds its own copy of the C extension, for its Python 3.12, into the source tree.)
MAXTEXT_HASH := $(shell cat requirements-maxtext.txt pyproject.toml steptrace/_hotpath.c 2>/dev/null | cksum | cut -d' ' -f1)
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed-$(MAXTEXT_HASH)

# Without a Python 3.12 the env is not built and the MaxText tests skip, saying why; an
# install that fails with 3.12 present fails the target.
$(MAXTEXT_STAMP):
	@set -e; \
	if [ -z "$(PYTHON312)" ]; then \
		echo "maxtext-env: WARNING: no Python 3.12 found (set PYTHON312=...); the MaxText tests will skip"; \
		exit 0; \
	fi; \
	rm -rf $(MAXTEXT_VENV); \
	echo "maxtext-env: building $(MAXTEXT_VENV) with $(PYTHON312)"; \
	$(PYTHON312) -m venv $(MAXTEXT_VENV); \
	$(MAXTEXT_VENV)/bin/python -m pip install -q --no-deps -r requirements-maxtext.txt; \
	$(MAXTEXT_VENV)/bin/python -m pip install -q --no-deps -e .; \
	touch $@

maxtext-env: $(MAXTEXT_STAMP)

# --- AXLearn (tests/test_axlearn.py) --------------------------------------------------
# The newest axlearn on PyPI pins jax 0.4.21 and tensorflow 2.14 (no Python 3.12 wheels), so the
# AXLearn tests run it in its own Python 3.11 venv, installed from the pinned CPU set in
# requirements-axlearn.txt with --no-deps, plus steptrace itself (-e .). ~1.8 GB (tensorflow-cpu
# is ~0.9 GB), about 2.5 minutes; `make test` builds it like the MaxText env, so CI runs the AXLearn
# tests against the real SpmdTrainer (they skip, naming this target, where no Python 3.11 exists).
# PYTHON311: a working python3.11 on PATH, else pyenv's 3.11.x.
PYTHON311 ?= $(shell for c in python3.11 $(HOME)/.pyenv/versions/3.11*/bin/python3.11; do $$c -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null && { command -v $$c; break; }; done)
AXLEARN_VENV ?= .venv-axlearn
AXLEARN_HASH := $(shell cat requirements-axlearn.txt pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)
AXLEARN_STAMP := $(AXLEARN_VENV)/.installed-$(AXLEARN_HASH)

$(AXLEARN_STAMP):
	@set -e; \
	if [ -z "$(PYTHON311)" ]; then \
		echo "axlearn-env: WARNING: no Python 3.11 found (set PYTHON311=...); the AXLearn tests will skip"; \
		exit 0; \
	fi; \
	rm -rf $(AXLEARN_VENV); \
	echo "axlearn-env: building $(AXLEARN_VENV) with $(PYTHON311)"; \
	$(PYTHON311) -m venv $(AXLEARN_VENV); \
	$(AXLEARN_VENV)/bin/python -m pip install -q --no-deps -r requirements-axlearn.txt; \
	$(AXLEARN_VENV)/bin/python -m pip install -q --no-deps -e .; \
	touch $@

axlearn-env: $(AXLEARN_STAMP)

# --- torchtitan (tests/test_torchtitan.py) ---------------------------------------------
# torchtitan's own requirements do not name torch, but its dependencies may pull another torch, so
# the pinned set in requirements-torchtitan.txt goes into the main venv with --no-deps (torch stays
# $(TORCH_VERSION)). The stamp carries the file's hash; editing it reinstalls.
TORCHTITAN_HASH := $(shell cat requirements-torchtitan.txt 2>/dev/null | cksum | cut -d' ' -f1)
TORCHTITAN_STAMP := $(VENV)/.torchtitan-$(TORCHTITAN_HASH)

$(TORCHTITAN_STAMP): requirements-torchtitan.txt | $(STAMP)
	$(VENV_PYTHON) -m pip install -q --no-deps -r requirements-torchtitan.txt
	rm -f $(VENV)/.torchtitan-*
	touch $@

torchtitan-env: $(TORCHTITAN_STAMP)
