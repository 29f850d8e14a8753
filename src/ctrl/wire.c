/* SPDX-License-Identifier: Apache-2.0 */
#include "ctrl/wire.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Header: magic u32, version u16, type u16, body length u32. */

typedef struct writer {
    uint8_t *p, *end;
    int overflow;
} writer_t;

typedef struct reader {
    const uint8_t *p, *end;
    int short_read;
} reader_t;

static void put(writer_t *w, const void *src, size_t n)
{
    if (w->overflow || (size_t)(w->end - w->p) < n) {
        w->overflow = 1;
        return;
    }
    memcpy(w->p, src, n);
    w->p += n;
}

static void put_le(writer_t *w, uint64_t v, size_t n)
{
    uint8_t b[8];
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    put(w, b, n);
}

/* cap is the receiving buffer's size: strings must leave room for a NUL. */
static void put_str(writer_t *w, const char *s, size_t cap)
{
    size_t n = strnlen(s, cap);
    if (n >= cap) {
        w->overflow = 1;
        return;
    }
    put_le(w, n, 2);
    put(w, s, n);
}

static int take(reader_t *r, void *dst, size_t n)
{
    if (r->short_read || (size_t)(r->end - r->p) < n) {
        r->short_read = 1;
        return 0;
    }
    memcpy(dst, r->p, n);
    r->p += n;
    return 1;
}

static uint64_t get_le(reader_t *r, size_t n)
{
    uint8_t b[8];
    uint64_t v = 0;
    if (!take(r, b, n))
        return 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static size_t remaining(const reader_t *r)
{
    return r->short_read ? 0 : (size_t)(r->end - r->p);
}

/* Strings: u16 length, bytes, no NUL inside, shorter than the buffer. */
static int get_str(reader_t *r, char *dst, size_t cap)
{
    size_t n = get_le(r, 2);
    if (r->short_read || n >= cap || n > remaining(r))
        return 0;
    take(r, dst, n);
    dst[n] = '\0';
    return strlen(dst) == n;
}

enum { QP_INFO_LEN = 4 + 4 + 2 + 1 + 1 + 16, REGION_LEN = 8 + 8 + 8 };

/* Rails a HELLO encodes: a message built without any (a refusal) has one. */
static uint32_t hello_rails(const kvw_msg_t *m)
{
    return m->u.hello.num_rails ? m->u.hello.num_rails : 1;
}

/* Bytes of one region entry: its addresses and one rkey per rail. */
static size_t region_len(const kvw_msg_t *m)
{
    return REGION_LEN + 4 * (size_t)hello_rails(m);
}

/* The version a message is written in. */
static uint16_t msg_version(const kvw_msg_t *m)
{
    return m->version ? m->version : KVW_WIRE_VERSION_BASE;
}

enum { OFFER_LEN = 2 + 2 + 4 }; /* wire 12: min, max, capabilities */

/* Wire 12: the bytes after a REQUEST's state lists (its decode receiver
 * count, with KVW_WIRE_REQ_RECEIVERS). */
static size_t request_trailer(const kvw_msg_t *m)
{
    return m->u.request.heads_flags & KVW_WIRE_REQ_RECEIVERS ? 4 : 0;
}

/* Whether a HELLO or HELLO_ACK carries its offer as the reason string: a
 * version-11 message that offers one and is no refusal. */
static int offer_as_text(const kvw_msg_t *m)
{
    return msg_version(m) < 12 && m->status == KVW_OK && m->u.hello.offer.max;
}

/* The reason string a HELLO or HELLO_ACK encodes (into buf if it is the
 * offer). */
static const char *hello_reason(const kvw_msg_t *m, char buf[KVW_WIRE_REASON_MAX])
{
    if (!offer_as_text(m))
        return m->u.hello.reason;
    snprintf(buf, KVW_WIRE_REASON_MAX, KVW_WIRE_OFFER_TEXT "%u..%u caps 0x%08x",
             m->u.hello.offer.min, m->u.hello.offer.max, m->u.hello.offer.caps);
    return buf;
}

static void put_qp(writer_t *w, const kvw_qp_info_t *q)
{
    put_le(w, q->qpn, 4);
    put_le(w, q->psn, 4);
    put_le(w, q->lid, 2);
    put_le(w, q->mtu, 1);
    put_le(w, q->link_layer, 1);
    put(w, q->gid, 16);
}

static void get_qp(reader_t *r, kvw_qp_info_t *q)
{
    q->qpn = (uint32_t)get_le(r, 4);
    q->psn = (uint32_t)get_le(r, 4);
    q->lid = (uint16_t)get_le(r, 2);
    q->mtu = (uint8_t)get_le(r, 1);
    q->link_layer = (uint8_t)get_le(r, 1);
    take(r, q->gid, 16);
}

uint64_t kvw__wire_hello_regions(const kvw_msg_t *m)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < m->u.hello.num_groups && i < KVW_WIRE_MAX_GROUPS; i++)
        n += (uint64_t)m->u.hello.groups[i].num_layers * m->u.hello.groups[i].per_layer;
    return m->u.hello.num_groups > KVW_WIRE_MAX_GROUPS ? UINT64_MAX : n;
}

static size_t hello_regions(const kvw_msg_t *m)
{
    return (size_t)kvw__wire_hello_regions(m);
}

enum { GROUP_LEN = 1 + 4 + 4 + 6 * 4, LANDING_LEN = 8 + 8 + 4 };

size_t kvw__wire_size(const kvw_msg_t *m)
{
    size_t body = 0;
    switch (m->type) {
    case KVW_MSG_BS_REGISTER:
        body = 4 + 4 + 8 + 2 + strnlen(m->u.bs.endpoint, KVW_WIRE_ENDPOINT_MAX);
        break;
    case KVW_MSG_BS_LOOKUP_REPLY:
        body = 4 + 4 + 2 + strnlen(m->u.bs.endpoint, KVW_WIRE_ENDPOINT_MAX);
        break;
    case KVW_MSG_BS_UNREGISTER:
        body = 4 + 4 + 8;
        break;
    case KVW_MSG_BS_LOOKUP:
    case KVW_MSG_BS_REGISTER_ACK:
        body = 4 + 4;
        break;
    case KVW_MSG_HELLO:
    case KVW_MSG_HELLO_ACK: {
        char text[KVW_WIRE_REASON_MAX];
        body = 4 + 8 + 4 + (size_t)m->u.hello.num_qps * QP_INFO_LEN + 4 +
               (size_t)m->u.hello.num_groups * GROUP_LEN + 4 + 4 + LANDING_LEN + 1 +
               m->u.hello.num_qps + 4 * (size_t)hello_rails(m) + 2 +
               strnlen(hello_reason(m, text), KVW_WIRE_REASON_MAX) +
               (msg_version(m) >= 12 ? OFFER_LEN : 0) + hello_regions(m) * region_len(m);
        break;
    }
    case KVW_MSG_REQUEST:
        body = 8 + 4 + 4 + 4 + 4 + KVW_WIRE_HEADS_LEN +
               8 * ((size_t)m->u.request.num_pages + m->u.request.num_state) + 4 +
               4 * (size_t)m->u.request.num_state_lists + request_trailer(m);
        break;
    case KVW_MSG_REQUEST_FAILED:
    case KVW_MSG_ABORT:
    case KVW_MSG_BYE:
    case KVW_MSG_CLOSING:
        body = 8 + 4 + 4 + 2 + strnlen(m->u.failed.reason, KVW_WIRE_REASON_MAX);
        break;
    case KVW_MSG_PING:
    case KVW_MSG_PONG:
        body = 8;
        break;
    case KVW_MSG_CREDIT:
        body = 4 + 8 * (size_t)m->u.credit.num_qps;
        break;
    case KVW_MSG_LANE_RESET:
    case KVW_MSG_LANE_READY:
    case KVW_MSG_LANE_DOWN:
    case KVW_MSG_LANE_UP:
        body = 4 + 4 + 4 + 8;
        break;
    case KVW_MSG_REPLAY_ASK:
    case KVW_MSG_REPLAY_ANSWER:
        body = 8 + 4 + 4 + 4;
        break;
    case KVW_MSG_DIGEST:
        body = 8 + 4 + 4 + 8;
        break;
    }
    return KVW_WIRE_HEADER_LEN + body;
}

static int type_known(uint16_t t)
{
    return (t >= KVW_MSG_BS_REGISTER && t <= KVW_MSG_BS_UNREGISTER) || t == KVW_MSG_HELLO ||
           t == KVW_MSG_HELLO_ACK || t == KVW_MSG_REQUEST || t == KVW_MSG_REQUEST_FAILED ||
           t == KVW_MSG_ABORT || t == KVW_MSG_PING || t == KVW_MSG_PONG || t == KVW_MSG_CREDIT ||
           t == KVW_MSG_BYE || t == KVW_MSG_LANE_RESET || t == KVW_MSG_LANE_READY ||
           t == KVW_MSG_REPLAY_ASK || t == KVW_MSG_REPLAY_ANSWER || t == KVW_MSG_LANE_DOWN ||
           t == KVW_MSG_LANE_UP || t == KVW_MSG_DIGEST || t == KVW_MSG_CLOSING;
}

static void encode_body(writer_t *w, const kvw_msg_t *m)
{
    switch (m->type) {
    case KVW_MSG_BS_REGISTER:
    case KVW_MSG_BS_LOOKUP_REPLY:
    case KVW_MSG_BS_LOOKUP:
    case KVW_MSG_BS_REGISTER_ACK:
    case KVW_MSG_BS_UNREGISTER:
        put_le(w, (uint32_t)m->status, 4);
        put_le(w, m->u.bs.rank, 4);
        if (m->type == KVW_MSG_BS_REGISTER || m->type == KVW_MSG_BS_UNREGISTER)
            put_le(w, m->u.bs.engine_id, 8);
        if (m->type == KVW_MSG_BS_REGISTER || m->type == KVW_MSG_BS_LOOKUP_REPLY)
            put_str(w, m->u.bs.endpoint, sizeof(m->u.bs.endpoint));
        break;
    case KVW_MSG_HELLO:
    case KVW_MSG_HELLO_ACK:
        put_le(w, (uint32_t)m->status, 4);
        put_le(w, m->u.hello.engine_id, 8);
        put_le(w, m->u.hello.num_qps, 4);
        for (uint32_t i = 0; i < m->u.hello.num_qps; i++)
            put_qp(w, &m->u.hello.qps[i]);
        put_le(w, m->u.hello.num_groups, 4);
        for (uint32_t i = 0; i < m->u.hello.num_groups; i++) {
            put_le(w, m->u.hello.groups[i].kind, 1);
            put_le(w, m->u.hello.groups[i].num_layers, 4);
            put_le(w, m->u.hello.groups[i].per_layer, 4);
            const kvw_wire_group_t *g = &m->u.hello.groups[i];
            const uint32_t heads[6] = {g->total_heads, g->first_head,  g->num_heads,
                                       g->head_bytes,  g->page_tokens, g->page_order};
            for (int k = 0; k < 6; k++)
                put_le(w, heads[k], 4);
        }
        put_le(w, m->u.hello.recv_credits, 4);
        put_le(w, m->u.hello.max_msg_sz, 4);
        /* wire 8: decode's landing buffer */
        put_le(w, m->u.hello.landing_addr, 8);
        put_le(w, m->u.hello.landing_len, 8);
        put_le(w, m->u.hello.landing_rkey, 4);
        /* wire 9: the sender's rails */
        put_le(w, hello_rails(m), 1);
        for (uint32_t i = 0; i < m->u.hello.num_qps; i++)
            put_le(w, m->u.hello.qp_rail[i], 1);
        for (uint32_t i = 0; i < hello_rails(m); i++)
            put_le(w, m->u.hello.rail_mbps[i], 4);
        char text[KVW_WIRE_REASON_MAX];
        put_str(w, hello_reason(m, text), sizeof(m->u.hello.reason));
        if (msg_version(m) >= 12) { /* wire 12: the offer */
            put_le(w, m->u.hello.offer.min, 2);
            put_le(w, m->u.hello.offer.max, 2);
            put_le(w, m->u.hello.offer.caps, 4);
        }
        for (size_t i = 0; i < hello_regions(m); i++) {
            const kvw_wire_region_t *g = &m->u.hello.regions[i];
            put_le(w, g->addr, 8);
            put_le(w, g->len, 8);
            put_le(w, g->item_len, 8);
            for (uint32_t k = 0; k < hello_rails(m); k++)
                put_le(w, kvw__wire_region_rkey(g, k), 4);
        }
        break;
    case KVW_MSG_REQUEST:
        put_le(w, m->u.request.room, 8);
        put_le(w, m->u.request.token, 4);
        put_le(w, m->u.request.aux_index, 4);
        put_le(w, m->u.request.num_pages, 4);
        put_le(w, m->u.request.num_state, 4);
        /* head range (wire 7) */
        put_le(w, m->u.request.heads_flags, 4);
        put_le(w, m->u.request.head_first, 4);
        put_le(w, m->u.request.head_count, 4);
        put_le(w, m->u.request.landing_off, 8); /* wire 8 */
        for (size_t i = 0; i < (size_t)m->u.request.num_pages + m->u.request.num_state; i++)
            put_le(w, m->u.request.pages[i], 8);
        /* Wire 6: the state lists. */
        put_le(w, m->u.request.num_state_lists, 4);
        for (uint32_t i = 0; i < m->u.request.num_state_lists; i++)
            put_le(w, m->u.request.state_counts[i], 4);
        if (request_trailer(m)) /* wire 12 */
            put_le(w, m->u.request.room_receivers, 4);
        break;
    case KVW_MSG_REQUEST_FAILED:
    case KVW_MSG_ABORT:
    case KVW_MSG_BYE:
    case KVW_MSG_CLOSING:
        put_le(w, m->u.failed.room, 8);
        put_le(w, m->u.failed.token, 4);
        put_le(w, (uint32_t)m->status, 4);
        put_str(w, m->u.failed.reason, sizeof(m->u.failed.reason));
        break;
    case KVW_MSG_PING:
    case KVW_MSG_PONG:
        put_le(w, m->u.ping.engine_id, 8);
        break;
    case KVW_MSG_CREDIT:
        put_le(w, m->u.credit.num_qps, 4);
        for (uint32_t i = 0; i < m->u.credit.num_qps; i++)
            put_le(w, m->u.credit.recvs_posted[i], 8);
        break;
    case KVW_MSG_LANE_RESET:
    case KVW_MSG_LANE_READY:
    case KVW_MSG_LANE_DOWN:
    case KVW_MSG_LANE_UP:
        put_le(w, m->u.lane.qp, 4);
        put_le(w, m->u.lane.psn, 4);
        put_le(w, m->u.lane.peer_psn, 4);
        put_le(w, m->u.lane.count, 8);
        break;
    case KVW_MSG_REPLAY_ASK:
    case KVW_MSG_REPLAY_ANSWER:
        put_le(w, m->u.replay.room, 8);
        put_le(w, m->u.replay.token, 4);
        put_le(w, m->u.replay.epoch, 4);
        put_le(w, m->u.replay.answer, 4);
        break;
    case KVW_MSG_DIGEST:
        put_le(w, m->u.digest.room, 8);
        put_le(w, m->u.digest.token, 4);
        put_le(w, m->u.digest.epoch, 4);
        put_le(w, m->u.digest.value, 8);
        break;
    }
}

static int state_lists_bad(const kvw_msg_t *m, char *reason, size_t rsize);
static int request_receivers_bad(const kvw_msg_t *m, char *reason, size_t rsize);

kvw_status_t kvw__wire_encode(const kvw_msg_t *m, uint8_t *buf, size_t cap, size_t *len_p)
{
    if (!type_known(m->type))
        return KVW_ERR_INVALID;
    if ((m->type == KVW_MSG_HELLO || m->type == KVW_MSG_HELLO_ACK) &&
        (m->u.hello.num_groups > KVW_WIRE_MAX_GROUPS || m->u.hello.num_qps > KVW_WIRE_MAX_QPS ||
         m->u.hello.num_rails > KVW_WIRE_MAX_RAILS ||
         kvw__wire_hello_regions(m) > KVW_WIRE_MAX_REGIONS))
        return KVW_ERR_INVALID;
    if (m->type == KVW_MSG_CREDIT && m->u.credit.num_qps > KVW_WIRE_MAX_QPS)
        return KVW_ERR_INVALID;
    if (msg_version(m) < KVW_WIRE_VERSION_MIN || msg_version(m) > KVW_WIRE_VERSION)
        return KVW_ERR_INVALID;
    if (m->type == KVW_MSG_REQUEST &&
        ((uint64_t)m->u.request.num_pages + m->u.request.num_state > KVW_WIRE_MAX_PAGES ||
         state_lists_bad(m, NULL, 0) || request_receivers_bad(m, NULL, 0)))
        return KVW_ERR_INVALID;
    size_t size = kvw__wire_size(m);
    if (size > cap || size > KVW_WIRE_MAX_MSG)
        return KVW_ERR_INVALID;
    writer_t w = {buf, buf + cap, 0};
    put_le(&w, KVW_WIRE_MAGIC, 4);
    put_le(&w, msg_version(m), 2);
    put_le(&w, m->type, 2);
    put_le(&w, size - KVW_WIRE_HEADER_LEN, 4);
    encode_body(&w, m);
    if (w.overflow || (size_t)(w.p - buf) != size)
        return KVW_ERR_INVALID;
    *len_p = size;
    return KVW_OK;
}

static kvw_status_t fail(char *reason, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static kvw_status_t fail(char *reason, size_t size, const char *fmt, ...)
{
    if (reason && size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(reason, size, fmt, ap);
        va_end(ap);
    }
    return KVW_ERR_PROTOCOL;
}

/* A version-11 offer, from the reason string: exactly the text
 * hello_reason() writes. 0, or -1 with why. */
static int parse_offer_text(kvw_msg_t *m, char *reason, size_t rsize)
{
    unsigned lo = 0, hi = 0, caps = 0;
    int end = 0;
    const char *text = m->u.hello.reason + strlen(KVW_WIRE_OFFER_TEXT);
    if (sscanf(text, "%5u..%5u caps 0x%8x%n", &lo, &hi, &caps, &end) != 3 || text[end] != '\0' ||
        lo > 0xffff || hi > 0xffff) {
        fail(reason, rsize, "%s: bad wire offer \"%.60s\"", kvw__wire_type_name(m->type),
             m->u.hello.reason);
        return -1;
    }
    m->u.hello.offer = (kvw_wire_offer_t){(uint16_t)lo, (uint16_t)hi, caps};
    /* Only the one spelling hello_reason() writes: the message must encode
     * back to the same bytes. */
    char canonical[KVW_WIRE_REASON_MAX];
    if (strcmp(hello_reason(m, canonical), m->u.hello.reason) != 0) {
        fail(reason, rsize, "%s: wire offer \"%.60s\" not in its one spelling",
             kvw__wire_type_name(m->type), m->u.hello.reason);
        return -1;
    }
    m->u.hello.reason[0] = '\0'; /* it was no reason */
    return 0;
}

/* The offer of a HELLO or HELLO_ACK that is no refusal: wire 12's fields,
 * or in a version-11 message its reason's text, or none (a 1.4.x peer;
 * kvw__wire_hello_offer() reads that as 11..11). It must name the
 * message's own version. 0, or -1 with why. */
static int decode_offer(reader_t *r, kvw_msg_t *m, char *reason, size_t rsize)
{
    kvw_wire_offer_t *o = &m->u.hello.offer;
    if (m->version >= 12) {
        o->min = (uint16_t)get_le(r, 2);
        o->max = (uint16_t)get_le(r, 2);
        o->caps = (uint32_t)get_le(r, 4);
    } else if (m->status == KVW_OK &&
               !strncmp(m->u.hello.reason, KVW_WIRE_OFFER_TEXT, strlen(KVW_WIRE_OFFER_TEXT))) {
        if (parse_offer_text(m, reason, rsize))
            return -1;
    }
    if (m->status == KVW_OK && o->max && (o->min > m->version || o->max < m->version)) {
        fail(reason, rsize, "%s of wire version %u offers versions %u..%u",
             kvw__wire_type_name(m->type), m->version, o->min, o->max);
        return -1;
    }
    return 0;
}

static kvw_status_t decode_hello(reader_t *r, kvw_msg_t *m, char *reason, size_t rsize)
{
    m->status = (int32_t)get_le(r, 4);
    m->u.hello.engine_id = get_le(r, 8);
    m->u.hello.num_qps = (uint32_t)get_le(r, 4);
    if (m->u.hello.num_qps > KVW_WIRE_MAX_QPS || (m->status == KVW_OK && !m->u.hello.num_qps))
        return fail(reason, rsize, "%s: %u QPs (1..%u)", kvw__wire_type_name(m->type),
                    m->u.hello.num_qps, KVW_WIRE_MAX_QPS);
    for (uint32_t i = 0; i < m->u.hello.num_qps; i++)
        get_qp(r, &m->u.hello.qps[i]);
    m->u.hello.num_groups = (uint32_t)get_le(r, 4);
    if (m->u.hello.num_groups > KVW_WIRE_MAX_GROUPS)
        return fail(reason, rsize, "%s: %u buffer groups, at most %u", kvw__wire_type_name(m->type),
                    m->u.hello.num_groups, KVW_WIRE_MAX_GROUPS);
    for (uint32_t i = 0; i < m->u.hello.num_groups; i++) {
        kvw_wire_group_t *g = &m->u.hello.groups[i];
        g->kind = (uint8_t)get_le(r, 1);
        g->num_layers = (uint32_t)get_le(r, 4);
        g->per_layer = (uint32_t)get_le(r, 4);
        uint32_t *heads[6] = {&g->total_heads, &g->first_head,  &g->num_heads,
                              &g->head_bytes,  &g->page_tokens, &g->page_order};
        for (int k = 0; k < 6; k++)
            *heads[k] = (uint32_t)get_le(r, 4);
        if (g->page_order > 1)
            return fail(reason, rsize, "%s: group %u: page order %u", kvw__wire_type_name(m->type),
                        i, g->page_order);
    }
    m->u.hello.recv_credits = (uint32_t)get_le(r, 4);
    m->u.hello.max_msg_sz = (uint32_t)get_le(r, 4);
    m->u.hello.landing_addr = get_le(r, 8);
    m->u.hello.landing_len = get_le(r, 8);
    m->u.hello.landing_rkey = (uint32_t)get_le(r, 4);
    m->u.hello.num_rails = (uint32_t)get_le(r, 1);
    if (!m->u.hello.num_rails || m->u.hello.num_rails > KVW_WIRE_MAX_RAILS)
        return fail(reason, rsize, "%s: %u rails (1..%u)", kvw__wire_type_name(m->type),
                    m->u.hello.num_rails, KVW_WIRE_MAX_RAILS);
    for (uint32_t i = 0; i < m->u.hello.num_qps; i++) {
        m->u.hello.qp_rail[i] = (uint8_t)get_le(r, 1);
        if (m->u.hello.qp_rail[i] >= m->u.hello.num_rails)
            return fail(reason, rsize, "%s: QP %u on rail %u of %u", kvw__wire_type_name(m->type),
                        i, m->u.hello.qp_rail[i], m->u.hello.num_rails);
    }
    for (uint32_t i = 0; i < m->u.hello.num_rails; i++)
        m->u.hello.rail_mbps[i] = (uint32_t)get_le(r, 4);
    if (r->short_read)
        return fail(reason, rsize, "%s truncated", kvw__wire_type_name(m->type));
    if (m->u.hello.landing_addr + m->u.hello.landing_len < m->u.hello.landing_addr)
        return fail(reason, rsize, "%s: landing buffer [0x%llx, +%llu) overflows",
                    kvw__wire_type_name(m->type), (unsigned long long)m->u.hello.landing_addr,
                    (unsigned long long)m->u.hello.landing_len);
    if (!get_str(r, m->u.hello.reason, sizeof(m->u.hello.reason)))
        return fail(reason, rsize, "%s: bad reason string", kvw__wire_type_name(m->type));
    if (decode_offer(r, m, reason, rsize))
        return KVW_ERR_PROTOCOL;
    /* QPNs and PSNs are 24-bit; MTU is an enum ibv_mtu (256..4096). A
     * refusal (HELLO_ACK with an error) carries no QP to check. */
    for (uint32_t i = 0; m->status == KVW_OK && i < m->u.hello.num_qps; i++) {
        const kvw_qp_info_t *q = &m->u.hello.qps[i];
        if (q->qpn > 0xffffff || q->psn > 0xffffff || q->mtu < 1 || q->mtu > 5 ||
            (q->link_layer != 1 && q->link_layer != 2))
            return fail(reason, rsize,
                        "%s: QP %u info out of range (qpn %u, psn %u, mtu %u, link %u)",
                        kvw__wire_type_name(m->type), i, q->qpn, q->psn, q->mtu, q->link_layer);
    }
    /* The planner splits writes at the smaller of the two ports' limits;
     * every port takes at least one MTU. */
    if (m->status == KVW_OK && m->u.hello.max_msg_sz < 4096)
        return fail(reason, rsize, "%s: max message size %u is below one MTU",
                    kvw__wire_type_name(m->type), m->u.hello.max_msg_sz);
    uint64_t n64 = kvw__wire_hello_regions(m);
    /* Bound counts by the bytes actually present before allocating. */
    if (n64 > KVW_WIRE_MAX_REGIONS || n64 * region_len(m) != remaining(r))
        return fail(reason, rsize, "%s: %u groups of %llu regions do not match %zu body bytes",
                    kvw__wire_type_name(m->type), m->u.hello.num_groups, (unsigned long long)n64,
                    remaining(r));
    size_t n = (size_t)n64;
    m->u.hello.regions = n ? calloc(n, sizeof(kvw_wire_region_t)) : NULL;
    if (n && !m->u.hello.regions)
        return KVW_ERR_NO_MEMORY;
    for (size_t i = 0; i < n; i++) {
        kvw_wire_region_t *g = &m->u.hello.regions[i];
        g->addr = get_le(r, 8);
        g->len = get_le(r, 8);
        g->item_len = get_le(r, 8);
        g->rkey = (uint32_t)get_le(r, 4);
        for (uint32_t k = 1; k < m->u.hello.num_rails; k++)
            g->rail_rkeys[k - 1] = (uint32_t)get_le(r, 4);
        if (!g->item_len || g->len % g->item_len || g->addr + g->len < g->addr) {
            unsigned long long len = g->len, item_len = g->item_len;
            free(m->u.hello.regions);
            m->u.hello.regions = NULL;
            return fail(reason, rsize, "region %zu: length %llu not a multiple of item %llu", i,
                        len, item_len);
        }
    }
    return KVW_OK;
}

/* Wire 6: REQUEST's state lists, at most one per group, their counts
 * summing to num_state. 0, or -1 with why. */
static int state_lists_bad(const kvw_msg_t *m, char *reason, size_t rsize)
{
    uint32_t n = m->u.request.num_state_lists;
    if (n > KVW_WIRE_MAX_GROUPS) {
        fail(reason, rsize, "REQUEST: %u state lists, at most %u", n, KVW_WIRE_MAX_GROUPS);
        return -1;
    }
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += m->u.request.state_counts[i];
    if (sum != m->u.request.num_state) {
        fail(reason, rsize, "REQUEST: state lists of %llu indices, %u state indices",
             (unsigned long long)sum, m->u.request.num_state);
        return -1;
    }
    return 0;
}

/* Wire 12: a decode receiver count only in a version-12 REQUEST, with
 * its flag, and 1..KVW_MAX_DECODE_RECEIVERS. 0, or -1 with why. */
static int request_receivers_bad(const kvw_msg_t *m, char *reason, size_t rsize)
{
    uint32_t n = m->u.request.room_receivers;
    if (!request_trailer(m)) {
        if (!n)
            return 0;
        fail(reason, rsize, "REQUEST: %u decode receivers without their flag", n);
        return -1;
    }
    if (msg_version(m) < 12) {
        fail(reason, rsize, "REQUEST: a decode receiver count in a version-%u message",
             msg_version(m));
        return -1;
    }
    if (!n || n > KVW_MAX_DECODE_RECEIVERS) {
        fail(reason, rsize, "REQUEST: %u decode receivers for the room, not 1..%u", n,
             KVW_MAX_DECODE_RECEIVERS);
        return -1;
    }
    return 0;
}

/* Wire 6: the state lists after the indices. */
static kvw_status_t decode_state_lists(reader_t *r, kvw_msg_t *m, char *reason, size_t rsize)
{
    m->u.request.num_state_lists = (uint32_t)get_le(r, 4);
    if (r->short_read || m->u.request.num_state_lists > KVW_WIRE_MAX_GROUPS ||
        remaining(r) != 4 * (size_t)m->u.request.num_state_lists + request_trailer(m))
        return fail(reason, rsize, "REQUEST: state lists do not match %zu body bytes",
                    remaining(r));
    for (uint32_t i = 0; i < m->u.request.num_state_lists; i++)
        m->u.request.state_counts[i] = (uint32_t)get_le(r, 4);
    if (request_trailer(m)) /* wire 12 */
        m->u.request.room_receivers = (uint32_t)get_le(r, 4);
    if (state_lists_bad(m, reason, rsize) || request_receivers_bad(m, reason, rsize))
        return KVW_ERR_PROTOCOL;
    return KVW_OK;
}

static kvw_status_t decode_request(reader_t *r, kvw_msg_t *m, char *reason, size_t rsize)
{
    m->u.request.room = get_le(r, 8);
    m->u.request.token = (uint32_t)get_le(r, 4);
    m->u.request.aux_index = (uint32_t)get_le(r, 4);
    m->u.request.num_pages = (uint32_t)get_le(r, 4);
    m->u.request.num_state = (uint32_t)get_le(r, 4);
    /* head range (wire 7) */
    m->u.request.heads_flags = (uint32_t)get_le(r, 4);
    m->u.request.head_first = (uint32_t)get_le(r, 4);
    m->u.request.head_count = (uint32_t)get_le(r, 4);
    m->u.request.landing_off = get_le(r, 8); /* wire 8 */
    if (r->short_read)
        return fail(reason, rsize, "REQUEST truncated");
    if (m->u.request.heads_flags & ~KVW_WIRE_HEADS_FLAGS)
        return fail(reason, rsize, "REQUEST: unknown head flags 0x%x", m->u.request.heads_flags);
    if (!(m->u.request.heads_flags & KVW_WIRE_HEADS_RANGE) &&
        (m->u.request.head_first || m->u.request.head_count))
        return fail(reason, rsize, "REQUEST: a head range without its flag");
    bool landing = m->u.request.heads_flags & KVW_WIRE_HEADS_LANDING;
    if (landing && (!(m->u.request.heads_flags & KVW_WIRE_HEADS_RANGE) || !m->u.request.head_count))
        return fail(reason, rsize, "REQUEST: landing without a head range");
    if (!landing && m->u.request.landing_off)
        return fail(reason, rsize, "REQUEST: a landing offset without its flag");
    if ((uint64_t)m->u.request.head_first + m->u.request.head_count > UINT32_MAX)
        return fail(reason, rsize, "REQUEST: head range [%u, +%u) overflows",
                    m->u.request.head_first, m->u.request.head_count);
    if (m->u.request.token & ~KVW_WIRE_TOKEN_MASK)
        return fail(reason, rsize, "REQUEST: token 0x%x has more than 28 bits", m->u.request.token);
    uint64_t n = (uint64_t)m->u.request.num_pages + m->u.request.num_state;
    if (n > KVW_WIRE_MAX_PAGES || n * 8 + 4 > remaining(r))
        return fail(reason, rsize, "REQUEST: %u pages + %u state do not match %zu body bytes",
                    m->u.request.num_pages, m->u.request.num_state, remaining(r));
    m->u.request.pages = n ? malloc((size_t)n * 8) : NULL;
    if (n && !m->u.request.pages)
        return KVW_ERR_NO_MEMORY;
    for (uint64_t i = 0; i < n; i++)
        m->u.request.pages[i] = get_le(r, 8);
    kvw_status_t st = decode_state_lists(r, m, reason, rsize);
    if (st) {
        free(m->u.request.pages);
        m->u.request.pages = NULL;
    }
    return st;
}

static kvw_status_t decode_body(reader_t *r, kvw_msg_t *m, char *reason, size_t rsize)
{
    switch (m->type) {
    case KVW_MSG_BS_REGISTER:
    case KVW_MSG_BS_LOOKUP_REPLY:
    case KVW_MSG_BS_LOOKUP:
    case KVW_MSG_BS_REGISTER_ACK:
    case KVW_MSG_BS_UNREGISTER:
        m->status = (int32_t)get_le(r, 4);
        m->u.bs.rank = (uint32_t)get_le(r, 4);
        if (m->type == KVW_MSG_BS_REGISTER || m->type == KVW_MSG_BS_UNREGISTER)
            m->u.bs.engine_id = get_le(r, 8);
        if ((m->type == KVW_MSG_BS_REGISTER || m->type == KVW_MSG_BS_LOOKUP_REPLY) &&
            !get_str(r, m->u.bs.endpoint, sizeof(m->u.bs.endpoint)))
            return fail(reason, rsize, "%s: bad endpoint string", kvw__wire_type_name(m->type));
        return KVW_OK;
    case KVW_MSG_HELLO:
    case KVW_MSG_HELLO_ACK:
        return decode_hello(r, m, reason, rsize);
    case KVW_MSG_REQUEST:
        return decode_request(r, m, reason, rsize);
    case KVW_MSG_REQUEST_FAILED:
    case KVW_MSG_ABORT:
    case KVW_MSG_BYE:
    case KVW_MSG_CLOSING:
        m->u.failed.room = get_le(r, 8);
        m->u.failed.token = (uint32_t)get_le(r, 4);
        m->status = (int32_t)get_le(r, 4);
        if (!get_str(r, m->u.failed.reason, sizeof(m->u.failed.reason)))
            return fail(reason, rsize, "%s: bad reason string", kvw__wire_type_name(m->type));
        /* A failure must say why: a status of OK would read as success. */
        if (m->status >= 0)
            return fail(reason, rsize, "%s: status %d is not an error",
                        kvw__wire_type_name(m->type), m->status);
        return KVW_OK;
    case KVW_MSG_PING:
    case KVW_MSG_PONG:
        m->u.ping.engine_id = get_le(r, 8);
        return KVW_OK;
    case KVW_MSG_CREDIT:
        m->u.credit.num_qps = (uint32_t)get_le(r, 4);
        if (!m->u.credit.num_qps || m->u.credit.num_qps > KVW_WIRE_MAX_QPS)
            return fail(reason, rsize, "CREDIT: %u QPs (1..%u)", m->u.credit.num_qps,
                        KVW_WIRE_MAX_QPS);
        for (uint32_t i = 0; i < m->u.credit.num_qps; i++)
            m->u.credit.recvs_posted[i] = get_le(r, 8);
        return KVW_OK;
    case KVW_MSG_LANE_RESET:
    case KVW_MSG_LANE_READY:
    case KVW_MSG_LANE_DOWN:
    case KVW_MSG_LANE_UP:
        m->u.lane.qp = (uint32_t)get_le(r, 4);
        m->u.lane.psn = (uint32_t)get_le(r, 4);
        m->u.lane.peer_psn = (uint32_t)get_le(r, 4);
        m->u.lane.count = get_le(r, 8);
        if (m->u.lane.qp >= KVW_WIRE_MAX_QPS)
            return fail(reason, rsize, "%s: QP %u (0..%u)", kvw__wire_type_name(m->type),
                        m->u.lane.qp, KVW_WIRE_MAX_QPS - 1);
        if (m->u.lane.psn > KVW_QPN_MASK || m->u.lane.peer_psn > KVW_QPN_MASK)
            return fail(reason, rsize, "%s: a PSN over 24 bits", kvw__wire_type_name(m->type));
        return KVW_OK;
    case KVW_MSG_REPLAY_ASK:
    case KVW_MSG_REPLAY_ANSWER:
        m->u.replay.room = get_le(r, 8);
        m->u.replay.token = (uint32_t)get_le(r, 4);
        m->u.replay.epoch = (uint32_t)get_le(r, 4);
        m->u.replay.answer = (uint32_t)get_le(r, 4);
        /* Only an attempt that another can follow is asked about: the
         * last epoch an immediate can carry is never replayed. */
        if (m->u.replay.token > KVW_WIRE_TOKEN_MASK || m->u.replay.epoch >= KVW_WIRE_IMM_EPOCH_MASK)
            return fail(reason, rsize, "%s: token 0x%x or epoch %u out of range (epoch < %u)",
                        kvw__wire_type_name(m->type), m->u.replay.token, m->u.replay.epoch,
                        KVW_WIRE_IMM_EPOCH_MASK);
        if (m->type == KVW_MSG_REPLAY_ASK ? m->u.replay.answer != 0
                                          : m->u.replay.answer < KVW_WIRE_REPLAY_AGAIN ||
                                                m->u.replay.answer > KVW_WIRE_REPLAY_GONE)
            return fail(reason, rsize, "%s: answer %u", kvw__wire_type_name(m->type),
                        m->u.replay.answer);
        return KVW_OK;
    case KVW_MSG_DIGEST:
        m->u.digest.room = get_le(r, 8);
        m->u.digest.token = (uint32_t)get_le(r, 4);
        m->u.digest.epoch = (uint32_t)get_le(r, 4);
        m->u.digest.value = get_le(r, 8); /* any value: decode compares it */
        if (m->u.digest.token > KVW_WIRE_TOKEN_MASK || m->u.digest.epoch > KVW_WIRE_IMM_EPOCH_MASK)
            return fail(reason, rsize, "DIGEST: token 0x%x or epoch %u out of range",
                        m->u.digest.token, m->u.digest.epoch);
        return KVW_OK;
    }
    return fail(reason, rsize, "unknown message type %u", m->type);
}

kvw_status_t kvw__wire_decode(const uint8_t *buf, size_t len, kvw_msg_t *m_p, char *reason,
                              size_t reason_size)
{
    kvw_msg_t m;
    memset(&m, 0, sizeof(m));
    if (len < KVW_WIRE_HEADER_LEN)
        return fail(reason, reason_size, "message of %zu bytes is shorter than the header", len);
    reader_t r = {buf, buf + len, 0};
    uint32_t magic = (uint32_t)get_le(&r, 4);
    uint16_t version = (uint16_t)get_le(&r, 2);
    m.type = (uint16_t)get_le(&r, 2);
    uint32_t body = (uint32_t)get_le(&r, 4);
    if (magic != KVW_WIRE_MAGIC)
        return fail(reason, reason_size, "bad magic 0x%08x (not a kvwire peer?)", magic);
    if (version < KVW_WIRE_VERSION_MIN || version > KVW_WIRE_VERSION)
        return fail(reason, reason_size, "peer speaks wire version %u, we speak %u..%u", version,
                    KVW_WIRE_VERSION_MIN, KVW_WIRE_VERSION);
    m.version = version;
    if (!type_known(m.type))
        return fail(reason, reason_size, "unknown message type %u", m.type);
    if (body != len - KVW_WIRE_HEADER_LEN || len > KVW_WIRE_MAX_MSG)
        return fail(reason, reason_size, "%s: header says %u body bytes, got %zu",
                    kvw__wire_type_name(m.type), body, len - KVW_WIRE_HEADER_LEN);
    kvw_status_t st = decode_body(&r, &m, reason, reason_size);
    if (st)
        return st;
    if (r.short_read || remaining(&r) != 0) {
        kvw__wire_free(&m);
        return fail(reason, reason_size, "%s: %s", kvw__wire_type_name(m.type),
                    r.short_read ? "truncated" : "trailing bytes");
    }
    *m_p = m;
    return KVW_OK;
}

void kvw__wire_free(kvw_msg_t *m)
{
    if (!m)
        return;
    if (m->type == KVW_MSG_HELLO || m->type == KVW_MSG_HELLO_ACK) {
        free(m->u.hello.regions);
        m->u.hello.regions = NULL;
    } else if (m->type == KVW_MSG_REQUEST) {
        free(m->u.request.pages);
        m->u.request.pages = NULL;
    }
}

const char *kvw__wire_request_lacks(const kvw_msg_t *m, uint32_t caps)
{
    uint32_t flags = m->u.request.heads_flags;
    if (flags & KVW_WIRE_REQ_VERIFY && !(caps & KVW_WIRE_CAP_VERIFY))
        return "verify";
    if (flags & KVW_WIRE_HEADS_LANDING && !(caps & KVW_WIRE_CAP_LANDING))
        return "landing buffer";
    if (flags & KVW_WIRE_HEADS_RANGE && !(caps & KVW_WIRE_CAP_HEADS))
        return "head slicing";
    if (flags & KVW_WIRE_REQ_RECEIVERS && !(caps & KVW_WIRE_CAP_FANOUT))
        return "the decode receiver count";
    return NULL;
}

kvw_status_t kvw__wire_agree(const kvw_wire_offer_t *ours, const kvw_wire_offer_t *theirs,
                             const char *our_role, const char *their_role, kvw_wire_offer_t *agreed,
                             char *why, size_t why_size)
{
    uint16_t lo = ours->min > theirs->min ? ours->min : theirs->min;
    uint16_t hi = ours->max < theirs->max ? ours->max : theirs->max;
    if (lo > hi || !hi) {
        snprintf(why, why_size, "no common wire version: %s speaks %u..%u, %s %u..%u", our_role,
                 ours->min, ours->max, their_role, theirs->min, theirs->max);
        return KVW_ERR_MISMATCH;
    }
    *agreed = (kvw_wire_offer_t){hi, hi, ours->caps & theirs->caps};
    return KVW_OK;
}

const char *kvw__wire_type_name(uint16_t type)
{
    switch (type) {
    case KVW_MSG_BS_REGISTER:
        return "BS_REGISTER";
    case KVW_MSG_BS_REGISTER_ACK:
        return "BS_REGISTER_ACK";
    case KVW_MSG_BS_LOOKUP:
        return "BS_LOOKUP";
    case KVW_MSG_BS_LOOKUP_REPLY:
        return "BS_LOOKUP_REPLY";
    case KVW_MSG_BS_UNREGISTER:
        return "BS_UNREGISTER";
    case KVW_MSG_HELLO:
        return "HELLO";
    case KVW_MSG_HELLO_ACK:
        return "HELLO_ACK";
    case KVW_MSG_REQUEST:
        return "REQUEST";
    case KVW_MSG_REQUEST_FAILED:
        return "REQUEST_FAILED";
    case KVW_MSG_ABORT:
        return "ABORT";
    case KVW_MSG_CREDIT:
        return "CREDIT";
    case KVW_MSG_BYE:
        return "BYE";
    case KVW_MSG_CLOSING:
        return "CLOSING";
    case KVW_MSG_LANE_RESET:
        return "LANE_RESET";
    case KVW_MSG_LANE_READY:
        return "LANE_READY";
    case KVW_MSG_LANE_DOWN:
        return "LANE_DOWN";
    case KVW_MSG_LANE_UP:
        return "LANE_UP";
    case KVW_MSG_REPLAY_ASK:
        return "REPLAY_ASK";
    case KVW_MSG_REPLAY_ANSWER:
        return "REPLAY_ANSWER";
    case KVW_MSG_DIGEST:
        return "DIGEST";
    case KVW_MSG_PING:
        return "PING";
    case KVW_MSG_PONG:
        return "PONG";
    }
    return "UNKNOWN";
}
