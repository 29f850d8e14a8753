# SPDX-License-Identifier: Apache-2.0
"""Run sglang's server with `--disaggregation-transfer-backend kvwire`.

    python3 -m kvwire.sglang.launch_server --disaggregation-mode prefill \
        --disaggregation-transfer-backend kvwire ...   # any sglang.launch_server arguments

install() runs when this module is imported, which multiprocessing's spawn
start method repeats in every scheduler process (it re-imports the parent's
main module), so every process of the server knows the backend "kvwire"
($KVWIRE_SGLANG_BACKEND names another backend to serve instead).
"""

from kvwire.sglang import install

install()

if __name__ == "__main__":
    import runpy

    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
