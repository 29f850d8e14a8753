/* Config: one table drives defaults, environment overrides, validation and
 * printing, so adding a knob is one line. */
#include "common/config.h"
#include "common/log.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

typedef enum { FIELD_U8, FIELD_U32, FIELD_I32 } field_kind_t;

typedef struct config_field {
    const char *name;
    const char *env;
    size_t offset;
    field_kind_t kind;
    int64_t def, min, max;
} config_field_t;

#define FIELD(member, kind, def, min, max)                                                         \
    {#member, "KVW_" #member, offsetof(kvw_config_t, member), kind, def, min, max}

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
    FIELD(gid_index, FIELD_I32, -1, -1, 255),
    FIELD(ib_port, FIELD_U8, 1, 1, 255),
    FIELD(qp_timeout, FIELD_U8, 14, 1, 31),
    FIELD(qp_retry_cnt, FIELD_U8, 7, 0, 7),
    FIELD(qp_rnr_retry, FIELD_U8, 7, 0, 7),
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
    }
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

kvw_status_t kvw_config_init(kvw_config_t *cfg)
{
    if (!cfg)
        return KVW_ERR_INVALID;
    kvw_status_t status = KVW_OK;
    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        const config_field_t *f = &fields[i];
        char env[64];
        field_set(cfg, f, f->def);
        upcase_env(f, env, sizeof(env));
        const char *text = getenv(env);
        if (!text || !*text)
            continue;
        char *end;
        errno = 0;
        long long v = strtoll(text, &end, 10);
        if (errno || *end || v < f->min || v > f->max) {
            KVW_ERROR("config: %s='%s' is not an integer in [%" PRId64 ", %" PRId64
                      "]; keeping %" PRId64,
                      env, text, f->min, f->max, f->def);
            status = KVW_ERR_INVALID;
            continue;
        }
        field_set(cfg, f, v);
    }
    return status;
}

void kvw_config_print(const kvw_config_t *cfg, FILE *out)
{
    for (size_t i = 0; i < NUM_FIELDS; i++) {
        char env[64];
        upcase_env(&fields[i], env, sizeof(env));
        fprintf(out, "%-22s = %-8" PRId64 " (%s)\n", fields[i].name, field_get(cfg, &fields[i]),
                env);
    }
}

/* Internal: checks that relate fields to each other; used by the engine. */
kvw_status_t kvw__config_validate(const kvw_config_t *cfg)
{
    for (size_t i = 0; i < NUM_FIELDS; i++) {
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
    if (cfg->heartbeat_ms >= cfg->peer_timeout_ms) {
        KVW_ERROR("config: heartbeat_ms (%u) must be below peer_timeout_ms (%u), or a healthy "
                  "idle peer would be declared dead",
                  cfg->heartbeat_ms, cfg->peer_timeout_ms);
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}
