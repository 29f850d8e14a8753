#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install (idempotently) the Debian 12 packages kvwire's build and tests
# need, plus those of the test-bed mode tests/tools/kvw-testbed will use here
# (host, hostrxe or vm; see tests/tools/kvw-testbed --help). It never installs a
# kernel: the vm mode downloads Debian's kernel package into its own cache.
#
#   scripts/install-deps.sh [--mode MODE]          install what is missing
#                                    (root), or say what to install and exit 1
#   scripts/install-deps.sh --check [--mode MODE]  list what each mode needs
#                                    and what is missing; exit 1 if the build
#                                    or MODE (default: the mode this machine
#                                    gets) lacks a package, else 0
# MODE: auto (default: what `tests/tools/kvw-testbed --print-mode` picks), host,
# hostrxe or vm.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd -P)
readonly SCRIPT_DIR

# Build and tests, every mode.
BUILD_PKGS=(
    build-essential pkg-config
    libibverbs-dev librdmacm-dev libzmq3-dev libcmocka-dev
    rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest
    valgrind
    # the tools' man pages (make install, make check's tools-check)
    help2man
    # the Python binding's tests (make python-test, python_scenarios.sh;
    # hypothesis: the property tests of its constructors)
    python3 python3-pytest python3-numpy python3-hypothesis
    # the documented install of the Python package, tested from a fresh
    # venv with no package index (tests/install/venv_test.sh)
    python3-venv python3-pip python3-setuptools
    # the sglang backend's tests run sglang's own connection code (the
    # pinned reference snapshot): torch (CPU), ZeroMQ, requests, aiohttp
    python3-torch python3-zmq python3-requests python3-aiohttp
    # kvwire.metrics: the prometheus_client collector, and the tests that
    # parse the library's OpenMetrics text with its parser
    python3-prometheus-client
    # the etcd registry (KVW_REGISTRY=etcd://..., built when libcurl and
    # json-c are there) and its tests' etcd cluster (make etcd-check)
    libcurl4-openssl-dev libjson-c-dev etcd-server etcd-client
)
# Fuzzing (make fuzz, make fuzz-short in make check): clang and libFuzzer.
# The runtime clang links with -fsanitize=fuzzer (libclang_rt.fuzzer) is
# in libclang-rt-14-dev, which clang only recommends: name it, since
# recommends are not installed here.
FUZZ_PKGS=(
    clang libfuzzer-14-dev libclang-rt-14-dev
)
# Test-bed modes. host: the RDMA devices are there; only the tools the
# tests use. hostrxe: iproute2's `ip`/`rdma` make the veth pair and rxe
# devices, kmod loads rdma_rxe, util-linux's flock guards the journal.
# vm: a qemu TCG guest booted from a busybox initramfs (cpio) with the
# kernel package fetched by apt-get download and unpacked by dpkg-deb
# (apt, dpkg: always there on Debian); procps for pgrep/ps.
MODE_HOST_PKGS=(procps coreutils util-linux)
MODE_HOSTRXE_PKGS=(iproute2 kmod procps coreutils util-linux)
MODE_VM_PKGS=(qemu-system-x86 busybox-static kmod iproute2 cpio procps coreutils util-linux)

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

# Print the packages from "$@" that are not fully installed.
missing_packages() {
    local pkg status
    for pkg in "$@"; do
        status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
        if [[ "$status" != "install ok installed" ]]; then
            printf '%s\n' "$pkg"
        fi
    done
}

mode_pkgs() { # MODE: its package list, one per line
    case "$1" in
        host) printf '%s\n' "${MODE_HOST_PKGS[@]}" ;;
        hostrxe) printf '%s\n' "${MODE_HOSTRXE_PKGS[@]}" ;;
        vm) printf '%s\n' "${MODE_VM_PKGS[@]}" ;;
    esac
}

# Print "missing: a b" or "all installed" for the packages "$@".
report() {
    local -a miss
    mapfile -t miss < <(missing_packages "$@")
    if ((${#miss[@]})); then echo "missing: ${miss[*]}"; else echo "all installed"; fi
}

# The vm mode's guest kernel: where it is, or what fetching it takes.
guest_kernel_status() {
    local kver cache
    cache=${KVW_TESTBED_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kvw-testbed}
    kver=$(apt-cache depends linux-image-amd64 2>/dev/null |
        sed -n 's/^ *Depends: linux-image-\([0-9][^ ]*-amd64\)$/\1/p' | head -n 1 || true)
    if [[ -z "$kver" ]]; then
        echo "apt knows no linux-image-amd64 (run apt-get update as root)"
    elif [[ -s "$cache/kernel/$kver/lib/modules/$kver/modules.dep" ]]; then
        echo "linux-image-$kver cached in $cache/kernel/$kver"
    else
        echo "linux-image-$kver will be downloaded (not installed) into $cache/kernel on first use"
    fi
}

main() {
    local check=0 mode=auto why="" picked
    while (($#)); do
        case "$1" in
            --check) check=1; shift ;;
            --mode) (($# >= 2)) || { echo "install-deps.sh: --mode needs a value" >&2; exit 2; }
                mode=$2; shift 2 ;;
            --mode=*) mode=${1#*=}; shift ;;
            -h | --help) usage; exit 0 ;;
            *) echo "install-deps.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
        esac
    done
    case "$mode" in
        auto | host | hostrxe | vm) ;;
        *) echo "install-deps.sh: --mode must be auto, host, hostrxe or vm" >&2; exit 2 ;;
    esac

    if ! command -v dpkg-query >/dev/null 2>&1; then
        echo "install-deps.sh: dpkg-query not found; this script supports Debian 12 only" >&2
        exit 2
    fi

    if [[ "$mode" == auto ]]; then
        # The mode auto picks can need tools hostrxe checks for (ip, rdma):
        # if they are missing the test bed says vm, and so do we.
        picked=$("$SCRIPT_DIR/../tests/tools/kvw-testbed" --print-mode 2>/dev/null || printf 'vm\t(cannot ask tests/tools/kvw-testbed)')
        mode=${picked%%$'\t'*}
        why=${picked#*$'\t'}
    else
        why="chosen with --mode"
    fi

    local -a need missing
    mapfile -t need < <(printf '%s\n' "${BUILD_PKGS[@]}" "${FUZZ_PKGS[@]}"; mode_pkgs "$mode")
    mapfile -t need < <(printf '%s\n' "${need[@]}" | awk '!seen[$0]++')
    mapfile -t missing < <(missing_packages "${need[@]}")
    local line="apt-get install -y --no-install-recommends ${missing[*]}"

    if ((check)); then
        local m
        echo "build and tests: $(report "${BUILD_PKGS[@]}" "${FUZZ_PKGS[@]}")"
        for m in host hostrxe vm; do
            mapfile -t need < <(mode_pkgs "$m")
            printf 'mode %-7s (%s): %s\n' "$m" "$(printf '%s ' "${need[@]}" | sed 's/ $//')" "$(report "${need[@]}")"
        done
        echo "mode vm guest kernel: $(guest_kernel_status)"
        echo "this machine: mode $mode ($why)"
        if ((${#missing[@]})); then
            echo "$line"
            exit 1
        fi
        echo "nothing to install"
        exit 0
    fi

    if ((${#missing[@]} == 0)); then
        echo "install-deps.sh: all packages installed (build, and test-bed mode $mode)"
        # vm mode downloads its kernel with apt: make sure apt knows it.
        if [[ "$mode" == vm ]] && ((EUID == 0)) && ! apt-cache show linux-image-amd64 >/dev/null 2>&1; then
            apt-get update
        fi
        exit 0
    fi
    if ((EUID != 0)); then
        echo "install-deps.sh: not root; run as root:" >&2
        echo "  apt-get update && $line" >&2
        exit 1
    fi
    echo "install-deps.sh: installing for the build and test-bed mode $mode ($why): ${missing[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

main "$@"
