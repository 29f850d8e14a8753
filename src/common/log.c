/* SPDX-License-Identifier: Apache-2.0 */
#include "common/log.h"
#include "common/config.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static kvw_log_fn log_fn;
static kvw_log_record_fn log_record_fn;
static void *log_arg;
static _Atomic int log_max_level = -1; /* -1: not yet read from the environment */

const char *const kvw__log_env_names[] = {"KVW_LOG_LEVEL", "KVW_LOG_SUBSYS", "KVW_LOG_FILE", NULL};

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

static void set_handler(kvw_log_fn fn, kvw_log_record_fn record_fn, void *arg,
                        kvw_log_level_t max_level)
{
    pthread_mutex_lock(&log_lock);
    log_fn = fn;
    log_record_fn = record_fn;
    log_arg = arg;
    pthread_mutex_unlock(&log_lock);
    atomic_store(&log_max_level, (int)max_level);
}

void kvw_set_log_handler(kvw_log_fn fn, void *arg, kvw_log_level_t max_level)
{
    set_handler(fn, NULL, arg, max_level);
}

void kvw_set_log_record_handler(kvw_log_record_fn fn, void *arg, kvw_log_level_t max_level)
{
    set_handler(NULL, fn, arg, max_level);
}

/* ------------------------------------------------------------ subsystems */

static const char *const subsys_names[KVW_SUB_COUNT] = {"INIT", "CTRL", "DATA",
                                                        "RAIL", "MEM",  "VERIFY"};

/* Source files by base name; the others are DATA. */
static const struct {
    const char *file;
    kvw_subsys_t subsys;
} file_subsys[] = {
    {"engine.c", KVW_SUB_INIT},     {"config.c", KVW_SUB_INIT},     {"version.c", KVW_SUB_INIT},
    {"device.c", KVW_SUB_INIT},     {"topo.c", KVW_SUB_INIT},       {"sized.c", KVW_SUB_INIT},
    {"bootstrap.c", KVW_SUB_CTRL},  {"wire.c", KVW_SUB_CTRL},       {"zsock.c", KVW_SUB_CTRL},
    {"control.c", KVW_SUB_CTRL},    {"ctl_decode.c", KVW_SUB_CTRL}, {"ctl_prefill.c", KVW_SUB_CTRL},
    {"ctl_frame.c", KVW_SUB_CTRL},  {"peer.c", KVW_SUB_CTRL},       {"rejoin.c", KVW_SUB_RAIL},
    {"ctl_rejoin.c", KVW_SUB_RAIL}, {"qp.c", KVW_SUB_RAIL},         {"ops_real.c", KVW_SUB_RAIL},
    {"mem.c", KVW_SUB_MEM},         {"cuda.c", KVW_SUB_MEM},        {"staging.c", KVW_SUB_MEM},
    {"stager.c", KVW_SUB_MEM},      {"stage_recv.c", KVW_SUB_MEM},  {"stage_send.c", KVW_SUB_MEM},
    {"landing.c", KVW_SUB_MEM},     {"verify.c", KVW_SUB_VERIFY},   {"crc32c.c", KVW_SUB_VERIFY},
};

kvw_subsys_t kvw__log_subsys_of(const char *file)
{
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    for (size_t i = 0; i < sizeof(file_subsys) / sizeof(file_subsys[0]); i++)
        if (strcmp(base, file_subsys[i].file) == 0)
            return file_subsys[i].subsys;
    return KVW_SUB_DATA;
}

/* Bit i set: subsystem i logs at info and debug. -1: not read yet. */
static _Atomic int subsys_mask = -1;

/* KVW_LOG_SUBSYS as NCCL_DEBUG_SUBSYS: a comma-separated list of names
 * (ALL for every one), or a list starting with ^ for every one but those.
 * Unknown names are ignored (said once, at warn). */
static int mask_from_env(void)
{
    const int all = (1 << KVW_SUB_COUNT) - 1;
    const char *env = getenv("KVW_LOG_SUBSYS");
    if (!env || !*env)
        return all;
    bool invert = env[0] == '^';
    int mask = 0;
    char copy[256];
    snprintf(copy, sizeof(copy), "%s", env + invert);
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int bit = -1;
        if (strcasecmp(tok, "ALL") == 0)
            bit = all;
        for (int i = 0; i < KVW_SUB_COUNT && bit < 0; i++)
            if (strcasecmp(tok, subsys_names[i]) == 0)
                bit = 1 << i;
        if (bit < 0)
            fprintf(stderr, "kvwire: KVW_LOG_SUBSYS: unknown subsystem \"%s\" ignored\n", tok);
        else
            mask |= bit;
    }
    return invert ? all & ~mask : mask;
}

int kvw__log_wanted(kvw_log_level_t level, kvw_subsys_t subsys)
{
    if (!kvw__log_enabled(level))
        return 0;
    if (level <= KVW_LOG_WARN)
        return 1;
    int mask = atomic_load_explicit(&subsys_mask, memory_order_relaxed);
    if (mask < 0) {
        int expected = -1;
        atomic_compare_exchange_strong(&subsys_mask, &expected, mask_from_env());
        mask = atomic_load(&subsys_mask);
    }
    return (mask >> subsys) & 1;
}

/* ---------------------------------------------------------------- engine */

/* A pointer, not a copy: setting it costs nothing on a caller's poller
 * pass. The tag lives in its engine, which outlives the setting. */
static _Thread_local const char *thread_engine;

const char *kvw__log_set_engine(const char *tag)
{
    const char *before = thread_engine;
    thread_engine = tag;
    return before;
}

/* ------------------------------------------------------------------ file */

/* KVW_LOG_FILE, opened at the first line (log_lock). -1: none. */
static int log_file_fd = -1;
static bool log_file_tried;

/* KVW_LOG_FILE with %h (host name) and %p (pid) replaced, as NCCL_DEBUG_FILE;
 * %% is a %. false when the result does not fit. */
static bool expand_path(const char *pattern, char *out, size_t size)
{
    size_t n = 0;
    for (const char *s = pattern; *s; s++) {
        char piece[256];
        if (s[0] == '%' && s[1] == 'h') {
            if (gethostname(piece, sizeof(piece)) != 0)
                snprintf(piece, sizeof(piece), "unknown");
            piece[sizeof(piece) - 1] = '\0';
            s++;
        } else if (s[0] == '%' && s[1] == 'p') {
            snprintf(piece, sizeof(piece), "%ld", (long)getpid());
            s++;
        } else if (s[0] == '%' && s[1] == '%') {
            snprintf(piece, sizeof(piece), "%%");
            s++;
        } else {
            snprintf(piece, sizeof(piece), "%c", *s);
        }
        size_t len = strlen(piece);
        if (n + len >= size)
            return false;
        memcpy(out + n, piece, len);
        n += len;
    }
    out[n] = '\0';
    return true;
}

/* (log_lock) The file's descriptor, opening it the first time. A file that
 * cannot be opened is said once on stderr, which then takes the lines. */
static int log_file_locked(void)
{
    if (log_file_tried)
        return log_file_fd;
    log_file_tried = true;
    const char *env = getenv("KVW_LOG_FILE");
    if (!env || !*env)
        return -1;
    char path[4096];
    if (!expand_path(env, path, sizeof(path))) {
        fprintf(stderr, "kvwire: KVW_LOG_FILE: the path is too long; logging to stderr\n");
        return -1;
    }
    log_file_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_file_fd < 0)
        fprintf(stderr, "kvwire: KVW_LOG_FILE: cannot open %s: %s; logging to stderr\n", path,
                strerror(errno));
    return log_file_fd;
}

void kvw__log_reset(void)
{
    pthread_mutex_lock(&log_lock);
    if (log_file_fd >= 0)
        close(log_file_fd);
    log_file_fd = -1;
    log_file_tried = false;
    pthread_mutex_unlock(&log_lock);
    atomic_store(&subsys_mask, -1);
    atomic_store(&log_max_level, -1);
}

/* ----------------------------------------------------------------- lines */

/* The message, formatted whole: on the stack when it fits, else in a
 * buffer of its size (*heap_p, for the caller to free). A message that
 * cannot be allocated is cut, and says so. */
static const char *format_message(char *stack, size_t size, char **heap_p, const char *fmt,
                                  va_list ap)
{
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(stack, size, fmt, ap);
    *heap_p = NULL;
    if (n >= 0 && (size_t)n >= size && (*heap_p = malloc((size_t)n + 1)))
        vsnprintf(*heap_p, (size_t)n + 1, fmt, again);
    else if (n >= 0 && (size_t)n >= size)
        memcpy(stack + size - 4, "...", 4);
    va_end(again);
    return *heap_p ? *heap_p : stack;
}

/* "2026-01-31T12:34:56.789012Z": the wall clock in UTC, microseconds. */
static void format_time(char *out, size_t size)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char date[32];
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, size, "%.20s.%06dZ", date, (int)(ts.tv_nsec / 1000));
}

/* The whole line, without its newline: time, pid.tid, level, subsystem,
 * engine, message. Heap-allocated (NULL when out of memory). */
static char *format_line(kvw_log_level_t level, kvw_subsys_t subsys, const char *msg)
{
    static const char *const tags[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    char when[48];
    format_time(when, sizeof(when));
    const char *engine = thread_engine ? thread_engine : "";
    size_t size = strlen(when) + strlen(msg) + strlen(engine) + 96;
    char *line = malloc(size);
    if (line)
        snprintf(line, size, "%s kvwire[%ld.%ld] %s %s%s%s: %s", when, (long)getpid(),
                 (long)syscall(SYS_gettid), tags[level], subsys_names[subsys], *engine ? " " : "",
                 engine, msg);
    return line;
}

static void write_all(int fd, const char *text, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, text, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        text += n;
        len -= (size_t)n;
    }
}

/* (log_lock) One line, with its newline, in a single write: lines of
 * several threads and processes sharing the file do not interleave. */
static void write_line(int fd, const char *line)
{
    size_t len = strlen(line);
    char *buf = malloc(len + 1);
    if (!buf) {
        write_all(fd, line, len);
        write_all(fd, "\n", 1);
        return;
    }
    memcpy(buf, line, len);
    buf[len] = '\n';
    write_all(fd, buf, len + 1);
    free(buf);
}

void kvw__log(kvw_log_level_t level, kvw_subsys_t subsys, const char *fmt, ...)
{
    if (!kvw__log_enabled(level) || (unsigned)subsys >= KVW_SUB_COUNT)
        return;
    char stack[512], *heap;
    va_list ap;
    va_start(ap, fmt);
    const char *msg = format_message(stack, sizeof(stack), &heap, fmt, ap);
    va_end(ap);
    char *line = format_line(level, subsys, msg);
    const char *whole = line ? line : msg;

    pthread_mutex_lock(&log_lock);
    int fd = log_file_locked();
    if (fd >= 0)
        write_line(fd, whole);
    if (log_record_fn) {
        kvw_log_record_t rec = {.level = level,
                                .subsystem = subsys_names[subsys],
                                .engine = thread_engine ? thread_engine : "",
                                .msg = msg,
                                .line = whole};
        log_record_fn(log_arg, &rec);
    } else if (log_fn) {
        log_fn(log_arg, level, msg);
    } else if (fd < 0) {
        write_line(STDERR_FILENO, whole);
    }
    pthread_mutex_unlock(&log_lock);
    free(line);
    free(heap);
}
