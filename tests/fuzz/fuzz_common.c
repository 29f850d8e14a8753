/* SPDX-License-Identifier: Apache-2.0 */
#include "fuzz/fuzz_common.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

size_t fuzz_split(const uint8_t *in, size_t len, fuzz_record_t *recs)
{
    size_t n = 0, off = 0;
    while (off < len && n < FUZZ_MAX_RECORDS) {
        uint8_t flags = in[off++];
        size_t want = 0;
        for (size_t i = 0; i < 2 && off < len; i++)
            want |= (size_t)in[off++] << (8 * i);
        size_t take = want < len - off ? want : len - off;
        recs[n++] = (fuzz_record_t){flags, in + off, take};
        off += take;
    }
    return n;
}

static bool selected(const fuzz_record_t *rec, fuzz_select_t which)
{
    return which == FUZZ_SEND_ALL || ((rec->flags & FUZZ_OTHER) != 0) == (which == FUZZ_SEND_OTHER);
}

/* The last record sent must not ask for more: a dangling multi-part
 * message would swallow the harness's own sync message as its next frame. */
static int frame_flags(const fuzz_record_t *recs, size_t i, size_t n, fuzz_select_t which)
{
    if (!(recs[i].flags & FUZZ_MORE))
        return 0;
    for (size_t j = i + 1; j < n; j++)
        if (selected(&recs[j], which))
            return ZMQ_SNDMORE;
    return 0;
}

void fuzz_send_records(void *sock, const void *id, size_t id_len, const fuzz_record_t *recs,
                       size_t n, fuzz_select_t which)
{
    bool in_message = false;
    for (size_t i = 0; i < n; i++) {
        if (!selected(&recs[i], which))
            continue;
        if (id && !in_message && zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
            return; /* queue full: the rest is lost, as on a congested link */
        int more = frame_flags(recs, i, n, which);
        if (zmq_send(sock, recs[i].data, recs[i].len, more | ZMQ_DONTWAIT) < 0)
            return;
        in_message = more != 0;
    }
}

void fuzz_send_msg(void *sock, const void *id, size_t id_len, const kvw_msg_t *m)
{
    uint8_t buf[4096];
    size_t len = 0;
    if (kvw__wire_encode(m, buf, sizeof(buf), &len))
        fuzz_die("harness: cannot encode a %s", kvw__wire_type_name(m->type));
    if (id && zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return;
    zmq_send(sock, buf, len, ZMQ_DONTWAIT);
}

/* Drop the frames left of the current message. */
static void skip_rest(void *sock)
{
    int more = 0;
    size_t len = sizeof(more);
    char sink[16];
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) == 0 && more)
        zmq_recv(sock, sink, sizeof(sink), 0);
}

static bool recv_one(void *sock, uint8_t *id, size_t *id_len_p, kvw_msg_t *m_p)
{
    if (id) {
        int n = zmq_recv(sock, id, 255, ZMQ_DONTWAIT);
        if (n < 0)
            return false;
        *id_len_p = (size_t)(n < 255 ? n : 255);
    }
    zmq_msg_t z;
    zmq_msg_init(&z);
    if (zmq_msg_recv(&z, sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&z);
        return false;
    }
    kvw_status_t st = kvw__wire_decode(zmq_msg_data(&z), zmq_msg_size(&z), m_p, NULL, 0);
    zmq_msg_close(&z);
    skip_rest(sock);
    return st == KVW_OK;
}

bool fuzz_recv_msg(void *sock, int timeout_ms, uint8_t *id, size_t *id_len_p, kvw_msg_t *m_p)
{
    uint64_t end = fuzz_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        if (recv_one(sock, id, id_len_p, m_p))
            return true;
        uint64_t now = fuzz_now_ms();
        if (now >= end)
            return false;
        zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, (long)(end - now)) < 0 && errno != EINTR)
            fuzz_die("harness: zmq_poll: %s", zmq_strerror(errno));
    }
}

static void drop_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    (void)msg;
}

void fuzz_quiet_log(void)
{
    const char *v = getenv("KVW_FUZZ_LOG");
    if (v && v[0] == '1')
        return;
    /* Still formatted up to WARN, so the rejection messages' format
     * arguments (peer-controlled strings and numbers) run under ASan. */
    kvw_set_log_handler(drop_log, NULL, KVW_LOG_WARN);
}

void fuzz_die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    abort();
}

uint64_t fuzz_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void *fuzz_socket(void *zctx, int type)
{
    void *s = zmq_socket(zctx, type);
    if (!s)
        fuzz_die("harness: zmq_socket: %s", zmq_strerror(errno));
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    return s;
}

void *fuzz_dealer(void *zctx, const void *id, size_t id_len, const char *endpoint, const char *what)
{
    void *s = fuzz_socket(zctx, ZMQ_DEALER);
    if ((id && zmq_setsockopt(s, ZMQ_ROUTING_ID, id, id_len)) || zmq_connect(s, endpoint))
        fuzz_die("harness: cannot connect to %s at %s: %s", what, endpoint,
                 zmq_strerror(zmq_errno()));
    return s;
}

bool fuzz_await(void *sock, int timeout_ms, bool (*match)(const kvw_msg_t *m, void *arg), void *arg)
{
    uint64_t end = fuzz_now_ms() + (uint64_t)timeout_ms;
    kvw_msg_t m;
    for (uint64_t now; (now = fuzz_now_ms()) < end;) {
        if (!fuzz_recv_msg(sock, (int)(end - now), NULL, NULL, &m))
            return false;
        bool done = match(&m, arg);
        kvw__wire_free(&m);
        if (done)
            return true;
    }
    return false;
}

bool fuzz_append_record(uint8_t *buf, size_t cap, size_t *len_p, uint8_t flags,
                        const kvw_msg_t *msg)
{
    size_t size = kvw__wire_size(msg), len = 0, at = *len_p;
    if (size > 0xffff || cap - at < FUZZ_RECORD_HEADER + size)
        return false;
    buf[at] = flags;
    buf[at + 1] = (uint8_t)size;
    buf[at + 2] = (uint8_t)(size >> 8);
    if (kvw__wire_encode(msg, buf + at + FUZZ_RECORD_HEADER, size, &len))
        return false;
    *len_p = at + FUZZ_RECORD_HEADER + len;
    return true;
}

void fuzz_region_shape(int i, uint64_t *item_p, uint64_t *items_p)
{
    *item_p = i == FUZZ_AUX_REGION     ? FUZZ_AUX_ITEM
              : i == FUZZ_MAMBA_REGION ? FUZZ_MAMBA_ITEM
                                       : FUZZ_ITEM;
    *items_p = i == FUZZ_AUX_REGION     ? FUZZ_AUX_ITEMS
               : i == FUZZ_MAMBA_REGION ? FUZZ_MAMBA_ITEMS
               : i == FUZZ_SWA_REGION   ? FUZZ_SWA_PAGES
                                        : FUZZ_PAGES;
}

void fuzz_hello(kvw_msg_t *m, uint16_t type, uint64_t engine_id, kvw_wire_region_t *regions)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    m->u.hello.engine_id = engine_id;
    /* No QP on the fake NIC has this number: writes towards it fail at
     * once (IBV_WC_RETRY_EXC_ERR), which kills the connection cleanly. */
    /* Decode offers two QPs; prefill (the harness engines take one) connects
     * no more than decode offered. */
    m->u.hello.num_qps = type == KVW_MSG_HELLO ? 2 : 1;
    m->u.hello.qps[0] = (kvw_qp_info_t){.qpn = 0xfff0f, .psn = 1, .mtu = 3, .link_layer = 2};
    m->u.hello.qps[1] = (kvw_qp_info_t){.qpn = 0xfff10, .psn = 2, .mtu = 3, .link_layer = 2};
    /* The harness engines' layout (fuzz_common.h). */
    m->u.hello.num_groups = FUZZ_GROUPS;
    m->u.hello.groups[0] = (kvw_wire_group_t){KVW_GROUP_KV, FUZZ_LAYERS, 2};
    m->u.hello.groups[1] = (kvw_wire_group_t){KVW_GROUP_AUX, 1, 1};
    m->u.hello.groups[2] = (kvw_wire_group_t){KVW_GROUP_STATE, 1, 1};
    m->u.hello.groups[3] = (kvw_wire_group_t){KVW_GROUP_STATE, 1, 1};
    m->u.hello.recv_credits = 16;
    m->u.hello.max_msg_sz = 1u << 20;
    for (int i = 0; i < FUZZ_REGIONS; i++) {
        uint64_t item, items;
        fuzz_region_shape(i, &item, &items);
        regions[i] = (kvw_wire_region_t){0x10000000ull * (uint64_t)(i + 1), item * items, item,
                                         0x100u + (uint32_t)i};
    }
    m->u.hello.regions = regions;
}
