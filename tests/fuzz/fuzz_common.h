/* SPDX-License-Identifier: Apache-2.0 */
/* Shared pieces of the libFuzzer harnesses (tests/fuzz/fuzz_*.c) and of the
 * seed corpus generator (gen_corpus.c).
 *
 * Input format of the socket harnesses (prefill, decode, bootstrap): a
 * sequence of records, each
 *
 *     u8 flags, u16 length (little-endian), length bytes
 *
 * One record is one ZeroMQ frame. FUZZ_MORE in flags glues the next record
 * to this one as a further frame of the same multi-part message, to
 * exercise the receivers' framing. A record cut short by the end of the
 * input takes the bytes that are left, so every input means something. */
#ifndef KVW_TESTS_FUZZ_COMMON_H
#define KVW_TESTS_FUZZ_COMMON_H

#include "ctrl/wire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    FUZZ_MORE = 1u << 0,  /* the next record is another frame of this message */
    FUZZ_OTHER = 1u << 1, /* send from the harness's second peer (prefill, bootstrap) */
    FUZZ_MAX_RECORDS = 32,
    FUZZ_RECORD_HEADER = 3,
    FUZZ_SYNC_MS = 5000, /* no answer to the synchronising round trip by then: a hang */
};

typedef struct fuzz_record {
    uint8_t flags;
    const uint8_t *data;
    size_t len;
} fuzz_record_t;

/* Split an input into at most FUZZ_MAX_RECORDS records (the rest of a
 * longer input is ignored). Returns the number of records. */
size_t fuzz_split(const uint8_t *in, size_t len, fuzz_record_t *recs);

/* Which records fuzz_send_records sends. */
typedef enum { FUZZ_SEND_MAIN, FUZZ_SEND_OTHER, FUZZ_SEND_ALL } fuzz_select_t;

/* Send the selected records of [0, n) on sock, each message starting with
 * the identity frame id (id_len bytes) when id is not NULL (a ROUTER
 * talking to one peer). FUZZ_SEND_MAIN: the records without FUZZ_OTHER;
 * FUZZ_SEND_OTHER: those with it. A send that would block is dropped, as a
 * lossy network would: the harness must never wait on the code under test
 * except in its sync round trip. */
void fuzz_send_records(void *sock, const void *id, size_t id_len, const fuzz_record_t *recs,
                       size_t n, fuzz_select_t which);

/* Encode m and send it as one frame, after the identity frame id if not
 * NULL. Aborts if m does not encode: harness bug. */
void fuzz_send_msg(void *sock, const void *id, size_t id_len, const kvw_msg_t *m);

/* Receive one message from sock within timeout_ms. Returns true with *m_p
 * decoded (free with kvw__wire_free) and, for a ROUTER (id not NULL), the
 * sender's identity in id[0..*id_len_p). Frames that do not decode are
 * skipped. False on timeout. */
bool fuzz_recv_msg(void *sock, int timeout_ms, uint8_t *id, size_t *id_len_p, kvw_msg_t *m_p);

/* Silence the library's log (thousands of rejected messages a second would
 * drown the fuzzer's own output); KVW_FUZZ_LOG=1 keeps it. */
void fuzz_quiet_log(void);

/* "Harness failed": print why and abort(), which libFuzzer reports as a
 * crash with the input that caused it. */
__attribute__((noreturn, format(printf, 1, 2))) void fuzz_die(const char *fmt, ...);

uint64_t fuzz_now_ms(void);

/* A zmq socket with linger 0 (closing never blocks the harness). */
void *fuzz_socket(void *zctx, int type);

/* A DEALER (fuzz_socket) with routing identity id (id_len bytes) when id
 * is not NULL, connected to endpoint; what names the peer when it cannot
 * connect, which aborts (a harness bug). */
void *fuzz_dealer(void *zctx, const void *id, size_t id_len, const char *endpoint,
                  const char *what);

/* Receive messages from sock for up to timeout_ms, handing each to match
 * (and freeing it after) until match returns true: true then, false when
 * the time ran out first. The harnesses' synchronising wait. */
bool fuzz_await(void *sock, int timeout_ms, bool (*match)(const kvw_msg_t *m, void *arg),
                void *arg);

/* Append one record holding msg to buf (capacity cap) at *len_p. Returns
 * false if it does not fit. For the corpus generator. */
bool fuzz_append_record(uint8_t *buf, size_t cap, size_t *len_p, uint8_t flags,
                        const kvw_msg_t *msg);

/* The layout every harness engine registers, so seed HELLOs match and
 * get accepted: a K/V group of 2 layers, 1 aux region, and two state
 * groups of one region each (a hybrid model: Mamba's slots, an SWA page
 * pool), so REQUEST's per-group state lists reach the engines' checks. */
enum {
    FUZZ_LAYERS = 2,
    FUZZ_ITEM = 256,
    FUZZ_PAGES = 64,
    FUZZ_AUX_ITEM = 64,
    FUZZ_AUX_ITEMS = 8,
    FUZZ_MAMBA_ITEM = 128,
    FUZZ_MAMBA_ITEMS = 4,
    FUZZ_SWA_PAGES = 16,
    FUZZ_AUX_REGION = 2 * FUZZ_LAYERS,
    FUZZ_MAMBA_REGION = FUZZ_AUX_REGION + 1,
    FUZZ_SWA_REGION = FUZZ_MAMBA_REGION + 1,
    FUZZ_REGIONS = FUZZ_SWA_REGION + 1,
    FUZZ_GROUPS = 4,
    FUZZ_STATE_GROUPS = 2,
};

/* Item length and item count of harness region i. */
void fuzz_region_shape(int i, uint64_t *item_p, uint64_t *items_p);

/* A HELLO or HELLO_ACK (type) with that layout and a made-up QP; regions
 * points to FUZZ_REGIONS entries of storage owned by the caller. */
void fuzz_hello(kvw_msg_t *m, uint16_t type, uint64_t engine_id, kvw_wire_region_t *regions);

/* ---- set-up of the harnesses that run the library (prefill, decode,
 * bootstrap). In fuzz_engine.c, which links the library and the fake NIC:
 * the wire harness and the corpus generator link without them. */

/* A bootstrap service on 127.0.0.1 (any port) and a zmq context for the
 * harness's own sockets. Aborts on failure. */
void fuzz_open_service(void **zctx_p, kvw_bootstrap_t **bootstrap_p);
/* A DEALER (fuzz_dealer) connected to the bootstrap service. */
void *fuzz_service_dealer(void *zctx, kvw_bootstrap_t *bootstrap);

/* The engine harnesses' memory: FUZZ_REGIONS zeroed regions in the test
 * layout, as the engine takes them. */
typedef struct fuzz_memory {
    uint8_t *mem[FUZZ_REGIONS];
    kvw_region_t regions[FUZZ_REGIONS];
    kvw_group_t groups[FUZZ_GROUPS];
} fuzz_memory_t;

/* What every engine harness does first: the log silenced (fuzz_quiet_log),
 * the fake NIC installed as the verbs, and mem allocated. Aborts on
 * failure. */
void fuzz_engine_setup(fuzz_memory_t *mem);
/* The configuration the engine harnesses start from: kvw_config_init with
 * small queues; each harness sets its own timeouts. */
void fuzz_engine_config(kvw_config_t *cfg);
/* Parameters for an engine of role on the fake NIC's device over mem, in
 * the test layout, with cfg; the caller adds the bootstrap address where
 * its role needs one. */
void fuzz_engine_params(kvw_engine_params_t *p, kvw_role_t role, const char *device,
                        const fuzz_memory_t *mem, const kvw_config_t *cfg);

#endif
