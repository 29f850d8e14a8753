/* SPDX-License-Identifier: Apache-2.0 */
/* CRC32C: the SSE4.2 instruction selected at run time, or slicing by 8.
 * Both compute the same function; test_crc32c compares them. */
#include "common/crc32c.h"

#include <pthread.h>
#include <string.h>

#define POLY 0x82f63b78u /* reflected Castagnoli */

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? c >> 1 ^ POLY : c >> 1;
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = table[t - 1][i] >> 8 ^ table[0][table[t - 1][i] & 0xff];
}

uint32_t kvw__crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    pthread_once(&table_once, build_table);
    const unsigned char *p = buf;
    uint32_t c = ~crc;
    for (; len >= 8; len -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8); /* little-endian hosts only, as the wire format */
        w ^= c;
        c = table[7][w & 0xff] ^ table[6][w >> 8 & 0xff] ^ table[5][w >> 16 & 0xff] ^
            table[4][w >> 24 & 0xff] ^ table[3][w >> 32 & 0xff] ^ table[2][w >> 40 & 0xff] ^
            table[1][w >> 48 & 0xff] ^ table[0][w >> 56];
    }
    while (len--)
        c = c >> 8 ^ table[0][(c ^ *p++) & 0xff];
    return ~c;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

/* Compiled for SSE4.2 whatever the build's -march: only called once the
 * CPU said it has the instruction. */
__attribute__((target("sse4.2"))) uint32_t kvw__crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint64_t c = ~crc;
    for (; len >= 8; len -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}

bool kvw__crc32c_hw_available(void)
{
    return __builtin_cpu_supports("sse4.2");
}
#else
uint32_t kvw__crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    return kvw__crc32c_sw(crc, buf, len);
}

bool kvw__crc32c_hw_available(void)
{
    return false;
}
#endif

uint32_t kvw__crc32c(uint32_t crc, const void *buf, size_t len)
{
    /* Decided once; a race between the first callers writes the same value. */
    static _Atomic int hw = -1;
    int h = hw;
    if (h < 0)
        hw = h = kvw__crc32c_hw_available();
    return h ? kvw__crc32c_hw(crc, buf, len) : kvw__crc32c_sw(crc, buf, len);
}
