# SPDX-License-Identifier: Apache-2.0
"""Run sglang's server with kvwire serving a transfer backend.

    python3 -m kvwire.sglang.launch_server --disaggregation-mode prefill \
        --disaggregation-transfer-backend mooncake ...   # any sglang.launch_server arguments

install() runs when this module is imported, which multiprocessing's spawn
start method repeats in every scheduler process (it re-imports the parent's
main module), so every process of the server uses kvwire for the backend
named by $KVWIRE_SGLANG_BACKEND (default "mooncake").
"""

from kvwire.sglang import install

install()

if __name__ == "__main__":
    import runpy

    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
