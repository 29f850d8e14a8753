# SPDX-License-Identifier: Apache-2.0
"""Run sglang's server with `--disaggregation-transfer-backend kvwire`, for
an sglang without the plugin framework (with it, kvwire's entry point does
this, and plain `python -m sglang.launch_server` works: docs/python.md).

    python3 -m kvwire.sglang.launch_server --disaggregation-mode prefill \
        --disaggregation-transfer-backend kvwire ...   # any sglang.launch_server arguments

install() runs when this module is imported. sglang starts its schedulers
with multiprocessing's spawn method, which re-imports the parent's main
module in each child (as __mp_main__): so this module stays the main module
(sglang.launch_server runs in a namespace of its own, alter_sys=False), and
every scheduler process imports it and knows the backend "kvwire" too
($KVWIRE_SGLANG_BACKEND names another backend to serve instead). Making
sglang.launch_server the main module (alter_sys=True) would leave the
children without it: ValueError: 'kvwire' is not a valid TransferBackend.
"""

from kvwire.sglang import install

install()

if __name__ == "__main__":
    import runpy

    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
