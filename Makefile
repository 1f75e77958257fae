# Quick start:  make demo   (set up, build, run the parity/speed demo)
#               make test   (set up, build, run every C++ and Python test)
PYTHON ?= python3
BUILD_DIR ?= build
export TORCHMHA_BUILD_DIR := $(abspath $(BUILD_DIR))

.PHONY: deps build demo test test-cpp test-python bench clean

deps:
	PYTHON=$(PYTHON) bash scripts/install_deps.sh

# One CMake tree (build/) for the extension, the C++ library and the GoogleTest binaries.
build: deps
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	cmake --build $(BUILD_DIR) -j $$(nproc)

demo: build
	$(PYTHON) examples/demo.py

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure

test-python: build
	$(PYTHON) -m pytest tests/python

test: test-cpp test-python

bench: build
	$(PYTHON) benchmarks/run.py --quick

clean:
	rm -rf $(BUILD_DIR) python/torchmha/*.so
