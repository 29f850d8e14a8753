#!/usr/bin/env bash
# Install (idempotently) every Debian 12 package that kvwire's build, tests
# and test bed (tools/kvw-testbed) need.
#
#   scripts/install-deps.sh          install what is missing (root), or say
#                                    what to install and exit 1 (not root)
#   scripts/install-deps.sh --check  print the missing packages as an exact
#                                    apt-get line; exit 1 if any, 0 if none
set -euo pipefail

# Build and tests.
BUILD_PKGS=(
    build-essential pkg-config
    libibverbs-dev librdmacm-dev libzmq3-dev libcmocka-dev
    rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest
    valgrind
    # the Python binding's tests (make python-test, python_scenarios.sh)
    python3 python3-pytest python3-numpy
)
# Fuzzing (make fuzz, make fuzz-short in make check): clang and libFuzzer.
# The runtime clang links with -fsanitize=fuzzer (libclang_rt.fuzzer) is
# in libclang-rt-14-dev, which clang only recommends: name it, since
# recommends are not installed here.
FUZZ_PKGS=(
    clang libfuzzer-14-dev libclang-rt-14-dev
)
# The test bed: a qemu TCG guest running Debian's 6.1 kernel (ships
# rdma_rxe.ko), booted from a busybox initramfs built with cpio, with rxe
# configured by iproute2's `ip`/`rdma`. procps provides pgrep/ps used by
# tests and by the test bed's cleanup checks.
TESTBED_PKGS=(
    qemu-system-x86 linux-image-amd64 busybox-static kmod iproute2 cpio
    procps coreutils util-linux
)

usage() {
    sed -n '2,10s/^# \{0,1\}//p' "$0"
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

main() {
    local check=0
    case "${1:-}" in
        "") ;;
        --check) check=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install-deps.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac

    if ! command -v dpkg-query >/dev/null 2>&1; then
        echo "install-deps.sh: dpkg-query not found; this script supports Debian 12 only" >&2
        exit 2
    fi

    local -a missing
    mapfile -t missing < <(missing_packages "${BUILD_PKGS[@]}" "${FUZZ_PKGS[@]}" "${TESTBED_PKGS[@]}")
    if ((${#missing[@]} == 0)); then
        ((check)) || echo "install-deps.sh: all packages installed"
        exit 0
    fi

    local line="apt-get install -y --no-install-recommends ${missing[*]}"
    if ((check)); then
        echo "missing packages: ${missing[*]}"
        echo "$line"
        exit 1
    fi
    if ((EUID != 0)); then
        echo "install-deps.sh: not root; run as root:" >&2
        echo "  apt-get update && $line" >&2
        exit 1
    fi
    echo "install-deps.sh: installing: ${missing[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

main "$@"
