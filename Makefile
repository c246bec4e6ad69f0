# Entry points for people and CI. `make test` is what .ci/run runs.
BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
FORMAT_DIRS := csrc plugins tests benchmarks examples

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

demo: setup
	$(MAKE) build
	BUILD_DIR=$(abspath $(BUILD_DIR)) benchmarks/run transfer --quick

bench: setup
	$(MAKE) build
	BUILD_DIR=$(abspath $(BUILD_DIR)) benchmarks/run transfer

format:
	find $(FORMAT_DIRS) -type f \( -name '*.h' -o -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
	  -o -name '*.cu' -o -name '*.cuh' \) -print0 2>/dev/null | xargs -0 -r clang-format -i

clean:
	rm -rf $(BUILD_DIR)
