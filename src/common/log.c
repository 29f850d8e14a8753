/* SPDX-License-Identifier: Apache-2.0 */
#include "common/log.h"
#include "common/config.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static kvw_log_fn log_fn;
static void *log_arg;
static _Atomic int log_max_level = -1; /* -1: not yet read from the environment */

/* A name it does not know is warn here; kvw_config_init refuses it with
 * the message (config.c), so an unknown level is said once, not per line. */
static int level_from_env(void)
{
    const char *env = getenv("KVW_LOG_LEVEL");
    int level = env ? kvw__config_log_level(env) : -1;
    return level < 0 ? KVW_LOG_WARN : level;
}

int kvw__log_enabled(kvw_log_level_t level)
{
    int max = atomic_load_explicit(&log_max_level, memory_order_relaxed);
    if (max < 0) {
        max = level_from_env();
        int expected = -1;
        atomic_compare_exchange_strong(&log_max_level, &expected, max);
        max = atomic_load(&log_max_level);
    }
    return (int)level <= max;
}

void kvw_set_log_handler(kvw_log_fn fn, void *arg, kvw_log_level_t max_level)
{
    pthread_mutex_lock(&log_lock);
    log_fn = fn;
    log_arg = arg;
    pthread_mutex_unlock(&log_lock);
    atomic_store(&log_max_level, (int)max_level);
}

void kvw__log(kvw_log_level_t level, const char *fmt, ...)
{
    static const char *const tags[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (!kvw__log_enabled(level))
        return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);

    pthread_mutex_lock(&log_lock);
    if (log_fn)
        log_fn(log_arg, level, msg);
    else
        fprintf(stderr, "kvwire %s: %s\n", tags[level], msg);
    pthread_mutex_unlock(&log_lock);
}
