/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the wire format: kvw__wire_decode on arbitrary
 * bytes (ASan/UBSan catch any out-of-bounds read or overflow), and, for
 * every input that decodes, a round trip: encoding the message must
 * reproduce the input byte for byte (the format has exactly one spelling
 * per message, so nothing the decoder accepts is lost or invented) and
 * decoding that again must give the same message, field by field. */
#include "ctrl/wire.h"
#include "fuzz/fuzz_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool qp_equal(const kvw_qp_info_t *a, const kvw_qp_info_t *b)
{
    return a->qpn == b->qpn && a->psn == b->psn && a->lid == b->lid && a->mtu == b->mtu &&
           a->link_layer == b->link_layer && memcmp(a->gid, b->gid, sizeof(a->gid)) == 0;
}

static bool hello_equal(const kvw_msg_t *a, const kvw_msg_t *b)
{
    const __typeof__(a->u.hello) *x = &a->u.hello, *y = &b->u.hello;
    if (x->engine_id != y->engine_id || x->num_qps != y->num_qps ||
        x->num_groups != y->num_groups || x->recv_credits != y->recv_credits ||
        x->max_msg_sz != y->max_msg_sz || strcmp(x->reason, y->reason) != 0 ||
        x->num_rails != y->num_rails || a->version != b->version || x->offer.min != y->offer.min ||
        x->offer.max != y->offer.max || x->offer.caps != y->offer.caps)
        return false;
    for (uint32_t i = 0; i < x->num_qps; i++)
        if (!qp_equal(&x->qps[i], &y->qps[i]) || x->qp_rail[i] != y->qp_rail[i])
            return false;
    for (uint32_t i = 0; i < x->num_rails; i++)
        if (x->rail_mbps[i] != y->rail_mbps[i])
            return false;
    for (uint32_t i = 0; i < x->num_groups; i++)
        if (x->groups[i].kind != y->groups[i].kind ||
            x->groups[i].num_layers != y->groups[i].num_layers ||
            x->groups[i].per_layer != y->groups[i].per_layer)
            return false;
    size_t n = (size_t)kvw__wire_hello_regions(a);
    for (size_t i = 0; i < n; i++) {
        const kvw_wire_region_t *g = &x->regions[i], *h = &y->regions[i];
        if (g->addr != h->addr || g->len != h->len || g->item_len != h->item_len ||
            g->rkey != h->rkey)
            return false;
        for (uint32_t k = 1; k < x->num_rails; k++)
            if (kvw__wire_region_rkey(g, k) != kvw__wire_region_rkey(h, k))
                return false;
    }
    return true;
}

static bool request_equal(const kvw_msg_t *a, const kvw_msg_t *b)
{
    const __typeof__(a->u.request) *x = &a->u.request, *y = &b->u.request;
    return x->room == y->room && x->token == y->token && x->aux_index == y->aux_index &&
           x->num_pages == y->num_pages && x->num_state == y->num_state &&
           (x->num_pages + x->num_state == 0 ||
            memcmp(x->pages, y->pages, 8 * ((size_t)x->num_pages + x->num_state)) == 0) &&
           x->num_state_lists == y->num_state_lists &&
           memcmp(x->state_counts, y->state_counts, 4 * (size_t)x->num_state_lists) == 0;
}

/* Field by field, only the fields the type carries: the rest of the union
 * holds no meaning (and pointers differ between two decodes). */
static bool msg_equal(const kvw_msg_t *a, const kvw_msg_t *b)
{
    if (a->type != b->type || a->status != b->status)
        return false;
    switch (a->type) {
    case KVW_MSG_BS_REGISTER:
    case KVW_MSG_BS_REGISTER_ACK:
    case KVW_MSG_BS_LOOKUP:
    case KVW_MSG_BS_LOOKUP_REPLY:
    case KVW_MSG_BS_UNREGISTER:
        return a->u.bs.rank == b->u.bs.rank && a->u.bs.engine_id == b->u.bs.engine_id &&
               strcmp(a->u.bs.endpoint, b->u.bs.endpoint) == 0;
    case KVW_MSG_HELLO:
    case KVW_MSG_HELLO_ACK:
        return hello_equal(a, b);
    case KVW_MSG_REQUEST:
        return request_equal(a, b);
    case KVW_MSG_REQUEST_FAILED:
    case KVW_MSG_ABORT:
    case KVW_MSG_BYE:
    case KVW_MSG_CLOSING:
        return a->u.failed.room == b->u.failed.room && a->u.failed.token == b->u.failed.token &&
               strcmp(a->u.failed.reason, b->u.failed.reason) == 0;
    case KVW_MSG_PING:
    case KVW_MSG_PONG:
        return a->u.ping.engine_id == b->u.ping.engine_id;
    case KVW_MSG_CREDIT:
        if (a->u.credit.num_qps != b->u.credit.num_qps)
            return false;
        for (uint32_t i = 0; i < a->u.credit.num_qps; i++)
            if (a->u.credit.recvs_posted[i] != b->u.credit.recvs_posted[i])
                return false;
        return true;
    case KVW_MSG_LANE_RESET:
    case KVW_MSG_LANE_READY:
    case KVW_MSG_LANE_DOWN:
    case KVW_MSG_LANE_UP:
        return a->u.lane.qp == b->u.lane.qp && a->u.lane.psn == b->u.lane.psn &&
               a->u.lane.peer_psn == b->u.lane.peer_psn && a->u.lane.count == b->u.lane.count;
    case KVW_MSG_REPLAY_ASK:
    case KVW_MSG_REPLAY_ANSWER:
        return a->u.replay.room == b->u.replay.room && a->u.replay.token == b->u.replay.token &&
               a->u.replay.epoch == b->u.replay.epoch && a->u.replay.answer == b->u.replay.answer;
    case KVW_MSG_DIGEST:
        return a->u.digest.room == b->u.digest.room && a->u.digest.token == b->u.digest.token &&
               a->u.digest.epoch == b->u.digest.epoch && a->u.digest.value == b->u.digest.value;
    }
    return false; /* decode accepted a type it does not know */
}

static void check_round_trip(const uint8_t *data, size_t size, const kvw_msg_t *m)
{
    if (kvw__wire_size(m) != size)
        fuzz_die("%s: wire_size %zu, decoded from %zu bytes", kvw__wire_type_name(m->type),
                 kvw__wire_size(m), size);
    uint8_t *buf = malloc(size);
    size_t len = 0;
    if (!buf)
        fuzz_die("out of memory");
    kvw_status_t st = kvw__wire_encode(m, buf, size, &len);
    if (st || len != size || memcmp(buf, data, size) != 0)
        fuzz_die("%s: re-encoding a decoded message gave %s, %zu bytes (input %zu), %s",
                 kvw__wire_type_name(m->type), kvw_status_name(st), len, size,
                 st || len != size ? "-" : "different bytes");
    kvw_msg_t again;
    char why[KVW_WIRE_REASON_MAX] = "";
    st = kvw__wire_decode(buf, len, &again, why, sizeof(why));
    free(buf);
    if (st)
        fuzz_die("%s: its own encoding does not decode: %s", kvw__wire_type_name(m->type), why);
    bool same = msg_equal(m, &again);
    kvw__wire_free(&again);
    if (!same)
        fuzz_die("%s: decode(encode(decode(x))) differs from decode(x)",
                 kvw__wire_type_name(m->type));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    why[0] = '\0';
    kvw_status_t st = kvw__wire_decode(data, size, &m, why, sizeof(why));
    if (st == KVW_OK) {
        check_round_trip(data, size, &m);
        kvw__wire_free(&m);
    } else if (st != KVW_ERR_PROTOCOL && st != KVW_ERR_NO_MEMORY) {
        fuzz_die("decode returned %s", kvw_status_name(st));
    } else if (st == KVW_ERR_PROTOCOL && (!why[0] || !memchr(why, '\0', sizeof(why)))) {
        fuzz_die("decode rejected %zu bytes without a reason", size);
    }
    return 0;
}
