/* SPDX-License-Identifier: Apache-2.0 */
/* A fake kvw_verbs_ops_t for unit tests: records every post_send chain and
 * can be told to fail the Nth post. Every other op fails (NULL / EINVAL /
 * -1) so code that reaches for a real device is caught. */
#ifndef KVW_TESTS_FAKE_VERBS_H
#define KVW_TESTS_FAKE_VERBS_H

#include "verbs/ops.h"

#include <stddef.h>
#include <stdint.h>

#define FAKE_MAX_POSTS 256
#define FAKE_MAX_WRS 4096

/* One WR as seen by ibv_post_send, copied at post time. */
typedef struct fake_wr {
    uint64_t wr_id;
    int opcode; /* enum ibv_wr_opcode */
    unsigned int send_flags;
    int num_sge;
    uint64_t sge_addr;
    uint32_t sge_len, sge_lkey;
    uint64_t remote_addr;
    uint32_t rkey;
    uint32_t imm_data; /* as stored in the WR (network order) */
} fake_wr_t;

typedef struct fake_post {
    size_t first; /* index into fake_verbs.wrs */
    size_t count; /* WRs in the chain */
    int failed;   /* this post was made to fail */
} fake_post_t;

typedef struct fake_verbs {
    size_t num_posts; /* post_send calls, failed ones included */
    fake_post_t posts[FAKE_MAX_POSTS];
    size_t num_wrs; /* WRs recorded over all posts */
    fake_wr_t wrs[FAKE_MAX_WRS];
    size_t fail_post; /* 1-based post_send call to fail; 0: never */
    int fail_rc;      /* value returned by the failing post (default EIO) */
    size_t fail_wr;   /* bad_wr of the failing post: this 0-based WR of its chain */
    size_t post_recv_calls, poll_cq_calls, other_calls;
} fake_verbs_t;

/* The global recorder the fake ops write into. */
extern fake_verbs_t fake_verbs;
extern const kvw_verbs_ops_t fake_verbs_ops;

/* Clear the recorder (and the failure injection). */
void fake_verbs_reset(void);
/* Make the nth post_send call from now (1-based) fail with rc, at its
 * first WR (bad_wr = the whole chain). */
void fake_verbs_fail_post(size_t nth, int rc);
/* The same, failing at 0-based WR `wr` of that chain: WRs before it count
 * as taken by the device, as ibv_post_send does. */
void fake_verbs_fail_post_at(size_t nth, int rc, size_t wr);
/* A non-NULL opaque qp pointer for tests. */
struct ibv_qp *fake_verbs_qp(void);

#endif
