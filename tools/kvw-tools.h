/* SPDX-License-Identifier: Apache-2.0 */
/* Shared by the tools: the command-line conventions every tool follows
 * (strict numbers, usage errors, --help, --version) and the deterministic
 * "KV contents" both sides of a test derive independently, so decode can
 * check every byte without a copy. */
#ifndef KVW_TOOLS_H
#define KVW_TOOLS_H

#include "kvwire.h"

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- command-line conventions (docs/tools.md) ---------------------------------
 * As rdma-core's tools do (ib_write_bw, rdma): --help (and -h) prints the
 * help on stdout and exits 0; --version (and -V) prints "TOOL (kvwire)
 * X.Y.Z" on stdout and exits 0; a bad command line prints one line naming
 * the option and the value on stderr, then a pointer to --help, and exits
 * KVW_TOOL_EXIT_USAGE (1, as ib_write_bw and rdma do). Failures at run
 * time exit 1 as well, with their own message. */
#define KVW_TOOL_EXIT_USAGE 1

/* The tool's name for messages: each main() sets it first. */
static const char *kvw_tool_name = "kvwire";

static inline void kvw_tool_usage_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2), noreturn));

/* "TOOL: MESSAGE" and the pointer to --help, on stderr; exits. */
static inline void kvw_tool_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", kvw_tool_name);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '%s --help' for more information.\n", kvw_tool_name);
    exit(KVW_TOOL_EXIT_USAGE);
}

/* After getopt's own message (an unknown option, a missing value). */
static inline __attribute__((noreturn)) void kvw_tool_bad_option(void)
{
    fprintf(stderr, "Try '%s --help' for more information.\n", kvw_tool_name);
    exit(KVW_TOOL_EXIT_USAGE);
}

/* --version: the version of the library the tool runs on. */
static inline __attribute__((noreturn)) void kvw_tool_version(void)
{
    printf("%s (kvwire) %s\n", kvw_tool_name, kvw_version_string());
    exit(0);
}

/* Strict unsigned numbers: decimal digits, or "0x" then hex digits (the
 * docs write flow labels and masks in hex). The whole string, nothing
 * before or after: no sign, space, suffix or exponent, so "-1", " 5",
 * "10x" and "1e3" are refused, and "010" is ten (never octal). Then
 * min <= value <= max. Returns 0 and *out, or -1 and *why (a phrase). */
static inline int kvw_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out,
                                const char **why)
{
    unsigned base = 10;
    const char *p = s;
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
        base = 16;
        p += 2;
    }
    uint64_t v = 0;
    bool overflow = false;
    const char *digits = p;
    for (; *p; p++) {
        unsigned d;
        if (*p >= '0' && *p <= '9')
            d = (unsigned)(*p - '0');
        else if (base == 16 && *p >= 'a' && *p <= 'f')
            d = (unsigned)(*p - 'a' + 10);
        else if (base == 16 && *p >= 'A' && *p <= 'F')
            d = (unsigned)(*p - 'A' + 10);
        else
            break;
        if (v > (UINT64_MAX - d) / base)
            overflow = true;
        else
            v = v * base + d;
    }
    if (p == digits || *p) {
        *why = base == 16 ? "not a hex number (0x, then hex digits only)"
                          : "not a number (decimal, or hex after 0x; no sign, suffix or "
                            "exponent)";
        return -1;
    }
    if (overflow || v < min || v > max) {
        *why = "out of range";
        return -1;
    }
    *out = v;
    return 0;
}

/* An option's number, or a usage error naming the option, the value and
 * the range. */
static inline uint64_t kvw_tool_u64(const char *opt, const char *s, uint64_t min, uint64_t max)
{
    uint64_t v;
    const char *why;
    if (kvw_parse_u64(s, min, max, &v, &why) == 0)
        return v;
    if (strcmp(why, "out of range"))
        kvw_tool_usage_error("invalid %s '%s': %s", opt, s, why);
    kvw_tool_usage_error("invalid %s '%s': out of range (%llu to %llu)", opt, s,
                         (unsigned long long)min, (unsigned long long)max);
}

static inline uint32_t kvw_tool_u32(const char *opt, const char *s, uint32_t min, uint32_t max)
{
    return (uint32_t)kvw_tool_u64(opt, s, min, max);
}

/* An IPv4 address in dotted-quad form, or a usage error. */
static inline const char *kvw_tool_ipv4(const char *opt, const char *s)
{
    struct in_addr a;
    if (inet_pton(AF_INET, s, &a) != 1)
        kvw_tool_usage_error("invalid %s '%s': not an IPv4 address (a.b.c.d)", opt, s);
    return s;
}

/* "IP" or "IP:PORT" (PORT 0 to 65535, 0: any free port) into host (at
 * least INET_ADDRSTRLEN bytes) and *port (0 when absent). Returns 0, or
 * -1 and *why. */
static inline int kvw_parse_ipv4_port(const char *s, char *host, size_t host_len, uint16_t *port,
                                      const char **why)
{
    const char *colon = strchr(s, ':');
    size_t n = colon ? (size_t)(colon - s) : strlen(s);
    struct in_addr a;
    if (n >= host_len || n >= INET_ADDRSTRLEN) {
        *why = "not an IPv4 address (a.b.c.d)";
        return -1;
    }
    memcpy(host, s, n);
    host[n] = '\0';
    if (inet_pton(AF_INET, host, &a) != 1) {
        *why = "not an IPv4 address (a.b.c.d)";
        return -1;
    }
    uint64_t v = 0;
    if (colon && kvw_parse_u64(colon + 1, 0, 65535, &v, why)) {
        *why = "the port is not a number from 0 to 65535";
        return -1;
    }
    *port = (uint16_t)v;
    return 0;
}

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
