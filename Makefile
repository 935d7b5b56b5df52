# wamkit: two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.wamkit-setup
APT_PKGS := libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0 libosmesa6 libglib2.0-0 ffmpeg
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export MESA_SHADER_CACHE_DIR ?= $(CURDIR)/.cache/mesa
export MPLCONFIGDIR ?= $(CURDIR)/.cache/mpl
export LP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: setup apt demo test test-fast bench clean

setup: $(STAMP)

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory apt
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	@[ -x $(BIN)/python ] || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[libero,metaworld,ray,dev]"
	$(BIN)/pip install -q --no-deps openpi-client==0.1.2  # tests: openpi's real client (its numpy<2 pin would downgrade numpy)
	@mkdir -p .cache/mesa .cache/mpl
	@touch $(STAMP)

demo: setup
	$(BIN)/python -m wamkit.cli.main demo out=runs/demo

test: setup
	$(BIN)/python -m pytest -q -rs tests

test-fast: setup
	$(BIN)/python -m pytest -q -rs -m "not slow" tests

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .cache runs
