/* SPDX-License-Identifier: Apache-2.0 */
/* Internal logging: the first place that detects an error logs it, with the
 * system's own text; the library never prints directly. */
#ifndef KVW_COMMON_LOG_H
#define KVW_COMMON_LOG_H

#include "kvwire.h"

void kvw__log(kvw_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int kvw__log_enabled(kvw_log_level_t level);

#define KVW_ERROR(...) kvw__log(KVW_LOG_ERROR, __VA_ARGS__)
#define KVW_WARN(...) kvw__log(KVW_LOG_WARN, __VA_ARGS__)
#define KVW_INFO(...) kvw__log(KVW_LOG_INFO, __VA_ARGS__)
#define KVW_DEBUG(...)                                                                             \
    do {                                                                                           \
        if (kvw__log_enabled(KVW_LOG_DEBUG))                                                       \
            kvw__log(KVW_LOG_DEBUG, __VA_ARGS__);                                                  \
    } while (0)

#endif
