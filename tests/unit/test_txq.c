/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/engine/txq.c against the fake verbs ops. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>

#include "engine/txq.h"
#include "support/fake_verbs.h"

static int setup(void **state)
{
    (void)state;
    fake_verbs_reset();
    return 0;
}

static int errors_logged;

static void count_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)msg;
    if (level == KVW_LOG_ERROR)
        errors_logged++;
}

static kvw_write_t write_n(uint64_t i)
{
    return (kvw_write_t){.local_addr = 0x100000 + i * 0x1000,
                         .remote_addr = 0x900000 + i * 0x2000,
                         .lkey = 0x10 + (uint32_t)i,
                         .rkey = 0x20 + (uint32_t)i,
                         .len = 100 + (uint32_t)i};
}

/* Add `total` writes, numbered from first, in rooms of kvw__txq_room(),
 * flushing whenever the room runs out and at the end. */
static void post_writes(kvw_txq_t *q, uint64_t first, uint64_t total)
{
    uint64_t i = 0;
    while (i < total) {
        uint32_t room = kvw__txq_room(q);
        if (!room) {
            assert_true(q->pending > 0); /* otherwise we are out of credits */
            assert_int_equal(kvw__txq_flush(q), KVW_OK);
            continue;
        }
        for (uint32_t k = 0; k < room && i < total; k++, i++) {
            kvw_write_t w = write_n(first + i);
            uint64_t seq = kvw__txq_add(q, &w, 0, 0);
            assert_int_equal(seq, first + i);
        }
    }
    assert_int_equal(kvw__txq_flush(q), KVW_OK);
}

static void test_init_fini(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 10, 4), KVW_OK);
    assert_non_null(q.wrs);
    assert_non_null(q.sges);
    assert_int_equal(q.posted, 0);
    assert_int_equal(q.completed, 0);
    assert_int_equal(q.pending, 0);
    assert_int_equal(kvw__txq_outstanding(&q), 0);
    assert_int_equal(kvw__txq_room(&q), 10);
    /* Flushing an empty chain posts nothing. */
    assert_int_equal(kvw__txq_flush(&q), KVW_OK);
    assert_int_equal(fake_verbs.num_posts, 0);
    assert_int_equal(q.chains, 0);
    kvw__txq_fini(&q);
    assert_null(q.wrs);
    assert_null(q.sges);
    kvw__txq_fini(&q); /* twice is harmless */
}

static void test_chains_and_doorbells(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 256, 7, 3), KVW_OK);
    post_writes(&q, 0, 50);
    /* 50 = 7 * 7 + 1: 8 chains, one post each. */
    assert_int_equal(fake_verbs.num_posts, 8);
    assert_int_equal(q.chains, fake_verbs.num_posts);
    assert_int_equal(q.wrs_posted, 50);
    assert_int_equal(q.posted, 50);
    assert_int_equal(fake_verbs.num_wrs, 50);
    uint64_t bytes = 0;
    for (size_t p = 0; p < fake_verbs.num_posts; p++) {
        assert_true(fake_verbs.posts[p].count >= 1);
        assert_true(fake_verbs.posts[p].count <= 7);
        assert_false(fake_verbs.posts[p].failed);
    }
    for (size_t i = 0; i < 50; i++) {
        const fake_wr_t *f = &fake_verbs.wrs[i];
        kvw_write_t w = write_n(i);
        assert_int_equal(f->wr_id, i); /* wr_id is the sequence number */
        assert_int_equal(f->opcode, IBV_WR_RDMA_WRITE);
        assert_int_equal(f->num_sge, 1);
        assert_int_equal(f->sge_addr, w.local_addr);
        assert_int_equal(f->sge_len, w.len);
        assert_int_equal(f->sge_lkey, w.lkey);
        assert_int_equal(f->remote_addr, w.remote_addr);
        assert_int_equal(f->rkey, w.rkey);
        bytes += w.len;
    }
    assert_int_equal(q.bytes_posted, bytes);
    kvw__txq_fini(&q);
}

static void test_signaling(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 10, 4), KVW_OK);
    post_writes(&q, 0, 25);
    assert_int_equal(fake_verbs.num_posts, 3);
    assert_int_equal(fake_verbs.posts[0].count, 10);
    assert_int_equal(fake_verbs.posts[1].count, 10);
    assert_int_equal(fake_verbs.posts[2].count, 5);
    /* Every 4th WR since the last signaled one, plus each chain's last
     * (which restarts the count): chain [0,10): 3 7 9; [10,20): 13 17 19;
     * [20,25): 23 24. */
    static const uint64_t want[] = {3, 7, 9, 13, 17, 19, 23, 24};
    size_t k = 0;
    uint64_t last_signaled = (uint64_t)-1;
    for (size_t i = 0; i < fake_verbs.num_wrs; i++) {
        const fake_wr_t *f = &fake_verbs.wrs[i];
        int sig = (f->send_flags & IBV_SEND_SIGNALED) != 0;
        if (sig) {
            assert_true(k < sizeof(want) / sizeof(want[0]));
            assert_int_equal(f->wr_id, want[k++]);
            /* Never more than signal_every WRs between signals. */
            assert_true(f->wr_id - last_signaled <= 4);
            last_signaled = f->wr_id;
        }
        /* No other flag is set. */
        assert_int_equal(f->send_flags & ~(unsigned)IBV_SEND_SIGNALED, 0);
    }
    assert_int_equal(k, sizeof(want) / sizeof(want[0]));
    /* Each chain's last WR is signaled. */
    for (size_t p = 0; p < fake_verbs.num_posts; p++) {
        const fake_post_t *c = &fake_verbs.posts[p];
        assert_true(fake_verbs.wrs[c->first + c->count - 1].send_flags & IBV_SEND_SIGNALED);
    }
    kvw__txq_fini(&q);
}

static void test_credits(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 16, 8, 4), KVW_OK);
    assert_int_equal(kvw__txq_room(&q), 8);
    /* Pending WRs take credits and chain room. */
    kvw_write_t w = write_n(0);
    for (int i = 0; i < 3; i++)
        kvw__txq_add(&q, &w, 0, 0);
    assert_int_equal(kvw__txq_room(&q), 5);
    assert_int_equal(kvw__txq_outstanding(&q), 0); /* not posted yet */
    post_writes(&q, 3, 13);                        /* 16 in all */
    assert_int_equal(kvw__txq_outstanding(&q), 16);
    assert_int_equal(kvw__txq_room(&q), 0);

    /* WR 3 was signaled (every 4th): retiring it frees exactly 0..3. */
    assert_true(fake_verbs.wrs[3].send_flags & IBV_SEND_SIGNALED);
    kvw__txq_retire(&q, 3);
    assert_int_equal(q.completed, 4);
    assert_int_equal(kvw__txq_outstanding(&q), 12);
    assert_int_equal(kvw__txq_room(&q), 4);

    /* An older completion does not move the mark backwards. */
    kvw__txq_retire(&q, 1);
    assert_int_equal(q.completed, 4);
    assert_int_equal(kvw__txq_room(&q), 4);

    /* Refill: 4 credits, then none. */
    post_writes(&q, 16, 4);
    assert_int_equal(kvw__txq_room(&q), 0);
    assert_int_equal(kvw__txq_outstanding(&q), 16);

    /* Retiring the last WR frees everything; the chain room caps the room. */
    kvw__txq_retire(&q, q.posted - 1);
    assert_int_equal(kvw__txq_outstanding(&q), 0);
    assert_int_equal(kvw__txq_room(&q), 8);
    kvw__txq_fini(&q);
}

static void test_with_imm_and_zero_length(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 8, 32), KVW_OK);
    kvw_write_t w = write_n(5);
    kvw_write_t zero = {
        .local_addr = 0, .remote_addr = 0xabc000, .lkey = 0, .rkey = 0x77, .len = 0};
    assert_int_equal(kvw__txq_add(&q, &w, 0, 0), 0);
    assert_int_equal(kvw__txq_add(&q, &w, 1, 0x12345678u), 1);
    assert_int_equal(kvw__txq_add(&q, &zero, 1, 0xdeadbeefu), 2);
    assert_int_equal(kvw__txq_flush(&q), KVW_OK);
    assert_int_equal(fake_verbs.num_posts, 1);
    assert_int_equal(fake_verbs.posts[0].count, 3);

    const fake_wr_t *f = fake_verbs.wrs;
    assert_int_equal(f[0].opcode, IBV_WR_RDMA_WRITE);
    assert_int_equal(f[0].send_flags, 0);
    assert_int_equal(f[1].opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    assert_int_equal(f[1].imm_data, htonl(0x12345678u));
    assert_int_equal(((const uint8_t *)&f[1].imm_data)[0], 0x12); /* network order */
    assert_int_equal(f[1].num_sge, 1);
    assert_int_equal(f[1].sge_len, w.len);
    assert_int_equal(f[1].send_flags, 0);
    /* Zero-length write: no SGE, only the immediate, to the remote key. */
    assert_int_equal(f[2].opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    assert_int_equal(f[2].num_sge, 0);
    assert_int_equal(f[2].imm_data, htonl(0xdeadbeefu));
    assert_int_equal(f[2].remote_addr, 0xabc000);
    assert_int_equal(f[2].rkey, 0x77);
    assert_int_equal(f[2].send_flags, IBV_SEND_SIGNALED);
    assert_int_equal(q.bytes_posted, 2 * (uint64_t)w.len);
    kvw__txq_fini(&q);
}

/* Gather writes: a slot takes the write's entries, then goes back to the
 * shared one-entry form after the post; the chain's bytes are every
 * entry's; a failed post counts every entry of what it took. */
static void test_gather(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 8, 32), KVW_OK);
    assert_int_equal(kvw__txq_enable_gather(&q, 0), KVW_ERR_INVALID);
    assert_int_equal(kvw__txq_enable_gather(&q, KVW_HEADS_MAX_SGE + 1), KVW_ERR_INVALID);
    assert_int_equal(kvw__txq_enable_gather(&q, 4), KVW_OK);
    assert_int_equal(kvw__txq_enable_gather(&q, 4), KVW_OK); /* again: no change */
    assert_int_equal(kvw__txq_enable_gather(&q, 5), KVW_ERR_INVALID);
    kvw_gwrite_t g = {.remote_addr = 0x900000, .len = 300, .num_sge = 3};
    for (uint32_t k = 0; k < 3; k++)
        g.sge[k] = (kvw_sge_t){0x100000 + k * 0x400, 100};
    kvw_write_t w = write_n(1);
    assert_int_equal(kvw__txq_add(&q, &w, 0, 0), 0);
    assert_int_equal(kvw__txq_add_gather(&q, &g, 0x11, 0x22, 0, 0), 1);
    assert_int_equal(q.wrs[1].num_sge, 3);
    assert_int_equal(q.wrs[1].sg_list[2].addr, 0x100800);
    assert_int_equal(q.wrs[1].sg_list[2].lkey, 0x11);
    assert_int_equal(kvw__txq_add_gather(&q, &g, 0x11, 0x22, 1, 7), 2);
    assert_int_equal(kvw__txq_flush(&q), KVW_OK);
    const fake_wr_t *f = fake_verbs.wrs;
    assert_int_equal(f[1].num_sge, 3);
    assert_int_equal(f[1].sge_addr, 0x100000);
    assert_int_equal(f[1].remote_addr, 0x900000);
    assert_int_equal(f[1].rkey, 0x22);
    assert_int_equal(f[1].opcode, IBV_WR_RDMA_WRITE);
    assert_int_equal(f[2].opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
    assert_int_equal(f[2].imm_data, htonl(7));
    assert_int_equal(q.bytes_posted, w.len + 600);
    /* Back to the shared form. */
    for (uint32_t i = 0; i < 3; i++) {
        assert_ptr_equal(q.wrs[i].sg_list, &q.sges[i]);
        assert_int_equal(q.wrs[i].num_sge, 1);
        assert_int_equal(q.wrs[i].opcode, IBV_WR_RDMA_WRITE);
    }
    /* A post failing at its third WR took two: a plain one and a gather. */
    kvw_set_log_handler(count_log, NULL, KVW_LOG_WARN);
    fake_verbs_fail_post_at(1, EIO, 2);
    uint64_t before = q.bytes_posted;
    kvw__txq_add(&q, &w, 0, 0);
    kvw__txq_add_gather(&q, &g, 0x11, 0x22, 0, 0);
    kvw__txq_add_gather(&q, &g, 0x11, 0x22, 0, 0);
    assert_int_equal(kvw__txq_flush(&q), KVW_ERR_VERBS);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    assert_int_equal(q.bytes_posted - before, w.len + 300);
    assert_ptr_equal(q.wrs[2].sg_list, &q.sges[2]);
    kvw__txq_fini(&q);
}

static void test_failed_post(void **state)
{
    (void)state;
    kvw_txq_t q;
    errors_logged = 0;
    kvw_set_log_handler(count_log, NULL, KVW_LOG_WARN);
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 8, 4), KVW_OK);
    post_writes(&q, 0, 5); /* one good chain */
    assert_int_equal(q.posted, 5);

    fake_verbs_fail_post(1, ENOMEM);
    kvw_write_t w = write_n(9);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvw__txq_add(&q, &w, 0, 0), 5 + (uint64_t)i);
    assert_int_equal(kvw__txq_flush(&q), KVW_ERR_VERBS);
    assert_int_equal(fake_verbs.num_posts, 2);
    assert_true(fake_verbs.posts[1].failed);
    assert_int_equal(fake_verbs.posts[1].count, 3);
    /* bad_wr was the first WR: nothing of the failed chain was posted. */
    assert_int_equal(q.posted, 5);
    assert_int_equal(q.chains, 1);
    assert_int_equal(q.wrs_posted, 5);
    assert_int_equal(q.pending, 0);
    assert_int_equal(kvw__txq_outstanding(&q), 5);
    /* A failed post ends the txq: no room, so no later chain can reuse the
     * dropped sequence numbers or post after a hole. */
    assert_int_equal(kvw__txq_room(&q), 0);
    assert_int_equal(errors_logged, 1);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    kvw__txq_fini(&q);
}

/* ibv_post_send stops at bad_wr: the WRs before it were posted and will
 * complete, so they must count as posted and outstanding. */
static void test_failed_post_mid_chain(void **state)
{
    (void)state;
    kvw_txq_t q;
    kvw_set_log_handler(count_log, NULL, KVW_LOG_WARN);
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 8, 4), KVW_OK);
    fake_verbs_fail_post_at(1, EINVAL, 3);
    for (uint64_t i = 0; i < 6; i++) {
        kvw_write_t w = write_n(i);
        kvw__txq_add(&q, &w, 0, 0);
    }
    assert_int_equal(kvw__txq_flush(&q), KVW_ERR_VERBS);
    assert_int_equal(q.posted, 3);
    assert_int_equal(q.wrs_posted, 3);
    assert_int_equal(q.chains, 1);
    assert_int_equal(q.bytes_posted, (100 + 0) + (100 + 1) + (100 + 2));
    assert_int_equal(kvw__txq_outstanding(&q), 3);
    assert_int_equal(kvw__txq_room(&q), 0);
    /* A completion past what was posted cannot retire more than was posted. */
    kvw__txq_retire(&q, 5);
    assert_int_equal(q.completed, 3);
    assert_int_equal(q.wrs_ok, 3);
    assert_int_equal(kvw__txq_outstanding(&q), 0);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    kvw__txq_fini(&q);
}

/* RC completes in order: an error at WR k means WRs before k landed and k
 * and everything after did not; later (flush) errors change nothing. */
static void test_error_completion_boundary(void **state)
{
    (void)state;
    kvw_txq_t q;
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 16, 4), KVW_OK);
    post_writes(&q, 0, 10);
    kvw__txq_retire(&q, 3); /* a signaled WR: 0..3 landed */
    assert_int_equal(q.completed, 4);
    kvw__txq_fail_at(&q, 7);
    assert_int_equal(q.completed, 7);
    assert_true(q.broken);
    assert_int_equal(q.wrs_ok, 7);
    assert_int_equal(q.wrs_flushed, 3);
    assert_int_equal(kvw__txq_outstanding(&q), 0);
    assert_int_equal(kvw__txq_room(&q), 0);
    kvw__txq_fail_at(&q, 8); /* the flushes that follow */
    kvw__txq_retire(&q, 9);  /* nothing can land after an error */
    assert_int_equal(q.completed, 7);
    assert_int_equal(q.wrs_ok + q.wrs_flushed, q.wrs_posted);
    kvw__txq_fini(&q);

    /* A flush at a WR already retired cannot un-land it. */
    assert_int_equal(kvw__txq_init(&q, &fake_verbs_ops, fake_verbs_qp(), 64, 16, 4), KVW_OK);
    post_writes(&q, 0, 4);
    kvw__txq_retire(&q, 3);
    kvw__txq_fail_at(&q, 2);
    assert_int_equal(q.wrs_ok, 4);
    assert_int_equal(q.wrs_flushed, 0);
    kvw__txq_fini(&q);
}

static void test_other_fake_ops_fail(void **state)
{
    (void)state;
    /* The fake refuses anything but post_send/post_recv/poll_cq. */
    const kvw_verbs_ops_t *o = &fake_verbs_ops;
    int num = 5;
    assert_null(o->get_device_list(&num));
    assert_int_equal(num, 0);
    assert_null(o->open_device(NULL));
    assert_null(o->alloc_pd(NULL));
    assert_null(o->reg_mr(NULL, NULL, 0, 0));
    assert_null(o->create_cq(NULL, 1, NULL, NULL, 0));
    assert_null(o->create_qp(NULL, NULL));
    assert_int_not_equal(o->modify_qp(NULL, NULL, 0), 0);
    assert_int_equal(o->poll_cq(NULL, 4, NULL), 0);
    assert_int_equal(o->post_recv(NULL, NULL, NULL), 0);
    assert_int_equal(fake_verbs.poll_cq_calls, 1);
    assert_int_equal(fake_verbs.post_recv_calls, 1);
    assert_int_equal(fake_verbs.other_calls, 7);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_init_fini, setup),
        cmocka_unit_test_setup(test_chains_and_doorbells, setup),
        cmocka_unit_test_setup(test_signaling, setup),
        cmocka_unit_test_setup(test_credits, setup),
        cmocka_unit_test_setup(test_with_imm_and_zero_length, setup),
        cmocka_unit_test_setup(test_gather, setup),
        cmocka_unit_test_setup(test_failed_post, setup),
        cmocka_unit_test_setup(test_failed_post_mid_chain, setup),
        cmocka_unit_test_setup(test_error_completion_boundary, setup),
        cmocka_unit_test_setup(test_other_fake_ops_fail, setup),
    };
    return cmocka_run_group_tests_name("txq", tests, NULL, NULL);
}
