/* SPDX-License-Identifier: Apache-2.0 */
/* The bootstrap service: a ROUTER socket on its own thread holding a
 * bounded rank -> (endpoint, owner, lease) table, plus prefill's registrar.
 * Lookups are made asynchronously by the decode engine's control thread.
 *
 * The service thread sleeps in a blocking receive until a message comes or
 * the service is destroyed: no timer. Leases are judged lazily, when a
 * REGISTER or LOOKUP touches the rank. */
#include "ctrl/bootstrap.h"

#include "common/clock.h"
#include "common/log.h"
#include "common/sized.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    MAX_RANKS = 4096,
    DROP_LOG_NS = 1000000000, /* at most one line a second about dropped messages */
    UNREGISTER_LINGER_MS = 250,
    REGISTRAR_HWM = 2, /* REGISTERs queued while the service is away: older ones are moot */
};

typedef struct bs_entry {
    char endpoint[KVW_WIRE_ENDPOINT_MAX]; /* "" = free */
    uint64_t owner;                       /* engine id of the registrant */
    uint64_t expires_ns;                  /* lease end, refreshed by the owner */
    uint64_t last_refused;                /* claimer refused last, to log each once */
} bs_entry_t;

struct kvw_bootstrap {
    void *zctx, *sock;
    kvw_zsecurity_t *sec;
    pthread_t thread;
    uint64_t lease_ns;
    char addr[KVW_WIRE_ENDPOINT_MAX];
    /* Only the service thread touches these (and destroy, after joining). */
    bs_entry_t *table;
    kvw_ratelog_t drop_log;
    char drop_reason[KVW_WIRE_REASON_MAX];
};

/* ------------------------------------------------------------- service */

/* Say how many messages were dropped since the last line, at most once a
 * second (force: now, e.g. at shutdown). */
static void log_drops(const kvw_bootstrap_t *b, uint64_t drops)
{
    if (drops)
        KVW_WARN("bootstrap: dropped %" PRIu64 " malformed message(s) (latest: %s)", drops,
                 b->drop_reason);
}

static void flush_drops(kvw_bootstrap_t *b, uint64_t now, bool force)
{
    log_drops(b, kvw__ratelog_flush(&b->drop_log, now, DROP_LOG_NS, force));
}

static void note_drop(kvw_bootstrap_t *b, uint64_t now, const char *why)
{
    snprintf(b->drop_reason, sizeof(b->drop_reason), "%s", why);
    log_drops(b, kvw__ratelog_hit(&b->drop_log, now, DROP_LOG_NS));
}

static bool lease_live(const bs_entry_t *e, uint64_t now)
{
    return e->endpoint[0] && now < e->expires_ns;
}

/* "tcp://10.0.0.1:5555" and "tcp://10.0.0.1:6000" are on the same host. */
static bool same_host(const char *a, const char *b)
{
    const char *ca = strrchr(a, ':'), *cb = strrchr(b, ':');
    return ca && cb && ca - a == cb - b && strncmp(a, b, (size_t)(ca - a)) == 0;
}

static int32_t on_register(kvw_bootstrap_t *b, const kvw_msg_t *in, uint64_t now)
{
    if (!in->u.bs.endpoint[0])
        return KVW_ERR_INVALID;
    bs_entry_t *e = &b->table[in->u.bs.rank];
    uint64_t id = in->u.bs.engine_id;
    /* A prefill restarted on the same host (its predecessor crashed without
     * unregistering) takes its rank back at once; another host waits for
     * the lease, so a misconfigured rank elsewhere cannot steal a live one. */
    if (lease_live(e, now) && e->owner != id && !same_host(e->endpoint, in->u.bs.endpoint)) {
        if (e->last_refused != id)
            KVW_WARN("bootstrap: rank %u is held by engine %016" PRIx64 " at %s (lease %" PRIu64
                     " ms left); refused engine %016" PRIx64 " at %s",
                     in->u.bs.rank, e->owner, e->endpoint, (e->expires_ns - now) / 1000000, id,
                     in->u.bs.endpoint);
        e->last_refused = id;
        return KVW_ERR_EXISTS;
    }
    if (e->endpoint[0] && e->owner != id)
        KVW_INFO("bootstrap: rank %u: engine %016" PRIx64
                 " at %s takes over from engine %016" PRIx64 " at %s, whose lease ran out",
                 in->u.bs.rank, id, in->u.bs.endpoint, e->owner, e->endpoint);
    else if (e->owner != id || strcmp(e->endpoint, in->u.bs.endpoint) != 0)
        KVW_INFO("bootstrap: rank %u registered at %s by engine %016" PRIx64, in->u.bs.rank,
                 in->u.bs.endpoint, id);
    snprintf(e->endpoint, sizeof(e->endpoint), "%s", in->u.bs.endpoint);
    e->owner = id;
    e->expires_ns = now + b->lease_ns;
    e->last_refused = 0;
    return KVW_OK;
}

static void on_unregister(kvw_bootstrap_t *b, const kvw_msg_t *in)
{
    bs_entry_t *e = &b->table[in->u.bs.rank];
    if (e->endpoint[0] && e->owner == in->u.bs.engine_id) {
        KVW_INFO("bootstrap: rank %u unregistered by its engine %016" PRIx64 " (%s)", in->u.bs.rank,
                 e->owner, e->endpoint);
        memset(e, 0, sizeof(*e));
        return;
    }
    KVW_INFO("bootstrap: ignored UNREGISTER of rank %u from engine %016" PRIx64
             ", which does not hold it",
             in->u.bs.rank, in->u.bs.engine_id);
}

static int32_t on_lookup(kvw_bootstrap_t *b, const kvw_msg_t *in, kvw_msg_t *out, uint64_t now)
{
    bs_entry_t *e = &b->table[in->u.bs.rank];
    if (e->endpoint[0] && !lease_live(e, now)) {
        KVW_INFO("bootstrap: rank %u (engine %016" PRIx64 " at %s) was not refreshed for %" PRIu64
                 " ms: forgotten",
                 in->u.bs.rank, e->owner, e->endpoint,
                 (now - e->expires_ns + b->lease_ns) / 1000000);
        memset(e, 0, sizeof(*e));
    }
    if (!e->endpoint[0])
        return KVW_ERR_NOT_FOUND;
    snprintf(out->u.bs.endpoint, sizeof(out->u.bs.endpoint), "%s", e->endpoint);
    return KVW_OK;
}

static void handle(kvw_bootstrap_t *b, const void *id, size_t id_len, const kvw_msg_t *in,
                   uint64_t now)
{
    kvw_msg_t out;
    memset(&out, 0, sizeof(out));
    out.u.bs.rank = in->u.bs.rank;
    out.type = in->type == KVW_MSG_BS_REGISTER ? KVW_MSG_BS_REGISTER_ACK : KVW_MSG_BS_LOOKUP_REPLY;
    if (in->u.bs.rank >= MAX_RANKS) {
        if (in->type == KVW_MSG_BS_UNREGISTER)
            return;
        out.status = KVW_ERR_OUT_OF_RANGE;
    } else if (in->type == KVW_MSG_BS_REGISTER) {
        out.status = on_register(b, in, now);
    } else if (in->type == KVW_MSG_BS_UNREGISTER) {
        on_unregister(b, in);
        return; /* no reply */
    } else {
        out.status = on_lookup(b, in, &out, now);
    }
    kvw__zsend_to(b->sock, id, id_len, &out);
}

/* Receive the rest of a message into nothing. Returns how many frames. */
/* Decode exactly one body frame after the identity; false (with a reason)
 * for anything else, the whole message then consumed. */
static bool recv_body(kvw_bootstrap_t *b, kvw_msg_t *m, char *why, size_t why_size)
{
    if (!kvw__zmore(b->sock)) {
        snprintf(why, why_size, "an identity with no body");
        return false;
    }
    kvw_status_t st = kvw__zrecv(b->sock, m, ZMQ_DONTWAIT, why, why_size);
    if (st == KVW_ERR_NOT_FOUND)
        snprintf(why, why_size, "no body frame");
    return st == KVW_OK;
}

static bool is_bootstrap_request(uint16_t type)
{
    return type == KVW_MSG_BS_REGISTER || type == KVW_MSG_BS_LOOKUP ||
           type == KVW_MSG_BS_UNREGISTER;
}

/* One whole ROUTER message: identity, then one kvwire frame. False once
 * the context is shut down. */
static bool serve_one(kvw_bootstrap_t *b)
{
    zmq_msg_t id;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, b->sock, 0) < 0) {
        zmq_msg_close(&id);
        return errno != ETERM; /* EINTR: go on */
    }
    uint64_t now = kvw__now_ns();
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    if (!recv_body(b, &m, why, sizeof(why))) {
        note_drop(b, now, why);
    } else if (!is_bootstrap_request(m.type)) {
        snprintf(why, sizeof(why), "unexpected %s", kvw__wire_type_name(m.type));
        note_drop(b, now, why);
        kvw__wire_free(&m);
    } else {
        flush_drops(b, now, false);
        handle(b, zmq_msg_data(&id), zmq_msg_size(&id), &m, now);
        kvw__wire_free(&m);
    }
    zmq_msg_close(&id);
    return true;
}

static void *bootstrap_main(void *arg)
{
    kvw_bootstrap_t *b = arg;
    while (serve_one(b))
        ; /* blocks in zmq_msg_recv; kvw_bootstrap_destroy() makes it ETERM */
    return NULL;
}

/* "tcp://1.2.3.4:5678" -> "1.2.3.4:5678" */
static void strip_scheme(const char *endpoint, char *buf, size_t size)
{
    const char *p = strstr(endpoint, "://");
    snprintf(buf, size, "%s", p ? p + 3 : endpoint);
}

static kvw_status_t bind_service(kvw_bootstrap_t *b, const char *bind_addr)
{
    b->sock = kvw__zsocket_secure(b->zctx, ZMQ_ROUTER, 1000, b->sec);
    char ep[KVW_WIRE_ENDPOINT_MAX], last[KVW_WIRE_ENDPOINT_MAX];
    size_t last_len = sizeof(last);
    kvw__zendpoint(bind_addr, ep, sizeof(ep));
    /* ":0" means an ephemeral port, which zmq spells "*". */
    size_t n = strlen(ep);
    if (n > 2 && strcmp(ep + n - 2, ":0") == 0)
        strcpy(ep + n - 1, "*");
    if (!b->sock || zmq_bind(b->sock, ep) ||
        zmq_getsockopt(b->sock, ZMQ_LAST_ENDPOINT, last, &last_len)) {
        KVW_ERROR("bootstrap: cannot bind %s: %s", ep, zmq_strerror(errno));
        return KVW_ERR_CONTROL;
    }
    strip_scheme(last, b->addr, sizeof(b->addr));
    return KVW_OK;
}

static kvw_status_t start_service(kvw_bootstrap_t *b, const kvw_bootstrap_params_t *p,
                                  const kvw_config_t *cfg)
{
    b->lease_ns = kvw__ms_ns(p->lease_ms ? p->lease_ms : KVW_BOOTSTRAP_LEASE_MS);
    b->table = calloc(MAX_RANKS, sizeof(*b->table));
    b->zctx = zmq_ctx_new();
    if (!b->table || !b->zctx)
        return KVW_ERR_NO_MEMORY;
    kvw_status_t st = kvw__zsecurity_create(b->zctx, cfg, true, &b->sec);
    if (st || (st = bind_service(b, p->bind_addr)))
        return st;
    if (pthread_create(&b->thread, NULL, bootstrap_main, b))
        return KVW_ERR_NO_MEMORY;
    return KVW_OK;
}

static void free_service(kvw_bootstrap_t *b)
{
    if (b->sock)
        zmq_close(b->sock);
    kvw__zsecurity_destroy(b->sec);
    if (b->zctx)
        zmq_ctx_term(b->zctx);
    free(b->table);
    free(b);
}

kvw_status_t kvw_bootstrap_create(const kvw_bootstrap_params_t *in, kvw_bootstrap_t **bootstrap_p)
{
    kvw_bootstrap_params_t p = {0};
    kvw_config_t cfg;
    if (!in || !bootstrap_p ||
        kvw__sized_read("bootstrap params", &p, sizeof(p), KVW__BOOTSTRAP_PARAMS_MIN_SIZE, in))
        return KVW_ERR_INVALID;
    if (!p.bind_addr) {
        KVW_ERROR("bootstrap params: bind_addr is required");
        return KVW_ERR_INVALID;
    }
    if (kvw__config_read(p.config, &cfg))
        return KVW_ERR_INVALID; /* logged */
    kvw_bootstrap_t *b = calloc(1, sizeof(*b));
    if (!b)
        return KVW_ERR_NO_MEMORY;
    kvw_status_t st = start_service(b, &p, &cfg);
    if (st) {
        free_service(b);
        return st;
    }
    KVW_INFO("bootstrap service listening on %s%s", b->addr,
             b->sec ? " (CURVE: cluster key required)" : "");
    *bootstrap_p = b;
    return KVW_OK;
}

const char *kvw_bootstrap_addr(const kvw_bootstrap_t *bootstrap)
{
    return bootstrap->addr;
}

void kvw_bootstrap_destroy(kvw_bootstrap_t *b)
{
    if (!b)
        return;
    /* Makes the thread's blocking receive (and the ZAP handler's poll)
     * return ETERM now. */
    zmq_ctx_shutdown(b->zctx);
    pthread_join(b->thread, NULL);
    flush_drops(b, kvw__now_ns(), true);
    free_service(b);
}

/* ----------------------------------------------------------- registrar */

struct kvw_registrar {
    void *sock;
    char addr[KVW_WIRE_ENDPOINT_MAX], endpoint[KVW_WIRE_ENDPOINT_MAX];
    uint32_t rank;
    uint64_t engine_id, refresh_ns, next_ns;
    kvw_status_t last; /* the service's last answer; NOT_FOUND before any */
};

kvw_status_t kvw__registrar_create(void *zctx, const kvw_zsecurity_t *sec,
                                   const char *bootstrap_addr, uint32_t rank, const char *endpoint,
                                   uint64_t engine_id, uint32_t refresh_ms,
                                   kvw_registrar_t **registrar_p)
{
    if (!bootstrap_addr || !endpoint || !refresh_ms || !registrar_p)
        return KVW_ERR_INVALID;
    kvw_registrar_t *r = calloc(1, sizeof(*r));
    if (!r)
        return KVW_ERR_NO_MEMORY;
    snprintf(r->addr, sizeof(r->addr), "%s", bootstrap_addr);
    snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    r->rank = rank;
    r->engine_id = engine_id;
    r->refresh_ns = kvw__ms_ns(refresh_ms);
    r->last = KVW_ERR_NOT_FOUND;
    char ep[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(bootstrap_addr, ep, sizeof(ep));
    /* Heartbeats at the refresh interval: a service host that vanishes is
     * noticed and redialled within a few intervals. */
    r->sock = kvw__zsocket_secure(zctx, ZMQ_DEALER, refresh_ms, sec);
    int hwm = REGISTRAR_HWM;
    if (!r->sock || zmq_setsockopt(r->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm)) ||
        zmq_connect(r->sock, ep)) {
        KVW_ERROR("cannot connect to bootstrap %s: %s", bootstrap_addr, zmq_strerror(errno));
        kvw__registrar_destroy(r, false);
        return KVW_ERR_CONTROL;
    }
    *registrar_p = r;
    return KVW_OK;
}

static kvw_status_t send_bs(kvw_registrar_t *r, uint16_t type)
{
    kvw_msg_t m = {.type = type};
    m.u.bs.rank = r->rank;
    m.u.bs.engine_id = r->engine_id;
    if (type == KVW_MSG_BS_REGISTER)
        snprintf(m.u.bs.endpoint, sizeof(m.u.bs.endpoint), "%s", r->endpoint);
    return kvw__zsend(r->sock, &m, ZMQ_DONTWAIT);
}

/* Record one answer; log a change of heart once. */
static void take_ack(kvw_registrar_t *r, kvw_status_t st)
{
    if (st != KVW_OK && st != r->last)
        KVW_WARN("bootstrap %s refused rank %u for this engine (%016" PRIx64 " at %s): %s", r->addr,
                 r->rank, r->engine_id, r->endpoint, kvw_strerror(st));
    else if (st == KVW_OK && r->last != KVW_OK && r->last != KVW_ERR_NOT_FOUND)
        KVW_WARN("bootstrap %s: rank %u is registered to this engine again", r->addr, r->rank);
    r->last = st;
}

/* One pending answer: its status, KVW_ERR_NOT_FOUND when none waits, or
 * KVW_ERR_PROTOCOL for something that is not an answer (ignored). */
static kvw_status_t recv_ack(kvw_registrar_t *r)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    kvw_status_t st = kvw__zrecv(r->sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
    if (st == KVW_ERR_NOT_FOUND)
        return st;
    if (st || m.type != KVW_MSG_BS_REGISTER_ACK) {
        KVW_DEBUG("bootstrap %s: ignored a reply: %s", r->addr,
                  st ? why : kvw__wire_type_name(m.type));
        if (!st)
            kvw__wire_free(&m);
        return KVW_ERR_PROTOCOL;
    }
    return (kvw_status_t)m.status;
}

void kvw__registrar_on_readable(kvw_registrar_t *r)
{
    for (;;) {
        kvw_status_t st = recv_ack(r);
        if (st == KVW_ERR_NOT_FOUND)
            return;
        if (st != KVW_ERR_PROTOCOL)
            take_ack(r, st);
    }
}

uint64_t kvw__registrar_tick(kvw_registrar_t *r, uint64_t now_ns)
{
    if (now_ns < r->next_ns)
        return r->next_ns;
    /* Not sent (the service is away and the queue is full): the next
     * interval tries again; the queued REGISTERs go out on reconnection. */
    send_bs(r, KVW_MSG_BS_REGISTER);
    r->next_ns = now_ns + r->refresh_ns;
    return r->next_ns;
}

void *kvw__registrar_socket(const kvw_registrar_t *r)
{
    return r->sock;
}

kvw_status_t kvw__registrar_status(const kvw_registrar_t *r)
{
    return r->last;
}

/* Wait for one answer until deadline: its status, or KVW_ERR_TIMEOUT. */
static kvw_status_t wait_ack(kvw_registrar_t *r, uint64_t deadline)
{
    for (;;) {
        uint64_t now = kvw__now_ns();
        if (now >= deadline)
            return KVW_ERR_TIMEOUT;
        zmq_pollitem_t item = {r->sock, 0, ZMQ_POLLIN, 0};
        long ms = (long)((deadline - now + 999999) / 1000000);
        if (zmq_poll(&item, 1, ms) < 0 && errno != EINTR)
            return KVW_ERR_CONTROL;
        kvw_status_t st = recv_ack(r);
        if (st != KVW_ERR_NOT_FOUND && st != KVW_ERR_PROTOCOL)
            return st;
    }
}

/* The rank is held by another engine: worth waiting only as long as its
 * lease could still run out, i.e. if it is a dead predecessor. */
static kvw_status_t wait_for_lease(kvw_registrar_t *r, uint64_t deadline, uint64_t *give_up)
{
    uint64_t now = kvw__now_ns();
    if (!*give_up) {
        *give_up = now + kvw__ms_ns(KVW_BOOTSTRAP_LEASE_MS) + r->refresh_ns;
        KVW_INFO("bootstrap %s: rank %u is held by another engine; retrying until its lease "
                 "runs out",
                 r->addr, r->rank);
    }
    if (now >= *give_up || now + r->refresh_ns / 4 >= deadline)
        return KVW_ERR_EXISTS;
    uint64_t pause = r->refresh_ns / 4;
    struct timespec ts = {(time_t)(pause / 1000000000u), (long)(pause % 1000000000u)};
    nanosleep(&ts, NULL);
    return KVW_OK;
}

kvw_status_t kvw__registrar_register(kvw_registrar_t *r, uint32_t timeout_ms)
{
    uint64_t deadline = kvw__now_ns() + kvw__ms_ns(timeout_ms), give_up = 0;
    kvw_status_t st;
    for (;;) {
        st = send_bs(r, KVW_MSG_BS_REGISTER);
        if (st == KVW_OK)
            st = wait_ack(r, deadline);
        /* A retry's answer can miss the deadline on a loaded host; the last
         * answer we had (a live holder) is still the truth, not "no answer". */
        if (st == KVW_ERR_TIMEOUT && give_up)
            st = KVW_ERR_EXISTS;
        if (st != KVW_ERR_EXISTS || wait_for_lease(r, deadline, &give_up) != KVW_OK)
            break;
    }
    r->last = st == KVW_ERR_TIMEOUT ? KVW_ERR_NOT_FOUND : st;
    r->next_ns = kvw__now_ns() + r->refresh_ns;
    if (st == KVW_ERR_EXISTS)
        KVW_ERROR("cannot register rank %u with bootstrap %s: another live engine holds it",
                  r->rank, r->addr);
    else if (st == KVW_ERR_TIMEOUT)
        KVW_ERROR("cannot register rank %u with bootstrap %s: no answer within %u ms (is it "
                  "running, and does it use the same cluster key?)",
                  r->rank, r->addr, timeout_ms);
    else if (st)
        KVW_ERROR("cannot register rank %u with bootstrap %s: %s", r->rank, r->addr,
                  kvw_strerror(st));
    return st;
}

void kvw__registrar_destroy(kvw_registrar_t *r, bool unregister)
{
    if (!r)
        return;
    if (r->sock && unregister) {
        /* Decode engines stop finding us at once instead of after a lease;
         * the linger bounds how long zmq_ctx_term waits when it cannot go. */
        int linger = UNREGISTER_LINGER_MS;
        zmq_setsockopt(r->sock, ZMQ_LINGER, &linger, sizeof(linger));
        send_bs(r, KVW_MSG_BS_UNREGISTER);
    }
    if (r->sock)
        zmq_close(r->sock);
    free(r);
}

kvw_status_t kvw__bootstrap_register_as(void *zctx, const kvw_zsecurity_t *sec,
                                        const char *bootstrap_addr, uint32_t rank,
                                        const char *endpoint, uint64_t engine_id,
                                        uint32_t timeout_ms)
{
    kvw_registrar_t *r;
    kvw_status_t st = kvw__registrar_create(zctx, sec, bootstrap_addr, rank, endpoint, engine_id,
                                            KVW_BOOTSTRAP_REFRESH_MS, &r);
    if (st)
        return st;
    st = kvw__registrar_register(r, timeout_ms);
    kvw__registrar_destroy(r, false);
    return st;
}
