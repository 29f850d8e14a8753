/* SPDX-License-Identifier: Apache-2.0 */
/* Seed corpus for the fuzz harnesses, built with kvw__wire_encode so the
 * seeds follow every change of the wire format (nothing binary is checked
 * in). Usage: gen_corpus DIR. Writes
 *   DIR/wire/      one raw message per file, every message type;
 *   DIR/prefill/   record streams (fuzz_common.h) of what a decode engine
 *                  sends prefill, one message type per file, plus a few
 *                  conversations and multi-part messages;
 *   DIR/decode/    the same for what prefill sends decode;
 *   DIR/bootstrap/ the same for what the bootstrap service receives. */
#include "fuzz/fuzz_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { CAP = 8192 };

static const char *out_dir;
static int failures;

static void make_dir(const char *sub)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", out_dir, sub);
    if (mkdir(out_dir, 0755) && errno != EEXIST)
        perror(out_dir), failures++;
    if (mkdir(path, 0755) && errno != EEXIST)
        perror(path), failures++;
}

static void write_file(const char *sub, const char *name, const uint8_t *buf, size_t len)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s/%s", out_dir, sub, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, len, f) != len || fclose(f)) {
        perror(path);
        failures++;
    }
}

/* One sample of every message type, valid for the harness engines. */
static size_t samples(kvw_msg_t *out, kvw_wire_region_t *regions, uint64_t *pages)
{
    size_t n = 0;
    kvw_msg_t m;
#define ADD(...)                                                                                   \
    do {                                                                                           \
        m = (kvw_msg_t){__VA_ARGS__};                                                              \
        out[n++] = m;                                                                              \
    } while (0)
    ADD(.type = KVW_MSG_BS_REGISTER,
        .u.bs = {.rank = 3, .engine_id = 0x77, .endpoint = "tcp://127.0.0.1:5555"});
    ADD(.type = KVW_MSG_BS_REGISTER_ACK, .u.bs = {.rank = 3});
    ADD(.type = KVW_MSG_BS_LOOKUP, .u.bs = {.rank = 3});
    ADD(.type = KVW_MSG_BS_LOOKUP_REPLY, .u.bs = {.rank = 3, .endpoint = "tcp://127.0.0.1:5555"});
    ADD(.type = KVW_MSG_BS_UNREGISTER, .u.bs = {.rank = 3, .engine_id = 0x77});
    fuzz_hello(&out[n++], KVW_MSG_HELLO, 0xdec0de, regions);
    fuzz_hello(&out[n++], KVW_MSG_HELLO_ACK, 0xfeed, regions);
    /* Wire 12: decode's offer as a wire-11 HELLO's reason, prefill's
     * answer in 12 with the offer's fields. */
    fuzz_hello(&out[n], KVW_MSG_HELLO, 0xdec0de, regions);
    out[n++].u.hello.offer = (kvw_wire_offer_t){11, 12, KVW_WIRE_CAPS_ALL};
    fuzz_hello(&out[n], KVW_MSG_HELLO_ACK, 0xfeed, regions);
    out[n].version = 12;
    out[n++].u.hello.offer = (kvw_wire_offer_t){11, 12, KVW_WIRE_CAP_VERIFY};
    for (uint32_t i = 0; i < 4; i++)
        pages[i] = i * 3;
    /* 4 pages, then the state lists: Mamba slot 2, SWA pages 5 and 6. */
    pages[4] = 2;
    pages[5] = 5;
    pages[6] = 6;
    ADD(.type = KVW_MSG_REQUEST, .u.request = {.room = 1,
                                               .token = 1,
                                               .aux_index = 0,
                                               .num_pages = 4,
                                               .num_state = 3,
                                               .pages = pages,
                                               .num_state_lists = FUZZ_STATE_GROUPS,
                                               .state_counts = {1, 2}});
    ADD(.type = KVW_MSG_REQUEST_FAILED, .status = KVW_ERR_PEER,
        .u.failed = {.room = 1, .token = 1, .reason = "prefill failed"});
    ADD(.type = KVW_MSG_ABORT, .status = KVW_ERR_ABORTED,
        .u.failed = {.room = 1, .token = 1, .reason = "decode gave up"});
    ADD(.type = KVW_MSG_PING, .u.ping = {.engine_id = 0xdec0de});
    ADD(.type = KVW_MSG_PONG, .u.ping = {.engine_id = 0xfeed});
    ADD(.type = KVW_MSG_CREDIT, .u.credit = {.num_qps = 2, .recvs_posted = {64, 32}});
    ADD(.type = KVW_MSG_BYE, .status = KVW_ERR_PEER, .u.failed = {.reason = "bye"});
    ADD(.type = KVW_MSG_CLOSING, .status = KVW_ERR_PEER,
        .u.failed = {.reason = "its engine is destroyed"});
    ADD(.type = KVW_MSG_LANE_RESET, .u.lane = {.qp = 1, .psn = 0x123, .count = 40});
    ADD(.type = KVW_MSG_LANE_READY,
        .u.lane = {.qp = 1, .psn = 0x456, .peer_psn = 0x123, .count = 56});
    ADD(.type = KVW_MSG_LANE_DOWN, .u.lane = {.qp = 1});
    ADD(.type = KVW_MSG_LANE_UP, .u.lane = {.qp = 1});
    ADD(.type = KVW_MSG_REPLAY_ASK, .u.replay = {.room = 1, .token = 1, .epoch = 0});
    ADD(.type = KVW_MSG_REPLAY_ANSWER,
        .u.replay = {.room = 1, .token = 1, .epoch = 0, .answer = KVW_WIRE_REPLAY_AGAIN});
    ADD(.type = KVW_MSG_DIGEST, .u.digest = {.room = 1, .token = 1, .value = 0xe3069283});
#undef ADD
    return n;
}

static void file_name(char *buf, size_t size, const kvw_msg_t *m)
{
    /* A handshake with an offer (wire 12) beside the one without. */
    bool offer = (m->type == KVW_MSG_HELLO || m->type == KVW_MSG_HELLO_ACK) && m->u.hello.offer.max;
    snprintf(buf, size, "%s%s", kvw__wire_type_name(m->type), offer ? "_offer" : "");
    for (char *p = buf; *p; p++)
        *p = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
}

static void write_raw(const kvw_msg_t *m)
{
    uint8_t buf[CAP];
    size_t len = 0;
    char name[64];
    file_name(name, sizeof(name), m);
    if (kvw__wire_encode(m, buf, sizeof(buf), &len)) {
        fprintf(stderr, "gen_corpus: cannot encode %s\n", name);
        failures++;
        return;
    }
    write_file("wire", name, buf, len);
}

/* A stream of records, each holding one of msgs[]; flags[i] per record. */
static void write_stream(const char *sub, const char *name, const kvw_msg_t *const *msgs,
                         const uint8_t *flags, size_t n)
{
    uint8_t buf[CAP];
    size_t len = 0;
    for (size_t i = 0; i < n; i++)
        if (!fuzz_append_record(buf, sizeof(buf), &len, flags ? flags[i] : 0, msgs[i])) {
            fprintf(stderr, "gen_corpus: %s/%s does not fit\n", sub, name);
            failures++;
            return;
        }
    write_file(sub, name, buf, len);
}

static void write_one(const char *sub, const kvw_msg_t *m)
{
    char name[64];
    file_name(name, sizeof(name), m);
    write_stream(sub, name, &m, NULL, 1);
}

static const kvw_msg_t *find(const kvw_msg_t *all, size_t n, uint16_t type)
{
    for (size_t i = 0; i < n; i++)
        if (all[i].type == type)
            return &all[i];
    return NULL;
}

static void per_type(const char *sub, const kvw_msg_t *all, size_t n, const uint16_t *types,
                     size_t ntypes)
{
    for (size_t i = 0; i < ntypes; i++)
        write_one(sub, find(all, n, types[i]));
}

static void prefill_seeds(const kvw_msg_t *all, size_t n)
{
    static const uint16_t types[] = {KVW_MSG_HELLO,      KVW_MSG_REQUEST,       KVW_MSG_ABORT,
                                     KVW_MSG_PING,       KVW_MSG_CREDIT,        KVW_MSG_BYE,
                                     KVW_MSG_LANE_READY, KVW_MSG_REPLAY_ANSWER, KVW_MSG_LANE_DOWN,
                                     KVW_MSG_LANE_UP,    KVW_MSG_CLOSING};
    per_type("prefill", all, n, types, sizeof(types) / sizeof(types[0]));
    const kvw_msg_t *hello = find(all, n, KVW_MSG_HELLO), *req = find(all, n, KVW_MSG_REQUEST),
                    *abort_ = find(all, n, KVW_MSG_ABORT), *credit = find(all, n, KVW_MSG_CREDIT),
                    *ping = find(all, n, KVW_MSG_PING), *bye = find(all, n, KVW_MSG_BYE);
    const kvw_msg_t *talk[] = {hello, credit, req, ping, abort_, req};
    write_stream("prefill", "conversation", talk, NULL, 6);
    const kvw_msg_t *rehello[] = {req, bye, hello, req};
    write_stream("prefill", "bye-then-hello", rehello, NULL, 4);
    const uint8_t multi_flags[] = {FUZZ_MORE, 0, FUZZ_OTHER, FUZZ_OTHER | FUZZ_MORE, FUZZ_OTHER};
    const kvw_msg_t *multi[] = {req, ping, hello, req, ping};
    write_stream("prefill", "multipart-and-stranger", multi, multi_flags, 5);
    /* Decode over several prefill ranks: a REQUEST naming a head range,
     * leaving aux and state to another rank. */
    kvw_msg_t ranged = *req;
    ranged.u.request.aux_index = KVW_NO_AUX;
    ranged.u.request.heads_flags = KVW_WIRE_HEADS_RANGE | KVW_WIRE_HEADS_NO_REST;
    ranged.u.request.head_count = 1;
    const kvw_msg_t *rtalk[] = {hello, credit, &ranged, ping};
    write_stream("prefill", "ranged-request", rtalk, NULL, 4);
    /* Wire 11: a request decode verifies. */
    kvw_msg_t verified = *req;
    verified.u.request.heads_flags = KVW_WIRE_REQ_VERIFY;
    const kvw_msg_t *vtalk[] = {hello, credit, &verified, ping};
    write_stream("prefill", "verified-request", vtalk, NULL, 4);
}

static void decode_seeds(const kvw_msg_t *all, size_t n)
{
    static const uint16_t types[] = {KVW_MSG_HELLO_ACK, KVW_MSG_REQUEST_FAILED, KVW_MSG_PONG,
                                     KVW_MSG_BYE,       KVW_MSG_LANE_RESET,     KVW_MSG_REPLAY_ASK,
                                     KVW_MSG_DIGEST};
    per_type("decode", all, n, types, sizeof(types) / sizeof(types[0]));
    const kvw_msg_t *ack = find(all, n, KVW_MSG_HELLO_ACK),
                    *failed = find(all, n, KVW_MSG_REQUEST_FAILED),
                    *pong = find(all, n, KVW_MSG_PONG), *ping = find(all, n, KVW_MSG_PING);
    const kvw_msg_t *talk[] = {pong, failed, ack, pong};
    write_stream("decode", "conversation", talk, NULL, 4);
    const uint8_t multi_flags[] = {FUZZ_MORE, 0, 0};
    const kvw_msg_t *multi[] = {pong, ping, pong};
    write_stream("decode", "multipart", multi, multi_flags, 3);
    const kvw_msg_t *digest = find(all, n, KVW_MSG_DIGEST);
    const kvw_msg_t *dtalk[] = {ack, pong, digest, pong};
    write_stream("decode", "digest", dtalk, NULL, 4);
}

static void bootstrap_seeds(const kvw_msg_t *all, size_t n)
{
    static const uint16_t types[] = {KVW_MSG_BS_REGISTER, KVW_MSG_BS_LOOKUP, KVW_MSG_BS_UNREGISTER};
    per_type("bootstrap", all, n, types, sizeof(types) / sizeof(types[0]));
    const kvw_msg_t *reg = find(all, n, KVW_MSG_BS_REGISTER),
                    *look = find(all, n, KVW_MSG_BS_LOOKUP),
                    *unreg = find(all, n, KVW_MSG_BS_UNREGISTER);
    const kvw_msg_t *talk[] = {reg, look, unreg, look};
    write_stream("bootstrap", "conversation", talk, NULL, 4);
    const uint8_t multi_flags[] = {FUZZ_MORE, 0, 0};
    const kvw_msg_t *multi[] = {look, reg, look};
    write_stream("bootstrap", "multipart", multi, multi_flags, 3);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    make_dir("wire");
    make_dir("prefill");
    make_dir("decode");
    make_dir("bootstrap");
    kvw_msg_t all[32];
    kvw_wire_region_t regions[FUZZ_REGIONS];
    uint64_t pages[7];
    size_t n = samples(all, regions, pages);
    for (size_t i = 0; i < n; i++)
        write_raw(&all[i]);
    prefill_seeds(all, n);
    decode_seeds(all, n);
    bootstrap_seeds(all, n);
    if (failures)
        fprintf(stderr, "gen_corpus: %d failures\n", failures);
    return failures ? 1 : 0;
}
