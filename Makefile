# Quick start:  make demo   (set up, build, run the parity/speed demo)
#               make test   (set up, build, run every C++ and Python test)
PYTHON ?= python3
BUILD_DIR ?= build
export TORCHMHA_BUILD_DIR := $(abspath $(BUILD_DIR))

.PHONY: deps build demo test test-cpp test-python test-package test-distributed test-sanitizers test-fuzz bench clean

deps:
	PYTHON=$(PYTHON) bash scripts/install_deps.sh

# One CMake tree (build/) for the extension, the C++ library and the GoogleTest binaries.
build: deps
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	cmake --build $(BUILD_DIR) -j $$(nproc)

demo: build
	$(PYTHON) examples/demo.py

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure --no-tests=error

# The C++ package as a user gets it: install it under build/install, build examples/cpp against
# that prefix (a project outside this tree), run it. Its checkpoint is checked from Python by
# tests/python/test_checkpoints_cpp.py, which finds the binary through TORCHMHA_CPP_EXAMPLE.
INSTALL_PREFIX := $(abspath $(BUILD_DIR))/install
EXAMPLE_BUILD_DIR := $(abspath $(BUILD_DIR))/example
export TORCHMHA_CPP_EXAMPLE := $(EXAMPLE_BUILD_DIR)/reverse_sequence

test-package: build
	cmake --install $(BUILD_DIR) --prefix $(INSTALL_PREFIX)
	cmake -S examples/cpp -B $(EXAMPLE_BUILD_DIR) \
	  -DCMAKE_PREFIX_PATH="$(INSTALL_PREFIX);$$($(PYTHON) -c 'import torch;print(torch.utils.cmake_prefix_path)')"
	cmake --build $(EXAMPLE_BUILD_DIR) -j $$(nproc)
	cd $(EXAMPLE_BUILD_DIR) && ./reverse_sequence

test-python: build test-package
	$(PYTHON) -m pytest tests/python

# Only the two-process DDP/FSDP tests (also part of test-python).
test-distributed: build
	$(PYTHON) -m pytest tests/python/test_distributed.py

# The C++ library and GoogleTest suite under ASan+UBSan+LSan and under TSan (build-asan/, build-tsan/).
test-sanitizers: deps
	PYTHON=$(PYTHON) bash scripts/run_sanitizers.sh

# libFuzzer on the C++ entry points for FUZZ_SECONDS (default 60), clang + ASan (build-fuzz/).
FUZZ_SECONDS ?= 60
test-fuzz: deps
	PYTHON=$(PYTHON) FUZZ_SECONDS=$(FUZZ_SECONDS) bash scripts/run_fuzzer.sh

test: test-cpp test-package test-python test-sanitizers test-fuzz

bench: build
	$(PYTHON) benchmarks/run.py --quick
	$(PYTHON) benchmarks/bench_decoding.py --quick --threads 1

clean:
	rm -rf $(BUILD_DIR) build-asan build-tsan build-fuzz python/torchmha/*.so
