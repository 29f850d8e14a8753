/* SPDX-License-Identifier: Apache-2.0 */
/* CRC32C (Castagnoli, the iSCSI and ext4 polynomial 0x1EDC6F41, reflected
 * 0x82F63B78), for the end-to-end check of a request's bytes (config
 * `verify`, docs/failure-semantics.md "Verified transfers"). The SSE4.2
 * crc32 instruction where the CPU has it (chosen once, at the first call),
 * else a table (slicing by 8). Pure and thread-safe. */
#ifndef KVW_COMMON_CRC32C_H
#define KVW_COMMON_CRC32C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Extend crc (0 to start) over len bytes: crc32c(a || b) ==
 * kvw__crc32c(kvw__crc32c(0, a), b). The standard check value:
 * kvw__crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t kvw__crc32c(uint32_t crc, const void *buf, size_t len);
/* The table-driven fallback and the hardware path by name (tests compare
 * them); the hardware one only where kvw__crc32c_hw_available(). */
uint32_t kvw__crc32c_sw(uint32_t crc, const void *buf, size_t len);
uint32_t kvw__crc32c_hw(uint32_t crc, const void *buf, size_t len);
bool kvw__crc32c_hw_available(void);

#endif
