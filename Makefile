# The README's lane is the pip stack users install: `make test` and `make
# bench` create .venv from `python3` on PATH, install requirements/pip.txt
# (pinned exactly, with requirements/constraints.txt for what it pulls in) and
# build torchshm into it with --no-build-isolation.
# `make test-debian12` and `make test-debian13` run the suite on Debian's own
# torch, numpy and Python (the oldest and a middle stack), on the host when it
# is that release and in a cached chroot otherwise: scripts/debian_lane.sh.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Marks a .venv made by this Makefile for the pip stack (an older checkout's
# .venv was Debian's Python with system site packages: it is made anew).
MADE := $(VENV)/.pip-stack
STACK := $(VENV)/.pip-stack-installed
PEER_STACK := $(VENV)/.peers-installed
BUILT := $(VENV)/.torchshm-built
REQUIREMENTS := requirements/pip.txt requirements/tools.txt requirements/constraints.txt \
	requirements/installer.txt
# Compilers for the extension; util-linux for the unshare tests.
DEBS := g++ util-linux
LINT_DEBS := black flake8 clang-format
LANE_DEBS := debootstrap util-linux
# Sphinx and its Markdown parser and theme, from Debian (on Debian's Python).
DOC_DEBS := python3-sphinx python3-myst-parser python3-sphinx-rtd-theme
CSRC := $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.h)
SOURCES := setup.py pyproject.toml $(CSRC)
# This machine's pip configuration lists local package folders, one warning
# for each package they lack.
QUIET_PIP := { grep -v "is ignored: it is neither a file nor a directory" || true; }
# requirements/ pins every package exactly, so a constraint from the machine's
# pip configuration can only conflict (this one caps torch below the pin): the
# lane's installs set an empty constraint file in its place.
PIP = PIP_CONSTRAINT=/dev/null $(1) -m pip
# uv installs the pinned stacks into a venv (pip stays there, for the build
# and a user's own installs): for exact pins it takes the wheels pip would,
# fetched in parallel and hard-linked from its cache, so the newest lane's
# venv shares the pip lane's NVIDIA libraries. From a cold cache it fetched
# and unpacked the pip lane's stack (3 GB) in 29 s here, where pip took about
# 5 minutes (that before bytecode, below); uv reads no pip configuration, so
# the machines' cap on torch does not apply to it.
# --compile-bytecode, as pip does: these machines set PYTHONDONTWRITEBYTECODE,
# so a module not compiled at install is compiled again by every process that
# imports it (torch: seconds in each test's child).
INSTALLER := requirements/installer.txt
with_installer = $(call PIP,$(1)/bin/python) install -q -r $(INSTALLER) 2>&1 | $(QUIET_PIP)
UV_INSTALL = $(1)/bin/uv pip install -q --compile-bytecode -p $(1)/bin/python

.PHONY: deps build wheel test test-debian12 test-debian13 test-newest bench soak fuzz device \
	prepare-debian12 prepare-debian13 prepare-newest \
	docs figures notebooks lint format lock lock-newest clean

# Installs only the Debian packages that are missing.
apt_install = @scripts/apt_install.sh $(1)

deps:
	$(call apt_install,$(DEBS))

$(MADE): | deps
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	touch $@

$(STACK): $(REQUIREMENTS) | $(MADE)
	$(call with_installer,$(VENV))
	$(call UV_INSTALL,$(VENV)) -r requirements/pip.txt -c requirements/constraints.txt
	touch $@

# The peers `make bench` compares (Ray, Grain, tensordict): only for bench.
$(PEER_STACK): requirements/peers.txt requirements/constraints.txt | $(STACK)
	$(call UV_INSTALL,$(VENV)) -r requirements/peers.txt -c requirements/constraints.txt
	touch $@

$(BUILT): $(SOURCES) $(STACK)
	MAX_JOBS=$$(nproc) $(PY) -m pip install -q --no-build-isolation --no-deps \
		--no-index -e . 2>&1 | $(QUIET_PIP)
	touch $@

build: deps $(BUILT)

# A wheel of torchshm for one environment's torch, to install where there is
# no compiler: dist/torchshm-<version>+torch<X.Y>-<python>-<platform>.whl. The
# label names the torch it runs beside and its metadata requires that torch
# minor (setup.py, version() and requirements()): pip refuses it elsewhere.
# One wheel per torch minor version and Python (docs/guide/install.md).
# `make wheel PYTHON=/path/to/python`: for that interpreter's torch and numpy
# (installed there already; nothing is installed into it); otherwise for
# .venv's, the pip stack.
ifeq ($(origin PYTHON),command line)
WHEEL_PY := $(PYTHON)
wheel: deps
else
WHEEL_PY := $(PY)
wheel: build
endif
	@$(WHEEL_PY) -c "import torch, numpy" 2>/dev/null || { echo "make wheel:" \
		"$(WHEEL_PY) has no torch or numpy: install them there first" >&2; exit 1; }
	TORCHSHM_TORCH_LABEL=1 MAX_JOBS=$$(nproc) $(WHEEL_PY) -m pip wheel -q --no-build-isolation \
		--no-deps --no-index --wheel-dir dist . 2>&1 | $(QUIET_PIP)
	@$(WHEEL_PY) -c "import sys, torch; v = torch.__version__; print('make wheel: for torch', \
		v, 'and Python', sys.version.split()[0], '(' + sys.executable + '): it installs beside', \
		'torch==' + '.'.join(v.split('.')[:2]) + '.* only')"
	@ls dist/torchshm-*+torch*.whl

# Three pytest-xdist workers, each its own torchshm session: most tests wait
# on the children they start. On 2 cores, two workers kept 1.58 cores busy
# (855 s), three 1.70 (787 s); three passed beside two busy loops too.
TEST_WORKERS ?= 3

test: build
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-debian12 test-debian13: test-debian%:
	$(call apt_install,$(LANE_DEBS))
	scripts/debian_lane.sh $*

# A Debian lane's packages, on the host or in its cached root, without the
# suite (.ci/run prepares the later lanes beside the pip lane).
prepare-debian12 prepare-debian13: prepare-debian%:
	$(call apt_install,$(LANE_DEBS))
	scripts/debian_lane.sh $* prepare

# PEERS=0: no peers installed, and no peer columns (TORCHSHM_BENCH_PEERS).
PEERS ?= 1

bench: build $(if $(filter 0,$(PEERS)),,$(PEER_STACK))
	TORCHSHM_BENCH_PEERS=$(PEERS) $(PY) -m benchmarks $(BENCH_ARGS)

# The standing fault test (scripts/soak.py): senders, receivers and the
# session keeper under random SIGKILL and SIGSTOP, for SOAK_MINUTES minutes;
# fails on any message corrupted, duplicated or lost while a holder lived, any
# hang, or anything left behind. SOAK_ARGS adds options (--seed N).
SOAK_MINUTES ?= 1

soak: build
	$(PY) scripts/soak.py --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# The differential fuzzer (scripts/fuzz): random programs, each run with torchshm and with TORCHSHM_DISABLE=1, must observe the same bytes.
FUZZ_MINUTES ?= 1
fuzz: build
	$(PY) -m scripts.fuzz --minutes $(or $(MINUTES),$(FUZZ_MINUTES)) $(FUZZ_ARGS)

# On a GPU machine (the device): builds torchshm with that machine's Python
# and g++-12, runs the CUDA-only checks and the GPU scenario, and writes a
# table and JSON into OUT (scripts/device_check.py; under 8 minutes).
OUT ?= device-results
DEVICE_PYTHON ?= python3

device:
	$(DEVICE_PYTHON) scripts/device_check.py $(OUT)

# The docs site, docs/_build/html/index.html. Debian's Sphinx cannot import
# the torchshm built for .venv: scripts/api_dump.py writes the public names'
# docstrings for it (Note [API from JSON] in docs/_ext/torchshm_docs.py).
# Every warning is an error (a broken reference, a public name left out).
DOCS_BUILD := docs/_build

docs: build
	$(call apt_install,$(DOC_DEBS))
	$(PY) scripts/api_dump.py $(DOCS_BUILD)/api.json
	TORCHSHM_API_JSON=$(abspath $(DOCS_BUILD))/api.json /usr/bin/python3 -m sphinx \
		-E -W --keep-going -q -b html docs $(DOCS_BUILD)/html
	@echo "docs: $(DOCS_BUILD)/html/index.html"

# After a reference `make bench`: the docs' and README's figures from
# benchmarks/results/results.json, and the notebooks' stored outputs.
figures: build
	$(PY) scripts/docs_figures.py

notebooks: build
	$(PY) scripts/run_notebooks.py

# Pins what requirements/pip.txt pulls in, from a scratch venv.
lock: | deps
	$(call lock_stack,$(PYTHON),requirements/pip.txt requirements/peers.txt,requirements/pip.txt and peers.txt pull in,requirements/constraints.txt)

# $(call lock_stack,PYTHON,REQUIREMENT FILES,WHAT,OUTPUT): installs the files
# into a scratch venv of PYTHON and writes what they pull in, pinned, to
# OUTPUT, less the packages they (and requirements/tools.txt) name themselves.
define lock_stack
	rm -rf .venv-lock
	$(1) -m venv .venv-lock
	$(call with_installer,.venv-lock)
	$(call UV_INSTALL,.venv-lock) $(addprefix -r ,$(2))
	top=$$(cat $(2) requirements/tools.txt $(INSTALLER) \
		| grep -Eo '^[A-Za-z0-9_.][A-Za-z0-9_.-]*' | paste -sd'|'); \
	{ echo "# What $(3), pinned: written by \`make $@\`."; \
	  .venv-lock/bin/uv pip freeze -p .venv-lock/bin/python | grep -viE "^(pip|$$top)=="; \
	} >$(4)
	rm -rf .venv-lock
endef

# The newest lane: `make test-newest`, the stack a new project gets today
# (requirements/newest.txt: Python 3.13 from pyenv, NumPy 2.5, torch 2.15,
# pandas 3.1, pyarrow), pinned like the pip lane, in .venv-newest; torchshm
# built into it from this checkout (its extension file is Python 3.13's, beside
# the pip lane's).
NEWEST_PYTHON ?= $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13)))
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_REQUIREMENTS := requirements/newest.txt requirements/tools.txt \
	requirements/constraints-newest.txt requirements/installer.txt

$(NEWEST_VENV)/.stack-installed: $(NEWEST_REQUIREMENTS) | deps
	@test -x "$(NEWEST_PYTHON)" || { echo "test-newest: no Python 3.13 found;" \
		"give one: make test-newest NEWEST_PYTHON=/path/to/python3.13" >&2; exit 1; }
	rm -rf $(NEWEST_VENV)
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(call with_installer,$(NEWEST_VENV))
	$(call UV_INSTALL,$(NEWEST_VENV)) -r requirements/newest.txt \
		-c requirements/constraints-newest.txt
	touch $@

$(NEWEST_VENV)/.torchshm-built: $(SOURCES) $(NEWEST_VENV)/.stack-installed
	MAX_JOBS=$$(nproc) $(NEWEST_PY) -m pip install -q --no-build-isolation --no-deps \
		--no-index -e . 2>&1 | $(QUIET_PIP)
	touch $@

# --lane newest: what Python, NumPy and pandas can change (Note [What each
# lane runs] in tests/conftest.py); the rest runs on the pip lane's torch.
prepare-newest: $(NEWEST_VENV)/.stack-installed

test-newest: $(NEWEST_VENV)/.torchshm-built
	$(NEWEST_PY) -m pytest -q -n $(TEST_WORKERS) --lane newest

# Pins what requirements/newest.txt pulls in, from a scratch venv of NEWEST_PYTHON.
lock-newest: | deps
	$(call lock_stack,$(NEWEST_PYTHON),requirements/newest.txt,requirements/newest.txt pulls in,requirements/constraints-newest.txt)

lint:
	$(call apt_install,$(LINT_DEBS))
	black --check --quiet torchshm tests benchmarks scripts setup.py docs
	flake8 torchshm tests benchmarks scripts setup.py docs
	bash -n scripts/debian_lane.sh
	bash -n scripts/apt_install.sh
	bash -n scripts/torch_suites.sh
	bash -n scripts/numpy_suite.sh
	clang-format --dry-run -Werror $(CSRC)

format:
	black -q torchshm tests benchmarks scripts setup.py docs
	clang-format -i $(CSRC)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build dist *.egg-info torchshm/_C*.so torchshm/_build_info.json \
		$(DOCS_BUILD)
