/* The bootstrap service: a ROUTER socket on its own thread holding a small
 * rank -> endpoint table, plus the client side of registration. Lookups are
 * made asynchronously by the decode engine's control thread. */
#include "ctrl/bootstrap.h"

#include "common/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_RANKS = 4096, POLL_MS = 100 };

struct kvw_bootstrap {
    void *zctx, *sock;
    pthread_t thread;
    atomic_bool stop;
    char addr[KVW_WIRE_ENDPOINT_MAX];
    /* rank -> endpoint; only the service thread touches it. */
    char (*endpoints)[KVW_WIRE_ENDPOINT_MAX];
};

static void handle(kvw_bootstrap_t *b, const void *id, size_t id_len, const kvw_msg_t *in)
{
    kvw_msg_t out;
    memset(&out, 0, sizeof(out));
    out.u.bs.rank = in->u.bs.rank;
    if (in->u.bs.rank >= MAX_RANKS) {
        out.type = in->type == KVW_MSG_BS_REGISTER ? KVW_MSG_BS_REGISTER_ACK
                                                   : KVW_MSG_BS_LOOKUP_REPLY;
        out.status = KVW_ERR_OUT_OF_RANGE;
    } else if (in->type == KVW_MSG_BS_REGISTER) {
        out.type = KVW_MSG_BS_REGISTER_ACK;
        snprintf(b->endpoints[in->u.bs.rank], KVW_WIRE_ENDPOINT_MAX, "%s", in->u.bs.endpoint);
        KVW_INFO("bootstrap: rank %u registered at %s", in->u.bs.rank, in->u.bs.endpoint);
    } else {
        out.type = KVW_MSG_BS_LOOKUP_REPLY;
        const char *ep = b->endpoints[in->u.bs.rank];
        out.status = ep[0] ? KVW_OK : KVW_ERR_NOT_FOUND;
        snprintf(out.u.bs.endpoint, sizeof(out.u.bs.endpoint), "%s", ep);
    }
    kvw__zsend_to(b->sock, id, id_len, &out);
}

/* One ROUTER message: identity frame, then one kvwire frame. */
static void serve_one(kvw_bootstrap_t *b)
{
    uint8_t id[256];
    int id_len = zmq_recv(b->sock, id, sizeof(id), ZMQ_DONTWAIT);
    if (id_len < 0 || id_len > (int)sizeof(id))
        return;
    kvw_msg_t m;
    char why[160];
    kvw_status_t st = kvw__zrecv(b->sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
    if (st) {
        KVW_WARN("bootstrap: dropped a bad message: %s", why);
        return;
    }
    if (m.type == KVW_MSG_BS_REGISTER || m.type == KVW_MSG_BS_LOOKUP)
        handle(b, id, (size_t)id_len, &m);
    else
        KVW_WARN("bootstrap: unexpected %s", kvw__wire_type_name(m.type));
    kvw__wire_free(&m);
}

static void *bootstrap_main(void *arg)
{
    kvw_bootstrap_t *b = arg;
    while (!atomic_load(&b->stop)) {
        zmq_pollitem_t item = {b->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&item, 1, POLL_MS);
        if (n < 0 && errno == ETERM)
            break; /* kvw_bootstrap_destroy() shut the context down */
        if (n > 0)
            serve_one(b);
    }
    return NULL;
}

/* "tcp://1.2.3.4:5678" -> "1.2.3.4:5678" */
static void strip_scheme(const char *endpoint, char *buf, size_t size)
{
    const char *p = strstr(endpoint, "://");
    snprintf(buf, size, "%s", p ? p + 3 : endpoint);
}

kvw_status_t kvw_bootstrap_create(const char *bind_addr, kvw_bootstrap_t **bootstrap_p)
{
    if (!bind_addr || !bootstrap_p)
        return KVW_ERR_INVALID;
    kvw_bootstrap_t *b = calloc(1, sizeof(*b));
    if (!b)
        return KVW_ERR_NO_MEMORY;
    b->endpoints = calloc(MAX_RANKS, sizeof(*b->endpoints));
    b->zctx = zmq_ctx_new();
    kvw_status_t st = KVW_ERR_CONTROL;
    if (!b->endpoints || !b->zctx)
        goto fail;
    b->sock = kvw__zsocket(b->zctx, ZMQ_ROUTER, 1000);
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
        goto fail;
    }
    strip_scheme(last, b->addr, sizeof(b->addr));
    if (pthread_create(&b->thread, NULL, bootstrap_main, b)) {
        st = KVW_ERR_NO_MEMORY;
        goto fail;
    }
    KVW_INFO("bootstrap service listening on %s", b->addr);
    *bootstrap_p = b;
    return KVW_OK;
fail:
    if (b->sock)
        zmq_close(b->sock);
    if (b->zctx)
        zmq_ctx_term(b->zctx);
    free(b->endpoints);
    free(b);
    return st;
}

const char *kvw_bootstrap_addr(const kvw_bootstrap_t *bootstrap)
{
    return bootstrap->addr;
}

void kvw_bootstrap_destroy(kvw_bootstrap_t *b)
{
    if (!b)
        return;
    atomic_store(&b->stop, true);
    /* Makes the thread's zmq_poll return (ETERM) now, not at its next tick. */
    zmq_ctx_shutdown(b->zctx);
    pthread_join(b->thread, NULL);
    zmq_close(b->sock);
    zmq_ctx_term(b->zctx);
    free(b->endpoints);
    free(b);
}

kvw_status_t kvw__bootstrap_register(void *zctx, const char *bootstrap_addr, uint32_t rank,
                                     const char *endpoint, uint32_t timeout_ms)
{
    char ep[KVW_WIRE_ENDPOINT_MAX], why[160] = "no reply";
    kvw__zendpoint(bootstrap_addr, ep, sizeof(ep));
    void *s = kvw__zsocket(zctx, ZMQ_DEALER, 1000);
    if (!s)
        return KVW_ERR_CONTROL;
    kvw_msg_t m = {.type = KVW_MSG_BS_REGISTER};
    m.u.bs.rank = rank;
    snprintf(m.u.bs.endpoint, sizeof(m.u.bs.endpoint), "%s", endpoint);
    kvw_status_t st = KVW_ERR_CONTROL;
    if (zmq_connect(s, ep) == 0 && kvw__zsend(s, &m, 0) == KVW_OK) {
        zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
        st = KVW_ERR_TIMEOUT;
        kvw_msg_t ack;
        if (zmq_poll(&item, 1, (long)timeout_ms) > 0) {
            st = kvw__zrecv(s, &ack, ZMQ_DONTWAIT, why, sizeof(why));
            if (st == KVW_OK && (ack.type != KVW_MSG_BS_REGISTER_ACK || ack.status != KVW_OK)) {
                snprintf(why, sizeof(why), "bootstrap refused: %s",
                         kvw_strerror((kvw_status_t)ack.status));
                st = KVW_ERR_CONTROL;
            }
        }
    }
    if (st)
        KVW_ERROR("cannot register rank %u with bootstrap %s: %s (%s)", rank, bootstrap_addr,
                  kvw_strerror(st), why);
    zmq_close(s);
    return st;
}
