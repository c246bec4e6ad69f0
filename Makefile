# Entry points for people and CI. `make test` is what .ci/run runs.
BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
# Flags for the store demo, e.g. `make demo DEMO_FLAGS=--quick`.
DEMO_FLAGS ?=
FORMAT_DIRS := csrc kernels plugins tests benchmarks examples

.PHONY: all setup configure build test demo bench format clean

all: build

setup:
	scripts/setup.sh

$(BUILD_DIR)/build.ninja:
	cmake -G Ninja -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: $(BUILD_DIR)/build.ninja

build: configure
	ninja -C $(BUILD_DIR) -j$(JOBS)

test: setup
	$(MAKE) build
	ctest --test-dir $(BUILD_DIR) --output-on-failure

# The store demo: a local cluster (master + 3 nodes as processes) under a HiCache-like load,
# one node killed halfway; prints a table, writes bench-out/store-demo-timeline.csv and (with
# the plotting venv) bench-out/store-demo.png. Fails if any operation failed or the replicas
# were not restored. A venv that cannot be made only costs the PNG.
demo: setup
	$(MAKE) build
	scripts/setup_venv.sh || echo "demo: no plotting venv (see above); the PNG will be skipped"
	$(BUILD_DIR)/benchmarks/kvb_store_demo --bin $(abspath $(BUILD_DIR))/bin --out bench-out \
	  --python .venv/bin/python $(DEMO_FLAGS)

bench: setup
	$(MAKE) build
	BUILD_DIR=$(abspath $(BUILD_DIR)) benchmarks/run transfer
	BUILD_DIR=$(abspath $(BUILD_DIR)) benchmarks/run store

format:
	find $(FORMAT_DIRS) -type f \( -name '*.h' -o -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
	  -o -name '*.cu' -o -name '*.cuh' \) -print0 2>/dev/null | xargs -0 -r clang-format -i

clean:
	rm -rf $(BUILD_DIR)
