# wamkit: two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.wamkit-setup
APT_PKGS := libegl1 libegl-mesa0 libgl1-mesa-dri libopengl0 libosmesa6 libglib2.0-0 ffmpeg chromium
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export MESA_SHADER_CACHE_DIR ?= $(CURDIR)/.cache/mesa
export MPLCONFIGDIR ?= $(CURDIR)/.cache/mpl
export LP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

# SGLang's real action router for the compatibility tests (tests/test_sglang_compat.py): the sglang wheel and the
# pure-Python modules its package imports, without its GPU stack, in a side venv layered over .venv (built once).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.wamkit-sglang
SGLANG_PKGS := sglang==0.5.23 fastapi==0.165.0 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 \
  psutil==7.2.2 einops==0.8.2 dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1 gguf==0.19.0 \
  diffusers==0.42.1 addict==2.4.0 imageio-ffmpeg==0.8.1 cache-dit==1.5.3 openai==3.57.0 partial-json-parser==0.2.1.1.post7 \
  loguru==0.7.3 sniffio==1.3.1

# Triton for its CPU interpreter (TRITON_INTERPRET=1), in a folder of its own that only the kernel tests put on
# their path (tests/test_master_adamw.py runs the GPU kernels' code there): the CPU torch wheel ships no Triton.
TRITON_SITE := .cache/triton-site
TRITON_STAMP := $(TRITON_SITE)/.wamkit-triton
TRITON_PKG := triton==3.6.0

.PHONY: setup sglang-env triton-interp apt demo test test-fast bench clean

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

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP) Makefile
	@[ -x $(SGLANG_VENV)/bin/python ] || $(PY) -m venv $(SGLANG_VENV)
	@echo "import site; site.addsitedir('$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')')" \
	  > "$$($(SGLANG_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/wamkit-venv.pth"
	$(SGLANG_VENV)/bin/pip install -q --no-deps $(SGLANG_PKGS)
	@touch $(SGLANG_STAMP)

triton-interp: $(TRITON_STAMP)

$(TRITON_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(TRITON_SITE) $(TRITON_PKG)
	@touch $(TRITON_STAMP)

demo: setup
	$(BIN)/python -m wamkit.cli.main demo out=runs/demo

# the suite in TEST_WORKERS processes (pytest-xdist), each test file whole on one of them (its module fixtures start
# once): on the 2-core machine 43 min in one process, 27.5 in two (session 34; its tests wait on servers and
# subprocesses about half of the time); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: setup sglang-env triton-interp
	$(BIN)/python -m pytest -q -rs --durations=25 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

test-fast: setup sglang-env triton-interp
	$(BIN)/python -m pytest -q -rs -m "not slow" tests

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache runs
