/* SPDX-License-Identifier: Apache-2.0 */
/* Config: one table drives defaults, environment overrides, validation and
 * printing, so adding a knob is one line. */
#include "common/config.h"
#include "common/log.h"
#include "common/sized.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum { FIELD_U8, FIELD_U32, FIELD_I32, FIELD_STR, FIELD_SECRET } field_kind_t;

typedef struct config_field {
    const char *name;
    const char *env;
    size_t offset;
    field_kind_t kind;
    int64_t def, min, max; /* text: max is the buffer size, NUL included; default "" */
} config_field_t;

#define FIELD(member, kind, def, min, max)                                                         \
    {                                                                                              \
#member, "KVW_" #member, offsetof(kvw_config_t, member), kind, def, min, max               \
    }
/* Text fields; FIELD_SECRET is never printed. */
#define TEXT(member, kind) FIELD(member, kind, 0, 0, sizeof(((kvw_config_t *)0)->member))

/* Env names are the upper-cased member names; see upcase_env() below. */
static const config_field_t fields[] = {
    FIELD(sq_depth, FIELD_U32, 512, 16, 16384),
    FIELD(rq_depth, FIELD_U32, 256, 16, 16384),
    FIELD(chain_max, FIELD_U32, 64, 1, 4096),
    FIELD(signal_every, FIELD_U32, 32, 1, 4096),
    FIELD(poll_spin_us, FIELD_U32, 50, 0, 1000000),
    FIELD(bootstrap_timeout_ms, FIELD_U32, 30000, 10, 3600000),
    FIELD(transfer_timeout_ms, FIELD_U32, 60000, 10, 3600000),
    FIELD(heartbeat_ms, FIELD_U32, 500, 10, 600000),
    FIELD(peer_timeout_ms, FIELD_U32, 2000, 50, 3600000),
    FIELD(idle_heartbeat_ms, FIELD_U32, 5000, 10, 600000),
    FIELD(bootstrap_refresh_ms, FIELD_U32, 5000, 50, 3600000),
    FIELD(max_peers, FIELD_U32, 256, 1, 65536),
    FIELD(orphan_ttl_ms, FIELD_U32, 30000, 10, 3600000),
    FIELD(max_orphans_per_peer, FIELD_U32, 1024, 0, 1u << 20),
    FIELD(max_orphan_mib_per_peer, FIELD_U32, 64, 0, 1u << 20),
    FIELD(gid_index, FIELD_I32, -1, -1, 255),
    FIELD(ib_port, FIELD_U8, 1, 1, 255),
    FIELD(qp_timeout, FIELD_U8, 14, 1, 31),
    FIELD(qp_retry_cnt, FIELD_U8, 7, 0, 7),
    FIELD(qp_rnr_retry, FIELD_U8, 7, 0, 7),
    TEXT(cluster_key_file, FIELD_STR),
    TEXT(cluster_key, FIELD_SECRET),
    FIELD(traffic_class, FIELD_U8, 0, 0, 255),
    FIELD(service_level, FIELD_U8, 0, 0, 15),
    FIELD(hop_limit, FIELD_U8, 255, 1, 255),
    FIELD(flow_label, FIELD_I32, -1, -1, 0xfffff),
    FIELD(ib_use_grh, FIELD_I32, -1, -1, 1),
    TEXT(gpu_path, FIELD_STR),
    FIELD(gpu_flush, FIELD_I32, -1, -1, 1),
    FIELD(gpu_relaxed_ordering, FIELD_I32, -1, -1, 1),
    FIELD(staging_mib, FIELD_U32, 256, 1, 1u << 20),
    FIELD(staging_chunk_kib, FIELD_U32, 4096, 64, 1u << 20),
    FIELD(staging_lanes, FIELD_U32, 2, 1, 4),
    FIELD(qps_per_peer, FIELD_U32, 1, 1, 16),
    FIELD(poll_busy_us, FIELD_U32, 0, 0, 1000000),
    FIELD(max_handshakes, FIELD_U32, 16, 1, 65536),
    FIELD(landing_mib, FIELD_U32, 64, 0, 1u << 20),
    TEXT(devices, FIELD_STR),
    FIELD(verify, FIELD_U32, 0, 0, 1),
};

#define NUM_FIELDS (sizeof(fields) / sizeof(fields[0]))

static void field_set(kvw_config_t *cfg, const config_field_t *f, int64_t v)
{
    char *p = (char *)cfg + f->offset;
    switch (f->kind) {
    case FIELD_U8:
        *(uint8_t *)p = (uint8_t)v;
        break;
    case FIELD_U32:
        *(uint32_t *)p = (uint32_t)v;
        break;
    case FIELD_I32:
        *(int32_t *)p = (int32_t)v;
        break;
    case FIELD_STR:
    case FIELD_SECRET:
        p[0] = '\0'; /* the only default text is "" */
        break;
    }
}

static bool is_text(const config_field_t *f)
{
    return f->kind == FIELD_STR || f->kind == FIELD_SECRET;
}

/* A text override: copied if it fits, else refused like a bad number. */
static kvw_status_t text_set(kvw_config_t *cfg, const config_field_t *f, const char *env,
                             const char *text)
{
    size_t n = strlen(text);
    if (n >= (size_t)f->max) {
        KVW_ERROR("config: %s refused: %zu characters, at most %" PRId64 " fit", env, n,
                  f->max - 1);
        return KVW_ERR_INVALID;
    }
    memcpy((char *)cfg + f->offset, text, n + 1);
    return KVW_OK;
}

static int64_t field_get(const kvw_config_t *cfg, const config_field_t *f)
{
    const char *p = (const char *)cfg + f->offset;
    switch (f->kind) {
    case FIELD_U8:
        return *(const uint8_t *)p;
    case FIELD_U32:
        return *(const uint32_t *)p;
    case FIELD_I32:
        return *(const int32_t *)p;
    case FIELD_STR:
    case FIELD_SECRET:
        return 0; /* text has no number */
    }
    return 0;
}

static void upcase_env(const config_field_t *f, char *buf, size_t size)
{
    size_t i;
    for (i = 0; f->env[i] && i + 1 < size; i++)
        buf[i] = (f->env[i] >= 'a' && f->env[i] <= 'z') ? (char)(f->env[i] - 32) : f->env[i];
    buf[i] = '\0';
}

/* The numbers an override may be written as: decimal, or hexadecimal after
 * 0x (the docs give some ranges in hex, e.g. KVW_FLOW_LABEL's -1..0xfffff),
 * with a '-' only where the range has negative values. Nothing else: no
 * sign on a positive, no spaces, no octal, no suffix. */
static bool parse_number(const char *text, const config_field_t *f, int64_t *out)
{
    const char *s = text;
    bool negative = *s == '-' && f->min < 0;
    if (negative)
        s++;
    int base = 10;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    if (!*s || !strchr(base == 16 ? "0123456789abcdefABCDEF" : "0123456789", *s))
        return false;
    char *end;
    errno = 0;
    unsigned long long magnitude = strtoull(s, &end, base);
    if (errno || *end || magnitude > (unsigned long long)INT64_MAX)
        return false;
    *out = negative ? -(int64_t)magnitude : (int64_t)magnitude;
    return true;
}

/* One field's override, or KVW_ERR_INVALID (logged once, naming the
 * variable, what it holds and what it accepts; the field keeps its default). */
static kvw_status_t field_override(kvw_config_t *cfg, const config_field_t *f, const char *env,
                                   const char *text)
{
    if (is_text(f))
        return text_set(cfg, f, env, text);
    int64_t v;
    if (!parse_number(text, f, &v) || v < f->min || v > f->max) {
        KVW_ERROR("config: %s='%s' refused: not an integer in [%" PRId64 ", %" PRId64
                  "] (decimal, or hex after 0x)",
                  env, text, f->min, f->max);
        return KVW_ERR_INVALID;
    }
    field_set(cfg, f, v);
    return KVW_OK;
}

/* This library's whole config: defaults, then the environment. A value
 * that does not parse, or environment values that disagree with each other
 * (chain_max over sq_depth / 2, ...), make it KVW_ERR_INVALID here, where
 * the variables are still known, not later at engine creation. */
static kvw_status_t config_fill(kvw_config_t *cfg)
{
    kvw_status_t status = KVW_OK;
    bool overridden = false;
    memset(cfg, 0, sizeof(*cfg));
    cfg->struct_size = sizeof(*cfg);
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        const config_field_t *f = &fields[i];
        char env[64];
        field_set(cfg, f, f->def);
        upcase_env(f, env, sizeof(env));
        const char *text = getenv(env);
        if (!text || !*text)
            continue;
        if (field_override(cfg, f, env, text))
            status = KVW_ERR_INVALID;
        overridden = true;
    }
    const char *level = getenv("KVW_LOG_LEVEL");
    if (level && *level && kvw__config_log_level(level) < 0) {
        KVW_ERROR("config: KVW_LOG_LEVEL='%s' refused: not one of error, warn (warning), info, "
                  "debug (trace, verbose)",
                  level);
        status = KVW_ERR_INVALID;
    }
    if (status == KVW_OK && overridden)
        status = kvw__config_validate(cfg); /* logged, naming the fields */
    return status;
}

int kvw__config_log_level(const char *name)
{
    static const struct {
        const char *name;
        kvw_log_level_t level;
    } names[] = {
        {"error", KVW_LOG_ERROR},   {"warn", KVW_LOG_WARN},   {"warning", KVW_LOG_WARN},
        {"info", KVW_LOG_INFO},     {"debug", KVW_LOG_DEBUG}, {"trace", KVW_LOG_DEBUG},
        {"verbose", KVW_LOG_DEBUG},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcasecmp(name, names[i].name) == 0)
            return (int)names[i].level;
    return -1;
}

kvw_status_t kvw_config_init_size(kvw_config_t *cfg, size_t size)
{
    if (!cfg || size < KVW__CONFIG_MIN_SIZE) {
        KVW_ERROR("kvw_config_init: %s",
                  cfg ? "size too small to hold struct_size" : "NULL config");
        return KVW_ERR_INVALID;
    }
    kvw__config_warn_unknown_env_once();
    kvw_config_t full;
    kvw_status_t status = config_fill(&full);
    /* A caller built against an older header gets the fields it knows; one
     * built against a newer header gets its unknown fields zeroed, which
     * this library accepts back (kvw__sized_read). */
    size_t n = size < sizeof(full) ? size : sizeof(full);
    memcpy(cfg, &full, n);
    if (size > n)
        memset((char *)cfg + n, 0, size - n);
    cfg->struct_size = size;
    return status;
}

void kvw_config_print(const kvw_config_t *in, FILE *out)
{
    kvw_config_t full;
    if (!in || kvw__config_read(in, &full))
        return; /* logged */
    const kvw_config_t *cfg = &full;
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        char env[64];
        upcase_env(&fields[i], env, sizeof(env));
        const char *text = (const char *)cfg + fields[i].offset;
        if (fields[i].kind == FIELD_SECRET)
            text = text[0] ? "(set, not shown)" : "-";
        else if (fields[i].kind == FIELD_STR && !text[0])
            text = "-";
        if (is_text(&fields[i]))
            fprintf(out, "%-22s = %-8s (%s)\n", fields[i].name, text, env);
        else
            fprintf(out, "%-22s = %-8" PRId64 " (%s)\n", fields[i].name, field_get(cfg, &fields[i]),
                    env);
    }
}

int kvw__config_gpu_path(const kvw_config_t *cfg)
{
    /* Same order as kvw_mem_path_t (mem/mem.h): host, dmabuf, peermem, staging. */
    static const char *const names[] = {"", "dmabuf", "peermem", "staging"};
    if (!memchr(cfg->gpu_path, '\0', sizeof(cfg->gpu_path)))
        return -2;
    if (!cfg->gpu_path[0] || strcmp(cfg->gpu_path, "auto") == 0)
        return -1;
    for (int i = 1; i < (int)(sizeof(names) / sizeof(names[0])); i++)
        if (strcmp(cfg->gpu_path, names[i]) == 0)
            return i;
    return -2;
}

/* Internal: checks that relate fields to each other; used by the engine. */
kvw_status_t kvw__config_validate(const kvw_config_t *cfg)
{
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        if (is_text(&fields[i])) {
            /* Unterminated text would be read past its buffer. */
            if (!memchr((const char *)cfg + fields[i].offset, '\0', (size_t)fields[i].max)) {
                KVW_ERROR("config: %s is not a terminated string", fields[i].name);
                return KVW_ERR_INVALID;
            }
            continue;
        }
        int64_t v = field_get(cfg, &fields[i]);
        if (v < fields[i].min || v > fields[i].max) {
            KVW_ERROR("config: %s=%" PRId64 " outside [%" PRId64 ", %" PRId64 "]", fields[i].name,
                      v, fields[i].min, fields[i].max);
            return KVW_ERR_INVALID;
        }
    }
    if (cfg->chain_max > cfg->sq_depth / 2 || cfg->signal_every > cfg->sq_depth / 2) {
        KVW_ERROR("config: chain_max (%u) and signal_every (%u) must be at most sq_depth/2 (%u)",
                  cfg->chain_max, cfg->signal_every, cfg->sq_depth / 2);
        return KVW_ERR_INVALID;
    }
    if (cfg->cluster_key[0] && cfg->cluster_key_file[0]) {
        KVW_ERROR("config: set either cluster_key (KVW_CLUSTER_KEY) or cluster_key_file "
                  "(KVW_CLUSTER_KEY_FILE), not both");
        return KVW_ERR_INVALID;
    }
    if (kvw__config_gpu_path(cfg) < -1) {
        KVW_ERROR("config: gpu_path (KVW_GPU_PATH) '%s' is not one of auto, dmabuf, peermem, "
                  "staging",
                  cfg->gpu_path);
        return KVW_ERR_INVALID;
    }
    if (cfg->heartbeat_ms >= cfg->peer_timeout_ms) {
        KVW_ERROR("config: heartbeat_ms (%u) must be below peer_timeout_ms (%u), or a healthy "
                  "idle peer would be declared dead",
                  cfg->heartbeat_ms, cfg->peer_timeout_ms);
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}

bool kvw__config_devices_near(const char *list)
{
    return strcmp(list, KVW_CONFIG_DEVICES_NEAR) == 0;
}

/* KVW_DEVICES: split the comma-separated names into names[] (at most
 * KVW_CONFIG_MAX_DEVICES, none twice). The count, or -1 (logged) when the list
 * is malformed. */

int kvw__config_devices(const char *list, char names[][KVW_CONFIG_DEVICE_NAME])
{
    int n = 0;
    if (kvw__config_devices_near(list))
        return 0; /* no names: the engine picks them (verbs/topo.h) */
    for (const char *s = list; *s;) {
        while (*s == ' ' || *s == ',')
            s++;
        size_t len = strcspn(s, ", ");
        if (!len)
            break;
        if (n == KVW_CONFIG_MAX_DEVICES || len >= KVW_CONFIG_DEVICE_NAME) {
            KVW_ERROR("KVW_DEVICES \"%s\": at most %d devices of at most 63 characters", list,
                      KVW_CONFIG_MAX_DEVICES);
            return -1;
        }
        memcpy(names[n], s, len);
        names[n][len] = '\0';
        if (!strcmp(names[n], KVW_CONFIG_DEVICES_NEAR)) {
            KVW_ERROR("KVW_DEVICES \"%s\": \"%s\" stands alone, not in a list of names", list,
                      KVW_CONFIG_DEVICES_NEAR);
            return -1;
        }
        for (int k = 0; k < n; k++)
            if (!strcmp(names[k], names[n])) {
                KVW_ERROR("KVW_DEVICES \"%s\" names %s twice", list, names[n]);
                return -1;
            }
        n++;
        s += len;
    }
    return n;
}

/* ------------------------------------------------ the KVW_* environment */

/* The variables the library reads itself, outside kvw_config_t
 * (scripts/check-config-doc.sh checks this list against the getenv() calls
 * in src/ and the doc's table). */
static const char *const library_vars[] = {
    "KVW_LOG_FILE",
    "KVW_LOG_LEVEL",
    "KVW_LOG_SUBSYS",
    "KVW_REGISTRY",
    "KVW_SYSFS_ROOT",
};

/* Prefixes (and whole names) of the variables the test bed, the tests and
 * the benchmarks read: never the library's, never warned about
 * (docs/configuration.md; check-config-doc.sh checks every KVW_* variable
 * that tests/, bench/, tools/ and scripts/ use is one of these or the
 * library's). */
static const char *const test_prefixes[] = {
    "KVW_TB_",    "KVW_TESTBED_",        "KVW_TEST_",   "KVW_TSAN_",     "KVW_CHAOS_",
    "KVW_SOAK_",  "KVW_BENCH_",          "KVW_STREAM_", "KVW_STORM_",    "KVW_ROOMS",
    "KVW_FUZZ_",  "KVW_MUTANT_",         "KVW_FLAP_",   "KVW_GPUCHECK_", "KVW_WRCOST_",
    "KVW_IDLE_S", "KVW_STAGING_TIMEOUT",
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* Optimal string alignment distance (Levenshtein plus adjacent swaps, so
 * KVW_SQ_DEPHT is one edit from KVW_SQ_DEPTH), as UCX suggests names. */
static size_t edit_distance(const char *a, size_t na, const char *b)
{
    enum { MAX = 64 };
    size_t nb = strlen(b);
    if (na >= MAX || nb >= MAX)
        return MAX;
    size_t d[MAX][MAX];
    for (size_t i = 0; i <= na; i++)
        d[i][0] = i;
    for (size_t j = 0; j <= nb; j++)
        d[0][j] = j;
    for (size_t i = 1; i <= na; i++)
        for (size_t j = 1; j <= nb; j++) {
            size_t cost = a[i - 1] != b[j - 1];
            size_t best = d[i - 1][j - 1] + cost;
            if (d[i - 1][j] + 1 < best)
                best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best)
                best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[na][nb];
}

static bool is_library_var(const char *name, size_t len)
{
    char env[64];
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        upcase_env(&fields[i], env, sizeof(env));
        if (strlen(env) == len && !memcmp(env, name, len))
            return true;
    }
    for (size_t i = 0; i < COUNT(library_vars); i++)
        if (strlen(library_vars[i]) == len && !memcmp(library_vars[i], name, len))
            return true;
    return false;
}

static bool is_test_var(const char *name, size_t len)
{
    for (size_t i = 0; i < COUNT(test_prefixes); i++) {
        size_t n = strlen(test_prefixes[i]);
        if (n <= len && !memcmp(test_prefixes[i], name, n))
            return true;
    }
    return false;
}

/* The library variable nearest to name, or NULL when none is near enough
 * to be what was meant. */
static const char *nearest_var(const char *name, size_t len, char *buf, size_t size)
{
    size_t best = (size_t)-1;
    const char *found = NULL;
    char env[64];
    for (size_t i = 0; i < NUM_FIELDS + COUNT(library_vars); i++) {
        const char *cand = env;
        if (i < NUM_FIELDS)
            upcase_env(&fields[i], env, sizeof(env));
        else
            cand = library_vars[i - NUM_FIELDS];
        size_t d = edit_distance(name, len, cand);
        if (d < best) {
            best = d;
            snprintf(buf, size, "%s", cand);
            found = buf;
        }
    }
    /* Within a third of the name after KVW_, and at least 2 edits. */
    size_t allowed = len > 4 ? (len - 4) / 3 : 0;
    return best <= (allowed > 2 ? allowed : 2) ? found : NULL;
}

int kvw__config_warn_unknown_env(char *const *envp)
{
    int unknown = 0;
    for (; envp && *envp; envp++) {
        const char *name = *envp;
        size_t len = strcspn(name, "=");
        if (len < 4 || memcmp(name, "KVW_", 4) != 0 || is_library_var(name, len) ||
            is_test_var(name, len))
            continue;
        char near[64];
        if (nearest_var(name, len, near, sizeof(near)))
            KVW_WARN("config: unknown variable %.*s ignored (did you mean %s?)", (int)len, name,
                     near);
        else
            KVW_WARN("config: unknown variable %.*s ignored (not a kvwire variable; "
                     "docs/configuration.md lists them)",
                     (int)len, name);
        unknown++;
    }
    return unknown;
}

extern char **environ;

static void warn_unknown_environ(void)
{
    (void)kvw__config_warn_unknown_env(environ);
}

void kvw__config_warn_unknown_env_once(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, warn_unknown_environ);
}

/* Appends "NAME=value" for one set variable; false once buf is full. */
static bool summary_add(char *buf, size_t size, size_t *used, const char *name, const char *value)
{
    int n = snprintf(buf + *used, size - *used, "%s%s=%s", *used ? " " : "", name, value);
    if (n < 0 || (size_t)n >= size - *used) {
        buf[*used] = '\0';
        return false;
    }
    *used += (size_t)n;
    return true;
}

void kvw__config_env_summary(char *buf, size_t size)
{
    size_t used = 0;
    bool full = false;
    char env[64];
    buf[0] = '\0';
    for (size_t i = 0; !full && i < NUM_FIELDS + COUNT(library_vars); i++) {
        const char *name = env;
        bool secret = false;
        if (i < NUM_FIELDS) {
            upcase_env(&fields[i], env, sizeof(env));
            secret = fields[i].kind == FIELD_SECRET;
        } else {
            name = library_vars[i - NUM_FIELDS];
        }
        const char *value = getenv(name);
        if (value && *value)
            full = !summary_add(buf, size, &used, name, secret ? "(set, not shown)" : value);
    }
    if (full && used + 5 < size)
        memcpy(buf + used, " ...", 5);
    else if (!used)
        snprintf(buf, size, "none");
}

kvw_status_t kvw_config_validate(const kvw_config_t *cfg)
{
    if (!cfg) {
        KVW_ERROR("kvw_config_validate: NULL config");
        return KVW_ERR_INVALID;
    }
    kvw_config_t full;
    kvw_status_t st = kvw__config_read(cfg, &full);
    return st ? st : kvw__config_validate(&full);
}
