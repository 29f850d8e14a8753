# SPDX-License-Identifier: Apache-2.0
"""README "Use from Python": one KV transfer, prefill -> decode, verified.

    python3 python/examples/transfer.py PREFILL_IP DECODE_IP [PREFILL_DEV DECODE_DEV]

Both engines live in this one process for brevity; in a deployment the two
halves run in separate processes or hosts, and only the bootstrap address
("ip:port") and the room number travel between them.
"""
import sys
import time

import numpy as np

import kvwire

prefill_ip, decode_ip = sys.argv[1], sys.argv[2]
prefill_dev, decode_dev = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else (None, None)
L, PAGES, ITEM = 4, 64, 2048  # layers, pages per region, bytes per page

# KV memory: K layers then V layers, one numpy array per region.
src = [np.random.default_rng(i).integers(0, 256, PAGES * ITEM, dtype=np.uint8) for i in range(2 * L)]
dst = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(2 * L)]

with kvwire.Bootstrap(f"{prefill_ip}:0") as bootstrap, \
        kvwire.Engine("prefill", prefill_ip, device=prefill_dev, bootstrap_addr=bootstrap.addr,
                      kv=[kvwire.Region.of(a, ITEM) for a in src]) as prefill, \
        kvwire.Engine("decode", decode_ip, device=decode_dev,
                      kv=[kvwire.Region.of(a, ITEM) for a in dst]) as decode:
    room = 42
    src_pages = np.array([3, 4, 5, 9, 20], dtype=np.uint64)   # passed without a copy
    dst_pages = [10, 11, 12, 0, 63]                            # any int sequence works

    with decode.receiver(bootstrap.addr, 0, room) as receiver, prefill.sender(room) as sender:
        receiver.init(dst_pages)          # decode: where the pages go
        sender.init(len(src_pages))       # prefill: how many pages come
        sender.send(src_pages)            # ... and which ones (once, or once per chunk)
        deadline = time.monotonic() + 60
        while receiver.poll() not in (kvwire.Poll.SUCCESS, kvwire.Poll.FAILED):
            if time.monotonic() > deadline:
                receiver.abort()
            time.sleep(0.001)
        if receiver.poll() == kvwire.Poll.FAILED:
            raise receiver.failure()
        while sender.poll() not in (kvwire.Poll.SUCCESS, kvwire.Poll.FAILED):
            time.sleep(0.001)

    for r in range(2 * L):
        for s, d in zip(src_pages.tolist(), dst_pages):
            assert (dst[r][d * ITEM:(d + 1) * ITEM] == src[r][s * ITEM:(s + 1) * ITEM]).all()
    c = prefill.counters()
    print(f"example: room {room}: {len(dst_pages)} pages x {2 * L} regions verified; "
          f"prefill posted {c.wrs_posted} writes, {c.bytes_posted} bytes")
