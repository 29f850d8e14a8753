# SPDX-License-Identifier: Apache-2.0
# kvwire build. `make` builds the libraries, tools, examples and tests;
# `make check` runs the configuration doc check, unit tests (ASan+UBSan,
# host), the etcd registry against a real etcd cluster (tests/etcd), a
# short deterministic fuzz pass,
# ThreadSanitizer and integration tests (real rxe, in the test bed); `make
# fuzz` fuzzes for longer; `make demo` runs the main job; `make bench` the
# benchmarks.

# Install directories, each settable on the command line: LIBDIR for a
# multiarch (lib/x86_64-linux-gnu) or lib64 layout; DESTDIR stages the
# install (packaging) without changing the paths baked into kvwire.pc.
PREFIX    ?= /usr/local
LIBDIR    ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
BINDIR    ?= $(PREFIX)/bin
DOCDIR    ?= $(PREFIX)/share/doc/kvwire
MAN1DIR   ?= $(PREFIX)/share/man/man1
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
BUILD     ?= build
CC        ?= cc
# The version is the header's (KVW_VERSION_MAJOR/MINOR/PATCH in
# include/kvwire.h), so the two cannot disagree; the SONAME is its major
# (docs/api-policy.md).
VERSION   := $(shell sed -n 's/^\#define KVW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9][0-9]*\)$$/\2/p' \
                 include/kvwire.h | paste -sd.)
ifeq ($(words $(subst ., ,$(VERSION))),3)
else
$(error include/kvwire.h: cannot read KVW_VERSION_MAJOR/MINOR/PATCH (got '$(VERSION)'))
endif
SONAME_MAJOR := $(firstword $(subst ., ,$(VERSION)))

# Flags. CFLAGS, CPPFLAGS, LDFLAGS and LDLIBS are the user's (command line
# or environment: `make CFLAGS="-O2 -g" LDFLAGS=...`, as packagers pass
# them); the flags the build needs (the C standard, -fPIC, visibility,
# include paths, -D_GNU_SOURCE, the libraries) are KVW_* variables placed
# before them, so a user's CFLAGS adds to them and can override a choice
# (-O0) but never drops them. The rules keep writing $(CPPFLAGS) $(CFLAGS)
# and $(LDLIBS): those are overridden below to the combination.
# -Werror is the project's gate (make check and CI build with WERROR=1),
# not forced on users, whose compiler may warn about more.
WERROR    ?= 0
WARN       = -Wall -Wextra $(if $(filter 1,$(WERROR)),-Werror) -Wshadow -Wstrict-prototypes \
             -Wmissing-prototypes -Wno-missing-field-initializers
CFLAGS    ?= -O2 -g
# The etcd registry (src/ctrl/registry_etcd.c, KVW_REGISTRY=etcd://...):
# built when libcurl and json-c are there (ETCD=1 insists, ETCD=0 leaves
# it out: the library then links nothing new and refuses KVW_REGISTRY).
ETCD      ?= $(shell pkg-config --exists libcurl json-c 2>/dev/null && echo 1 || echo 0)
ifeq ($(ETCD),1)
ETCD_CPPFLAGS := -DKVW_HAVE_ETCD $(shell pkg-config --cflags libcurl json-c)
ETCD_LIBS     := $(shell pkg-config --libs libcurl json-c)
ETCD_PC_REQUIRES := libcurl json-c
endif
# Only registry_etcd.c reads KVW_HAVE_ETCD: its objects are rebuilt when
# ETCD changes (a build dir made before libcurl was installed, say).
ETCD_STAMP := $(BUILD)/etcd-$(ETCD).stamp
$(ETCD_STAMP):
	@mkdir -p $(dir $@)
	@rm -f $(BUILD)/etcd-*.stamp
	@touch $@
KVW_CPPFLAGS := -D_GNU_SOURCE -Iinclude -Isrc $(ETCD_CPPFLAGS)
KVW_CFLAGS    = -std=c11 $(WARN) -fPIC -fvisibility=hidden -pthread
KVW_LIBS     := -libverbs -lrdmacm -lzmq -ldl -pthread $(ETCD_LIBS)
USER_CPPFLAGS := $(CPPFLAGS)
USER_CFLAGS   := $(CFLAGS)
USER_LDLIBS   := $(LDLIBS)
override CPPFLAGS = $(KVW_CPPFLAGS) $(USER_CPPFLAGS)
override CFLAGS   = $(KVW_CFLAGS) $(USER_CFLAGS)
# Every link line ends with $(LDLIBS): the user's LDFLAGS go there, before
# the libraries (-L, -Wl,... options apply wherever they stand).
override LDLIBS   = $(LDFLAGS) $(KVW_LIBS) $(USER_LDLIBS)
SAN       := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

LIB_SRCS  := $(sort $(wildcard src/*/*.c src/*/*/*.c))
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o)
SAN_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/san/%.o)
TSAN_OBJS := $(LIB_SRCS:%.c=$(BUILD)/tsan/%.o)
TSAN      := -fsanitize=thread -fno-omit-frame-pointer
# The threaded tests: the engine on the fake NIC, its chaos schedules, the
# soak (connection slots reclaimed while the poller runs), the NIC itself,
# staging under faults, requests parked between parts, liveness, the
# device's events, producer events, head slicing's gather writes, rails
# (failover, the ask round trip and rejoins cross the poller and control)
# and verified transfers (digests from the poller, stager, control thread
# and caller).
TSAN_TESTS := $(patsubst %,$(BUILD)/tsan/test_%,engine chaos soak layouts fake_nic staging_abort \
              parked_abort liveness device_events producer_event heads_engine rails verify)

# Tools by audience. tools/: the operator tools, which make install
# installs with their man pages (the programs, kvw-xfer the two-host
# transfer among them, and the script kvw-rxe). tests/tools/: the test
# drivers and the test bed (kvw-gpucheck, gpu-check, demo.sh,
# kvw-testbed); bench/: the benchmark harnesses (bench.sh, kvw-wrcost,
# kvw-rawlat, kvw-heads). Those two are built into $(BUILD) like the
# operator tools but run from the tree only. tools/kvw-tools.h is shared
# by all three: the command-line conventions (docs/tools.md) and the
# deterministic KV contents.
TOOLS     := $(patsubst tools/%.c,$(BUILD)/%,$(wildcard tools/*.c))
TOOL_SCRIPTS := tools/kvw-rxe
TEST_TOOLS := $(patsubst tests/tools/%.c,$(BUILD)/%,$(wildcard tests/tools/*.c))
BENCH_TOOLS := $(patsubst bench/%.c,$(BUILD)/%,$(wildcard bench/*.c))
# Example programs (examples/): the public header only, linked like the tools.
EXAMPLES  := $(patsubst examples/%.c,$(BUILD)/examples/%,$(wildcard examples/*.c))
UNIT      := $(patsubst tests/unit/test_%.c,$(BUILD)/unit/test_%,$(wildcard tests/unit/test_*.c))
INTEG     := $(patsubst tests/integration/%.c,$(BUILD)/integration/%,$(wildcard tests/integration/*_test.c))
TEST_SUPPORT_SRCS := $(wildcard tests/support/*.c)

ABI_DUMP  := $(BUILD)/abi/abi_dump
ABI_RECORD := tests/abi/kvwire-abi.txt
STATIC    := $(BUILD)/libkvwire.a
SHARED    := $(BUILD)/libkvwire.so.$(VERSION)
PC        := $(BUILD)/kvwire.pc

# Keep sanitizer objects between unit-test links.
.SECONDARY: $(SAN_OBJS) $(TSAN_OBJS)

.PHONY: all deps check doc-check unit tools-check etcd-check man abi-check abi-update python-test python-fake-nic integration compat-prev tsan chaos stream demo bench wrcost gpu-check install uninstall install-check clean format \
        fuzz fuzz-short fuzz-build fuzz-toolchain
all: $(STATIC) $(SHARED) $(PC) $(TOOLS) $(TEST_TOOLS) $(BENCH_TOOLS) $(EXAMPLES) $(UNIT) $(INTEG)

deps:
	@scripts/install-deps.sh

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/san/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -O1 $(SAN) -MMD -MP -c $< -o $@

$(STATIC): $(LIB_OBJS)
	@rm -f $@
	ar rcs $@ $^

$(SHARED): $(LIB_OBJS) src/kvwire.map
	$(CC) -shared -Wl,-soname,libkvwire.so.$(SONAME_MAJOR) -Wl,--version-script=src/kvwire.map \
	    -Wl,--no-undefined -o $@ $(LIB_OBJS) $(LDLIBS)
	ln -sf libkvwire.so.$(VERSION) $(BUILD)/libkvwire.so.$(SONAME_MAJOR)
	ln -sf libkvwire.so.$(SONAME_MAJOR) $(BUILD)/libkvwire.so

# The Python tests' libkvwire on the fake NIC (host only, never installed):
# the library's objects, tests/support/fake_nic.c and the few calls of
# python/tests/fake_nic/kvw_fake_nic.c that start its devices and delay its
# writes. Tests load it as KVWIRE_LIB in a process of their own. Without
# the symbol map, so without symver.o's KVWIRE_1.0 aliases (which need it).
FAKE_NIC_LIB := $(BUILD)/test/libkvwire-fakenic.so
$(FAKE_NIC_LIB): python/tests/fake_nic/kvw_fake_nic.c tests/support/fake_nic.c \
                 tests/support/fake_nic.h $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests $(CFLAGS) -shared -Wl,--no-undefined \
	    python/tests/fake_nic/kvw_fake_nic.c tests/support/fake_nic.c \
	    $(filter-out %/symver.o,$(LIB_OBJS)) -o $@ $(LDLIBS)

# kvwire.pc from its template, src/kvwire.pc.in: the directories are baked
# in (relative to ${prefix} where they are under it), so install
# regenerates it for its own PREFIX and LIBDIR.
pc_dir = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))
define write_pc
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(call pc_dir,$(LIBDIR))|' \
	    -e 's|@INCLUDEDIR@|$(call pc_dir,$(INCLUDEDIR))|' -e 's|@VERSION@|$(VERSION)|' \
	    -e 's|@REQUIRES_EXTRA@|$(if $(ETCD_PC_REQUIRES), $(ETCD_PC_REQUIRES))|' \
	    src/kvwire.pc.in > $(1)
endef

$(PC): src/kvwire.pc.in Makefile
	@mkdir -p $(BUILD)
	$(call write_pc,$@)

$(BUILD)/%: tools/%.c tools/kvw-tools.h $(STATIC)
	$(CC) $(CPPFLAGS) $(CFLAGS) $< -o $@ $(STATIC) $(LDLIBS) -lm

$(BUILD)/%: tests/tools/%.c tools/kvw-tools.h $(STATIC)
	$(CC) $(CPPFLAGS) -Itools $(CFLAGS) $< -o $@ $(STATIC) $(LDLIBS) -lm

$(BUILD)/%: bench/%.c tools/kvw-tools.h $(STATIC)
	$(CC) $(CPPFLAGS) -Itools $(CFLAGS) $< -o $@ $(STATIC) $(LDLIBS) -lm

# No -Isrc: an example sees what an integrator sees, include/kvwire.h.
$(BUILD)/examples/%: examples/%.c include/kvwire.h $(STATIC)
	@mkdir -p $(dir $@)
	$(CC) -D_GNU_SOURCE -Iinclude $(CFLAGS) $< -o $@ $(STATIC) $(LDLIBS)

$(BUILD)/tsan/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -O1 $(TSAN) -MMD -MP -c $< -o $@

# Unit tests: host only, ASan + UBSan, library objects built with sanitizers.
$(BUILD)/unit/test_%: tests/unit/test_%.c $(SAN_OBJS) $(TEST_SUPPORT_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests $(CFLAGS) -O1 $(SAN) $< $(TEST_SUPPORT_SRCS) $(SAN_OBJS) \
	    -o $@ $(LDLIBS) -lcmocka -lm

# Integration tests run inside the TCG guest: plain optimized builds.
$(BUILD)/integration/%: tests/integration/%.c $(STATIC) $(TEST_SUPPORT_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests $(CFLAGS) $< $(TEST_SUPPORT_SRCS) -o $@ $(STATIC) $(LDLIBS) -lcmocka -lm

# The rxe build of the layout tests is the unit test's file (#include).
$(BUILD)/integration/layouts_test: tests/unit/test_layouts.c

$(foreach d,obj san tsan fuzz/obj,$(BUILD)/$(d)/src/ctrl/registry_etcd.o): $(ETCD_STAMP)

# The etcd registry's tests (ASan + UBSan, fake NIC) against a real etcd
# cluster that tests/etcd/run.sh starts; only with the etcd backend built.
$(BUILD)/etcd/test_etcd: tests/etcd/test_etcd.c $(SAN_OBJS) $(TEST_SUPPORT_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests $(CFLAGS) -O1 $(SAN) $< $(TEST_SUPPORT_SRCS) $(SAN_OBJS) \
	    -o $@ $(LDLIBS) -lcmocka -lm

ifeq ($(ETCD),1)
etcd-check: $(BUILD)/etcd/test_etcd
	tests/etcd/run.sh $(BUILD)
else
etcd-check:
	@echo "etcd-check: skipped: kvwire is built without the etcd registry (ETCD=0; it needs" \
	    "libcurl4-openssl-dev and libjson-c-dev, scripts/install-deps.sh)"
endif

$(BUILD)/tsan/test_%: tests/unit/test_%.c $(TSAN_OBJS) $(TEST_SUPPORT_SRCS)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -Itests $(CFLAGS) -O1 $(TSAN) $< $(TEST_SUPPORT_SRCS) $(TSAN_OBJS) \
	    -o $@ $(LDLIBS) -lcmocka -lm

# make check builds with -Werror (WERROR=1), its sub-makes too.
check: export WERROR = 1
check: deps all
	@$(MAKE) --no-print-directory doc-check
	@$(MAKE) --no-print-directory install-check
	@$(MAKE) --no-print-directory unit
	@$(MAKE) --no-print-directory tools-check
	@$(MAKE) --no-print-directory etcd-check
	@$(MAKE) --no-print-directory gpu-check
	@$(MAKE) --no-print-directory python-test
	@$(MAKE) --no-print-directory fuzz-short
	@$(MAKE) --no-print-directory tsan
	@$(MAKE) --no-print-directory integration

# Host only, no build: docs/configuration.md against the configuration
# table in src/common/config.c and the library's own KVW_* variables.
doc-check:
	scripts/check-config-doc.sh

unit: $(UNIT) abi-check
	@set -e; for t in $(UNIT); do echo "== $$t"; $$t; done

# The public ABI's layout (every public struct's size and member offsets,
# enum values, the version) against the record in tests/abi/kvwire-abi.txt,
# and each public function's symbol version against the release that added
# it (tests/abi/kvwire-symbols.txt, check_symbols.py):
# a change fails, saying which version bump it needs (docs/api-policy.md);
# after the bump, `make abi-update` rewrites the record.
# The dump program is generated from the header (tests/abi/gen_abi_dump.py),
# so every struct member and enum value is in it without a list to keep.
$(ABI_DUMP): tests/abi/gen_abi_dump.py include/kvwire.h
	@mkdir -p $(dir $@)
	$(PYTHON) tests/abi/gen_abi_dump.py '$(CC)' include $@.c
	$(CC) $(CPPFLAGS) $(CFLAGS) -Wno-missing-prototypes $@.c -o $@

abi-check: $(ABI_DUMP) $(SHARED) $(BUILD)/abi/old_node_test
	$(PYTHON) tests/abi/check_abi.py $(ABI_DUMP) $(ABI_RECORD)
	$(PYTHON) tests/abi/check_symbols.py $(SHARED) tests/abi/kvwire-symbols.txt include/kvwire.h
	LD_LIBRARY_PATH=$(BUILD) $(BUILD)/abi/old_node_test

# A program linked as those built against 1.1 .. 1.4 were (their map put
# every function in KVWIRE_1.0; those releases had no aliases), run on
# today's library by abi-check.
$(BUILD)/abi/old/libkvwire.so.$(SONAME_MAJOR): $(LIB_OBJS) tests/abi/kvwire-1.0-pattern.map
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libkvwire.so.$(SONAME_MAJOR) \
	    -Wl,--version-script=tests/abi/kvwire-1.0-pattern.map \
	    $(filter-out %/symver.o,$(LIB_OBJS)) -o $@ $(LDLIBS)

$(BUILD)/abi/old_node_test: tests/abi/old_node_test.c $(BUILD)/abi/old/libkvwire.so.$(SONAME_MAJOR)
	$(CC) $(CPPFLAGS) $(CFLAGS) $< -o $@ $(BUILD)/abi/old/libkvwire.so.$(SONAME_MAJOR) $(LDLIBS)

abi-update: $(ABI_DUMP)
	$(ABI_DUMP) > $(ABI_RECORD)

# The Python binding (python/), host only: import, config, errors, index
# conversion, bootstrap service, use after close, random shapes of the
# constructors. Debian's python3 with python3-pytest, python3-numpy and
# python3-hypothesis; transfers run in python_scenarios.sh.
PYTHON    ?= $(firstword $(wildcard /usr/bin/python3) python3)
python-fake-nic: $(FAKE_NIC_LIB)

python-test: $(SHARED) $(FAKE_NIC_LIB)
	KVWIRE_LIB=$(CURDIR)/$(BUILD)/libkvwire.so.$(SONAME_MAJOR) PYTHONPATH=$(CURDIR)/python \
	    KVWIRE_FAKE_NIC_LIB=$(CURDIR)/$(FAKE_NIC_LIB) \
	    PYTHONDONTWRITEBYTECODE=1 $(PYTHON) -m pytest -q -p no:cacheprovider python/tests \
	    --ignore=python/tests/guest

# ThreadSanitizer over the threaded engine (both roles, control and poller
# threads, the fake NIC's wire thread); any report fails the run.
tsan: $(TSAN_TESTS)
	@set -e; for t in $(TSAN_TESTS); do echo "== $$t (ThreadSanitizer)"; \
	    KVW_CHAOS_SCHEDULES=$${KVW_TSAN_CHAOS_SCHEDULES:-500} \
	    KVW_SOAK_CYCLES=$${KVW_TSAN_SOAK_CYCLES:-1000} TSAN_OPTIONS="halt_on_error=1 exitcode=66 suppressions=$(CURDIR)/tests/tsan.supp" $$t; done

# The long chaos run: many more seeded fault schedules than make check's.
chaos: $(BUILD)/unit/test_chaos
	KVW_CHAOS_SCHEDULES=$${KVW_CHAOS_SCHEDULES:-20000} $(BUILD)/unit/test_chaos
# The previous minor release's kvw-xfer, built from this repository's own
# history on the host (a shallow clone fails here, saying so), for
# tests/integration/compat_scenarios.sh.
compat-prev:
	scripts/build-prev-release.sh $(BUILD)

integration: $(INTEG) $(TOOLS) $(TEST_TOOLS) $(EXAMPLES) $(SHARED) compat-prev
	tests/tools/kvw-testbed --devices 4 --timeout $${KVW_TESTBED_TIMEOUT:-3000} -- tests/integration/run-all.sh $(BUILD)

# Two decode processes streaming back-to-back 12.6 MB requests from one
# prefill on rxe (soak_scenarios.sh stream; KVW_STREAM_REQUESTS, 40 each).
stream: deps all
	tests/tools/kvw-testbed --devices 2 --timeout 1800 -- tests/integration/soak_scenarios.sh $(BUILD) stream

demo: deps all
	tests/tools/kvw-testbed --devices 2 --timeout 900 -- tests/tools/demo.sh $(BUILD)

# The null-device posting rate and the real path's instructions per WR
# (callgrind; needs valgrind) are measured first, on the host (one core of
# this machine, not the TCG guest); bench/bench.sh prints them beside the
# ratios.
bench: deps all
	-$(BUILD)/kvw-wrcost --rate >$(BUILD)/nullrate.txt
	-$(BUILD)/kvw-wrcost >$(BUILD)/wrcost.txt 2>&1
	-$(BUILD)/kvw-heads --contig 4
ifeq ($(ETCD),1)
	tests/etcd/storm.sh $(BUILD)
endif
	tests/tools/kvw-testbed --devices 2 --cpus 2 --timeout $${KVW_BENCH_TIMEOUT:-1800} -- \
	    bench/bench.sh $(BUILD)

# GPU memory checks (tests/tools/gpu-check): detection, dma-buf export and copy
# throughput on an NVIDIA GPU; without one they report 'skipped' and pass,
# so make check runs the build, argument handling and the skip everywhere.
gpu-check: $(BUILD)/kvw-gpucheck $(BUILD)/kvwire-info
	tests/tools/gpu-check $(BUILD)

# Host only (no RDMA): library instructions per work request under callgrind
# (Debian package valgrind), on the real path: the sender API, the planner
# and the poller's own build/link/post and retire (src/engine/poller.h) on a
# null device; fails over 45 per WR. Not part of check. `kvw-wrcost --rate`
# gives the null-device WR/s per core (make bench prints it).
wrcost: $(BUILD)/kvw-wrcost
	$(BUILD)/kvw-wrcost

# ---------------------------------------------------------------- fuzzing
# libFuzzer harnesses (tests/fuzz/): the wire decoder, and the control
# handlers of prefill, decode and the bootstrap service driven over ZeroMQ.
# Library objects carry coverage (fuzzer-no-link); the fake NIC does not,
# so the fuzzer steers by kvwire's code alone. Needs clang and the libFuzzer
# runtime (Debian clang, libfuzzer-14-dev, libclang-rt-14-dev).
FUZZ_CC     ?= clang
FUZZ_DIR    := $(BUILD)/fuzz
FUZZ_SAN    := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
FUZZ_CFLAGS  = $(CFLAGS) -O1 -g
FUZZ_NAMES  := wire prefill decode bootstrap
FUZZ_BINS   := $(FUZZ_NAMES:%=$(FUZZ_DIR)/fuzz_%)
FUZZ_OBJS   := $(LIB_SRCS:%.c=$(FUZZ_DIR)/obj/%.o)
FUZZ_COMMON_OBJ := $(FUZZ_DIR)/obj/tests/fuzz/fuzz_common.o
# The library harnesses' shared set-up (fuzz_engine.c) needs the library
# and the fake NIC, so it is apart from fuzz_common.c.
FUZZ_SUPPORT_OBJS := $(FUZZ_DIR)/obj/tests/support/fake_nic.o $(FUZZ_COMMON_OBJ) \
                     $(FUZZ_DIR)/obj/tests/fuzz/fuzz_engine.o
# The wire harness and the seed generator need only the wire format, so
# they build (and fuzz-short's wire pass runs) while the engine is mid-edit.
FUZZ_WIRE_OBJS := $(filter $(FUZZ_DIR)/obj/src/ctrl/wire.o $(FUZZ_DIR)/obj/src/common/%,$(FUZZ_OBJS))
FUZZ_RT     := libclang_rt.fuzzer-$(shell uname -m).a
# make fuzz: seconds per harness (FUZZ_SECONDS sets all), and the inputs
# the wire harness must reach however long that takes.
FUZZ_SECONDS_WIRE   ?= $(or $(FUZZ_SECONDS),60)
FUZZ_SECONDS_ENGINE ?= $(or $(FUZZ_SECONDS),30)
FUZZ_WIRE_MIN_RUNS  ?= 10000000
# make fuzz-short (in make check): inputs per harness, fixed seed.
FUZZ_SHORT_RUNS_WIRE   ?= 200000
FUZZ_SHORT_RUNS_ENGINE ?= 400

.SECONDARY: $(FUZZ_OBJS) $(FUZZ_SUPPORT_OBJS)

fuzz-toolchain:
	@command -v $(FUZZ_CC) >/dev/null 2>&1 || { echo "fuzz: $(FUZZ_CC) not found:" \
	    "install the Debian package clang (scripts/install-deps.sh)" >&2; exit 1; }
	@test -f "$$($(FUZZ_CC) -print-file-name=$(FUZZ_RT))" || { echo "fuzz: $(FUZZ_RT) not" \
	    "found: install the Debian package libfuzzer-14-dev (and libclang-rt-14-dev, which" \
	    "ships the runtime; scripts/install-deps.sh installs both)" >&2; exit 1; }

$(FUZZ_DIR)/obj/src/%.o: src/%.c | fuzz-toolchain
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) $(FUZZ_CFLAGS) $(FUZZ_SAN) -fsanitize=fuzzer-no-link -MMD -MP -c $< -o $@

$(FUZZ_DIR)/obj/tests/%.o: tests/%.c | fuzz-toolchain
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) -Itests $(FUZZ_CFLAGS) $(FUZZ_SAN) -MMD -MP -c $< -o $@

$(FUZZ_DIR)/fuzz_wire: tests/fuzz/fuzz_wire.c $(FUZZ_WIRE_OBJS) $(FUZZ_COMMON_OBJ) | fuzz-toolchain
	$(FUZZ_CC) $(CPPFLAGS) -Itests $(FUZZ_CFLAGS) $(FUZZ_SAN) -fsanitize=fuzzer $< \
	    $(FUZZ_COMMON_OBJ) $(FUZZ_WIRE_OBJS) -o $@ $(LDLIBS)

$(FUZZ_DIR)/fuzz_%: tests/fuzz/fuzz_%.c $(FUZZ_OBJS) $(FUZZ_SUPPORT_OBJS) | fuzz-toolchain
	$(FUZZ_CC) $(CPPFLAGS) -Itests $(FUZZ_CFLAGS) $(FUZZ_SAN) -fsanitize=fuzzer $< \
	    $(FUZZ_SUPPORT_OBJS) $(FUZZ_OBJS) -o $@ $(LDLIBS)

$(FUZZ_DIR)/gen_corpus: tests/fuzz/gen_corpus.c $(FUZZ_WIRE_OBJS) $(FUZZ_COMMON_OBJ) | fuzz-toolchain
	$(FUZZ_CC) $(CPPFLAGS) -Itests $(FUZZ_CFLAGS) $(FUZZ_SAN) $< $(FUZZ_COMMON_OBJ) \
	    $(FUZZ_WIRE_OBJS) -o $@ $(LDLIBS)

# Regenerated whenever the generator (and so the wire code) changes.
$(FUZZ_DIR)/seeds/.stamp: $(FUZZ_DIR)/gen_corpus
	rm -rf $(FUZZ_DIR)/seeds
	$(FUZZ_DIR)/gen_corpus $(FUZZ_DIR)/seeds
	@touch $@

fuzz-build: $(FUZZ_BINS) $(FUZZ_DIR)/seeds/.stamp

# One harness at a time: the engine harnesses run threads of their own.
fuzz: fuzz-build
	@set -e; for h in $(FUZZ_NAMES); do \
	    if [ $$h = wire ]; then t=$(FUZZ_SECONDS_WIRE) min=$(FUZZ_WIRE_MIN_RUNS); \
	    else t=$(FUZZ_SECONDS_ENGINE) min=0; fi; \
	    tests/fuzz/run-fuzz.sh $(FUZZ_DIR)/fuzz_$$h $(FUZZ_DIR)/seeds/$$h \
	        $(FUZZ_DIR)/work/$$h time $$t $$min; done

fuzz-short: fuzz-build
	@set -e; for h in $(FUZZ_NAMES); do \
	    if [ $$h = wire ]; then n=$(FUZZ_SHORT_RUNS_WIRE); else n=$(FUZZ_SHORT_RUNS_ENGINE); fi; \
	    tests/fuzz/run-fuzz.sh $(FUZZ_DIR)/fuzz_$$h $(FUZZ_DIR)/seeds/$$h \
	        $(FUZZ_DIR)/short/$$h short $$n; done

# Man pages for the installed tools, generated from their --help and
# --version by help2man (Debian package help2man). Reproducible: help2man
# dates a page by SOURCE_DATE_EPOCH, here the last commit's time (outside
# git, the header's modification time).
MAN_TOOLS := $(notdir $(TOOLS)) kvw-rxe
MANS      := $(MAN_TOOLS:%=$(BUILD)/man/%.1)
MAN_EPOCH := $(or $(shell git log -1 --format=%ct 2>/dev/null),$(shell stat -c %Y include/kvwire.h))
HELP2MAN  ?= help2man
man_name_kvwire-info   := what kvwire finds on this node, and a self-test before the first transfer
man_name_kvw-bootstrap := the kvwire bootstrap service, standalone
man_name_kvw-keygen    := write a kvwire cluster key
man_name_kvwire-bench  := KV-cache transfer throughput and latency, on one host or two
man_name_kvw-xfer      := one side of a verified KV-cache transfer between two hosts
man_name_kvw-rxe       := soft-RoCE (rdma_rxe) on a network interface, for kvwire

man: $(MANS)

$(BUILD)/man/%.1: $(BUILD)/%
	@mkdir -p $(dir $@)
	SOURCE_DATE_EPOCH=$(MAN_EPOCH) $(HELP2MAN) --no-info --section 1 --source kvwire \
	    --name '$(man_name_$*)' --output $@ $<

$(BUILD)/man/kvw-rxe.1: tools/kvw-rxe include/kvwire.h
	@mkdir -p $(dir $@)
	SOURCE_DATE_EPOCH=$(MAN_EPOCH) $(HELP2MAN) --no-info --section 1 --source kvwire \
	    --name '$(man_name_kvw-rxe)' --output $@ tools/kvw-rxe

# Host only: every tool's command line (tests/tools/tool_args.sh: each bad
# input of issue 31, --help, --version, exit codes) and its man page.
tools-check: $(TOOLS) $(BENCH_TOOLS) $(MANS)
	tests/tools/tool_args.sh $(BUILD)

# The library, its header and pkg-config file, the operator tools, their
# man pages and the license; nothing from tests/ or bench/. PREFIX, LIBDIR (and the other
# *DIR above) and DESTDIR as in the GNU conventions; `make uninstall` with
# the same ones removes exactly these files.
INSTALLED_LIBS := $(notdir $(STATIC) $(SHARED)) libkvwire.so.$(SONAME_MAJOR) libkvwire.so
INSTALLED_BINS := $(notdir $(TOOLS) $(TOOL_SCRIPTS))
install: $(STATIC) $(SHARED) $(PC) $(TOOLS) $(MANS)
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(BINDIR)
	install -m 644 include/kvwire.h $(DESTDIR)$(INCLUDEDIR)/
	install -m 644 $(STATIC) $(DESTDIR)$(LIBDIR)/
	install -m 755 $(SHARED) $(DESTDIR)$(LIBDIR)/
	ln -sf libkvwire.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libkvwire.so.$(SONAME_MAJOR)
	ln -sf libkvwire.so.$(SONAME_MAJOR) $(DESTDIR)$(LIBDIR)/libkvwire.so
	$(call write_pc,$(DESTDIR)$(PKGCONFIGDIR)/kvwire.pc)
	install -m 755 $(TOOLS) $(TOOL_SCRIPTS) $(DESTDIR)$(BINDIR)/
	install -d $(DESTDIR)$(MAN1DIR)
	install -m 644 $(MANS) $(DESTDIR)$(MAN1DIR)/
	install -d $(DESTDIR)$(DOCDIR)
	install -m 644 LICENSE $(DESTDIR)$(DOCDIR)/

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/kvwire.h
	rm -f $(addprefix $(DESTDIR)$(LIBDIR)/,$(INSTALLED_LIBS))
	rm -f $(DESTDIR)$(PKGCONFIGDIR)/kvwire.pc
	rm -f $(addprefix $(DESTDIR)$(BINDIR)/,$(INSTALLED_BINS))
	rm -f $(addprefix $(DESTDIR)$(MAN1DIR)/,$(notdir $(MANS)))
	rm -f $(DESTDIR)$(DOCDIR)/LICENSE
	rmdir $(DESTDIR)$(DOCDIR) 2>/dev/null || true

# Host only: a build with the user's CFLAGS/LDFLAGS, install into a staging
# directory (PREFIX, DESTDIR, a multiarch LIBDIR), the file list, a program
# built against the installed kvwire.pc, uninstall leaving nothing; then the
# Python package installed offline into a fresh venv (tests/install/).
install-check:
	tests/install/install_test.sh
	tests/install/venv_test.sh $(BUILD)

format:
	clang-format -i include/*.h src/*/*.c src/*/*.h src/*/*/*.c src/*/*/*.h tools/*.c bench/*.c tests/*/*.c tests/*/*.h

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
