/* Shared by the tools: the deterministic "KV contents" both sides of a test
 * derive independently, so decode can check every byte without a copy. */
#ifndef KVW_TOOLS_H
#define KVW_TOOLS_H

#include <stdint.h>

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

#endif
