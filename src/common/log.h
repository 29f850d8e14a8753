/* SPDX-License-Identifier: Apache-2.0 */
/* Internal logging: the first place that detects an error logs it, with the
 * system's own text; the library never prints directly.
 *
 * Each line says when (UTC), which process and thread, which engine (set
 * per thread with kvw__log_set_engine: the engine's own threads, its
 * creation, the API calls of its requests) and which subsystem: the source file's, from the table in
 * log.c, so that the call sites need not say it (docs/operations.md). */
#ifndef KVW_COMMON_LOG_H
#define KVW_COMMON_LOG_H

#include "kvwire.h"

/* Subsystems, as KVW_LOG_SUBSYS names them. */
typedef enum {
    KVW_SUB_INIT = 0, /* engine creation, configuration, devices, topology */
    KVW_SUB_CTRL,     /* control plane: bootstrap, handshakes, requests, peers */
    KVW_SUB_DATA,     /* the data path: posts, completions, request states */
    KVW_SUB_RAIL,     /* QPs and lanes: bring-up, failure, rejoin */
    KVW_SUB_MEM,      /* registration, GPU memory, staging, landing */
    KVW_SUB_VERIFY,   /* verified transfers */
    KVW_SUB_COUNT
} kvw_subsys_t;

/* The environment variables log.c reads (for configuration checks). */
extern const char *const kvw__log_env_names[];

void kvw__log(kvw_log_level_t level, kvw_subsys_t subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int kvw__log_enabled(kvw_log_level_t level);
/* Level and subsystem filter together (KVW_LOG_SUBSYS applies to info and
 * debug only: errors and warnings always pass). */
int kvw__log_wanted(kvw_log_level_t level, kvw_subsys_t subsys);
/* The subsystem of a source file (its __FILE__). */
kvw_subsys_t kvw__log_subsys_of(const char *file);
/* The engine the calling thread's lines name ("prefill r0 <id>"), or
 * NULL for none; returns the one named before (to restore it). Not
 * copied: tag must stay valid until it is replaced. */
const char *kvw__log_set_engine(const char *tag);
/* Re-read KVW_LOG_LEVEL, KVW_LOG_SUBSYS and KVW_LOG_FILE (tests), closing a
 * log file opened before. */
void kvw__log_reset(void);

#define KVW_LOG_HERE_(level, ...)                                                                  \
    do {                                                                                           \
        if (kvw__log_enabled(level)) {                                                             \
            kvw_subsys_t sub_ = kvw__log_subsys_of(__FILE__);                                      \
            if (kvw__log_wanted(level, sub_))                                                      \
                kvw__log(level, sub_, __VA_ARGS__);                                                \
        }                                                                                          \
    } while (0)

#define KVW_ERROR(...) KVW_LOG_HERE_(KVW_LOG_ERROR, __VA_ARGS__)
#define KVW_WARN(...) KVW_LOG_HERE_(KVW_LOG_WARN, __VA_ARGS__)
#define KVW_INFO(...) KVW_LOG_HERE_(KVW_LOG_INFO, __VA_ARGS__)
#define KVW_DEBUG(...) KVW_LOG_HERE_(KVW_LOG_DEBUG, __VA_ARGS__)
/* With an explicit subsystem, where the file's is not the right one. */
#define KVW_DEBUG_IN(sub, ...)                                                                     \
    do {                                                                                           \
        if (kvw__log_wanted(KVW_LOG_DEBUG, sub))                                                   \
            kvw__log(KVW_LOG_DEBUG, sub, __VA_ARGS__);                                             \
    } while (0)

#endif
