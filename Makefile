# Quick start:  make demo   (set up what the demo needs, build the extension, run the parity/speed demo)
#               make test   (set up, build, run every C++ and Python test: what CI runs)
# Inner loop:   make check  (incremental build, ctest, pytest without the sanitizer, fuzz and
#                            package stages; a few minutes warm)
PYTHON ?= python3
NPROC := $(shell nproc)
# For CMakePresets.json: where torch's CMake package is, and the interpreter to build for. Read
# once per make; targets that install torch first (demo, test) run the rest in a sub-make.
export TORCH_CMAKE_PREFIX_PATH := $(shell $(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
export TORCHMHA_PYTHON := $(shell command -v $(PYTHON))
export TORCHMHA_BUILD_DIR := $(abspath build)

# Whether `import torchmha` finds this tree's package (an editable install of another clone would not do).
export INSTALLED_HERE := import pathlib, torchmha; assert pathlib.Path(torchmha.__file__).resolve().parents[1] == pathlib.Path("python").resolve()

.PHONY: deps build build-python package-here demo run-demo check test test-cpp test-python test-package test-wheel test-torch test-distributed test-sanitizers test-fuzz bench clean

# Once per machine (make demo and make test run it): torch, the test packages, CMake, GoogleTest, clang.
deps:
	PYTHON=$(PYTHON) bash scripts/install_deps.sh

# Incremental. The first build configures build/ (preset "default", with the GoogleTest suite and the
# C++ benchmark) and installs the package in editable mode; later ones rebuild what changed and put _C
# and libtorchmha beside the sources.
build:
	@grep -qs "TORCHMHA_BUILD_TESTS:BOOL=ON" build/CMakeCache.txt || \
	  cmake --preset default -DTORCHMHA_BUILD_TESTS=ON -DTORCHMHA_BUILD_BENCHMARKS=ON
	cmake --build --preset default -j $(NPROC)
	@$(MAKE) --no-print-directory package-here

# The demo's build: the library and the Python extension only.
build-python:
	@test -f build/CMakeCache.txt || { mkdir -p build && \
	  cmake --preset default -DTORCHMHA_BUILD_TESTS=OFF -DTORCHMHA_BUILD_BENCHMARKS=OFF > build/configure.log \
	  || { cat build/configure.log; exit 1; }; }
	cmake --build --preset default --target _C -j $(NPROC)
	@$(MAKE) --no-print-directory package-here

# This tree's package importable: an editable install once, then the built binaries beside the sources.
package-here:
	@$(PYTHON) -c "$$INSTALLED_HERE" 2>/dev/null || $(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	@for lib in build/_C*.so build/libtorchmha.so build/_build_info.py; do \
	  cmp -s $$lib python/torchmha/$$(basename $$lib) || { rm -f python/torchmha/$$(basename $$lib); cp $$lib python/torchmha/; }; \
	done

# Only what the demo runs: torch, matplotlib and a compiler (no test packages, GoogleTest or clang).
demo:
	PYTHON=$(PYTHON) bash scripts/install_deps.sh --demo
	$(MAKE) --no-print-directory run-demo

run-demo: build-python
	$(PYTHON) examples/demo.py

test-cpp: build
	ctest --preset default

# The C++ package as a user gets it: install it under build/install, build examples/cpp against
# that prefix (a project outside this tree), run it. Its checkpoint is checked from Python by
# tests/python/test_serialization.py, which finds the binary through TORCHMHA_CPP_EXAMPLE.
# examples/deploy is built the same way, and run by tests/python/test_deploy.py on the models
# examples/deploy/export_model.py writes (TORCHMHA_DEPLOY_EXAMPLE); it is linked with --as-needed,
# Ubuntu's default, to check that TorchMHA::torchmha still loads libtorchmha, and beside it is
# deploy_without_torchmha, the same program not linked against torchmha.
INSTALL_PREFIX := $(abspath build)/install
EXAMPLE_BUILD_DIR := $(abspath build)/example
export TORCHMHA_CPP_EXAMPLE := $(EXAMPLE_BUILD_DIR)/reverse_sequence
DEPLOY_BUILD_DIR := $(abspath build)/deploy
export TORCHMHA_DEPLOY_EXAMPLE := $(DEPLOY_BUILD_DIR)/deploy

test-package: build
	cmake --install build --prefix $(INSTALL_PREFIX)
	cmake -S examples/cpp -B $(EXAMPLE_BUILD_DIR) -DCMAKE_PREFIX_PATH="$(INSTALL_PREFIX);$(TORCH_CMAKE_PREFIX_PATH)"
	cmake --build $(EXAMPLE_BUILD_DIR) -j $(NPROC)
	cd $(EXAMPLE_BUILD_DIR) && ./reverse_sequence
	cmake -S examples/deploy -B $(DEPLOY_BUILD_DIR) -DCMAKE_PREFIX_PATH="$(INSTALL_PREFIX);$(TORCH_CMAKE_PREFIX_PATH)" \
	  -DDEPLOY_WITHOUT_TORCHMHA=ON -DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed
	cmake --build $(DEPLOY_BUILD_DIR) -j $(NPROC)

test-python: build test-package
	$(PYTHON) -m pytest tests/python

# The inner loop: a smaller hypothesis budget, no distributed processes, no package install.
check: build
	ctest --preset default
	TORCHMHA_HYPOTHESIS=dev $(PYTHON) -m pytest tests/python -q -x -m "not slow"

# Only the multi-process DDP/FSDP tests (also part of test-python).
test-distributed: build
	$(PYTHON) -m pytest tests/python/test_distributed.py

# The C++ library and GoogleTest suite under ASan+UBSan+LSan and under TSan (build-asan/, build-tsan/).
test-sanitizers:
	PYTHON=$(PYTHON) bash scripts/run_sanitizers.sh

# The package as a user gets it: the wheel and the sdist built without build isolation, each installed
# in a fresh virtual environment and tested there, plus its pin, binaries, contents and types.
test-wheel:
	PYTHON=$(PYTHON) bash scripts/test_package.sh

# libFuzzer on the C++ entry points for FUZZ_SECONDS (default 60), clang + ASan (build-fuzz/).
FUZZ_SECONDS ?= 60
test-fuzz:
	PYTHON=$(PYTHON) FUZZ_SECONDS=$(FUZZ_SECONDS) bash scripts/run_fuzzer.sh

# torch as most users have it: TORCH_CHECK's default (CUDA) wheel in a virtual environment of its own,
# torchmha built there without a CUDA toolkit (the machine's is hidden), then the quick suite.
# The project machines' pip takes torch 2.14.1 from their disk; any release: scripts/check_torch.sh.
TORCH_CHECK ?= 2.14.1
test-torch:
	PYTHON=$(PYTHON) bash scripts/check_torch.sh $(TORCH_CHECK) none

# Every stage, with a table at the end of what ran, what failed, what was not run, and the time each took.
TEST_STAGES := test-cpp test-package test-python test-wheel test-torch test-sanitizers test-fuzz
test: deps
	MAKE="$(MAKE)" bash scripts/run_stages.sh $(TEST_STAGES)

bench: build
	$(PYTHON) -m pip install -q -r benchmarks/requirements.txt
	$(PYTHON) benchmarks/run.py --quick
	$(PYTHON) benchmarks/bench_decoding.py --quick --threads 1

clean:
	rm -rf build build-asan build-tsan build-fuzz python/torchmha/*.so
