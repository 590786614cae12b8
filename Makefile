# On a fresh Debian 12 machine as root, `make test` and `make bench` install
# what they need from Debian, create .venv and build torchshm into it.
# `make test-modern` runs the suite again on Debian 13 (torch 2.x, numpy 2.x,
# Python 3.13) in a cached chroot: see scripts/modern_lane.sh.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BUILT := $(VENV)/.torchshm-built
DEBS := python3-torch libtorch-dev python3-dev python3-numpy python3-pybind11 \
	python3-venv python3-pip python3-setuptools python3-wheel g++ ninja-build \
	python3-pandas python3-xarray python3-pytest python3-pytest-timeout \
	python3-hypothesis python3-psutil python3-tqdm python3-matplotlib \
	python3-nbclient python3-nbformat python3-ipykernel python3-portalocker \
	python3-build python3-pytest-xdist
LINT_DEBS := black flake8 clang-format
# The Debian 13 lane's host side; its own packages are listed in the script.
MODERN_DEBS := debootstrap util-linux
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: deps build test test-modern bench lint format clean

# Installs only the Debian packages that are missing.
define apt_install
	@missing=$$(for p in $(1); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

deps:
	$(call apt_install,$(DEBS))

$(PY): | deps
	/usr/bin/python3 -m venv --system-site-packages $(VENV)

$(BUILT): $(SOURCES) | $(PY)
	MAX_JOBS=$$(nproc) $(PY) -m pip install -q --no-build-isolation --no-deps --no-index -e .
	touch $@

build: deps $(BUILT)

# Two pytest-xdist workers, each its own torchshm session: most tests wait on
# the children they start, so a single worker keeps only ~1.3 of 2 cores busy.
TEST_WORKERS ?= 2

test: build
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-modern:
	$(call apt_install,$(MODERN_DEBS))
	scripts/modern_lane.sh

bench: build
	$(PY) -m benchmarks $(BENCH_ARGS)

lint: deps
	$(call apt_install,$(LINT_DEBS))
	black --check --quiet torchshm tests benchmarks scripts setup.py
	flake8 torchshm tests benchmarks scripts setup.py
	bash -n scripts/modern_lane.sh
	clang-format --dry-run -Werror csrc/*.cpp csrc/*.h

format:
	black -q torchshm tests benchmarks scripts setup.py
	clang-format -i csrc/*.cpp csrc/*.h

clean:
	rm -rf $(VENV) build dist *.egg-info torchshm/_C*.so torchshm/_build_info.json
