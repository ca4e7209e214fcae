# kvferry — top-level driver.
#
#   make demo    install what is missing, build, run a local PD deployment
#   make test    install what is missing, build (also with address+undefined
#                sanitizers, the thread sanitizer and libFuzzer), run the
#                whole suite
#   make build   configure and build into build/ (the command is build/kvferry)
#   make bench   run bench/baselines.sh (kvferry against iperf3/memcpy/UCX)

BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
TSAN_BUILD ?= build-tsan
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CTEST_ARGS ?= --output-on-failure -j2

# Debian packages the build, the tests and the benchmarks need.
DEB_PACKAGES = cmake make gcc clang libclang-rt-14-dev pkg-config \
               libmicrohttpd-dev libcurl4-openssl-dev libjansson-dev \
               libxxhash-dev libssl-dev python3 python3-numpy iperf3 sockperf iproute2 procps libucx-dev \
               ucx-utils gnuplot-nox

.PHONY: all deps build asan tsan fuzz test test-release test-asan test-tsan test-fuzz \
        demo bench clean

all: build

deps:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "kvferry needs these Debian packages:$$missing"; \
	    echo "run as root, or: sudo apt-get install$$missing"; exit 1; \
	  fi; \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

asan: deps
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVF_SANITIZE=ON
	cmake --build $(ASAN_BUILD) -j$(JOBS)

# The thread sanitizer build is without UCX: libucm (UCX's memory hooks, not
# instrumented) intercepts the madvise() glibc makes as a thread exits,
# after TSan has torn the thread down, and the process dies of SIGSEGV in
# __tsan::MutexPreReadLock.  With those hooks off (UCX_MEM_EVENTS=no) a
# TSan build with UCX ran the whole suite, test_ucx included, with no
# report; that is a one-off check, not part of `make test`.
tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKVF_TSAN=ON -DKVF_UCX=OFF
	cmake --build $(TSAN_BUILD) -j$(JOBS)

fuzz: deps
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
	      -DKVF_FUZZ=ON -DKVF_SANITIZE=ON
	cmake --build $(FUZZ_BUILD) -j$(JOBS) --target fuzz_wire fuzz_registry fuzz_descriptor

test-release: build
	CTEST_ARGS="$(CTEST_ARGS)" bash tests/suite.sh release=$(BUILD)

# The sanitizer build runs the whole suite too (leaks included).
test-asan: asan
	CTEST_ARGS="$(CTEST_ARGS)" bash tests/suite.sh asan=$(ASAN_BUILD)

# The thread sanitizer build runs the whole suite but the Python tests and
# the fuzz replays.
test-tsan: tsan
	CTEST_ARGS="$(CTEST_ARGS)" bash tests/suite.sh tsan=$(TSAN_BUILD)

# libFuzzer on the wire decoder and the registry handlers, bounded in time.
test-fuzz: fuzz
	CTEST_ARGS="$(CTEST_ARGS)" bash tests/suite.sh fuzz=$(FUZZ_BUILD)

# Every build first, then every suite, ending with one line of totals.
test: build asan tsan fuzz
	CTEST_ARGS="$(CTEST_ARGS)" bash tests/suite.sh release=$(BUILD) \
	  asan=$(ASAN_BUILD) tsan=$(TSAN_BUILD) fuzz=$(FUZZ_BUILD)

demo: build
	$(BUILD)/kvferry demo --model llama3-8b --requests 32 --tokens 1024

bench: build
	bash bench/baselines.sh

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)
