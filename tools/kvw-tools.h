/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the tools: the deterministic "KV contents" both sides of a test
 * derive independently, so decode can check every byte without a copy. */
#ifndef KVW_TOOLS_H
#define KVW_TOOLS_H

#include <stdint.h>
#include <stdlib.h>

/* A 64-bit finalizer (MurmurHash3 fmix64): cheap, well mixed. */
static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* The 8-byte word at word offset w of item `page` in region `region`. */
static inline uint64_t content(uint64_t seed, uint64_t region, uint64_t page, uint64_t w)
{
    return mix(seed ^ mix((region << 40) ^ (page << 20) ^ w));
}

/* n fragmented page indices: [0, n rounded up to contig) cut into chunks
 * of `contig` pages, chunk order shuffled by seed (Fisher-Yates), so runs
 * are contiguous for up to `contig` pages and random between them. */
static inline void shuffled_chunk_pages(uint64_t *out, uint64_t n, uint64_t contig, uint64_t seed)
{
    uint64_t chunks = (n + contig - 1) / contig;
    uint64_t *order = malloc(chunks * sizeof(uint64_t));
    if (!order)
        abort(); /* a tool's workload setup: nothing sensible to fall back to */
    for (uint64_t i = 0; i < chunks; i++)
        order[i] = i;
    for (uint64_t i = chunks; i > 1; i--) {
        uint64_t j = mix(seed + i) % i, t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    for (uint64_t i = 0; i < n; i++)
        out[i] = order[i / contig] * contig + i % contig;
    free(order);
}

#endif
