/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/engine/reqtab.c: the room hash, the deadline heap and
 * the work list, on an engine struct with no threads and no device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/core.h"

enum { N = 10000 };

static kvw_engine_t *bare_engine(void)
{
    kvw_engine_t *e = calloc(1, sizeof(*e));
    assert_non_null(e);
    kvw_config_init(&e->cfg);
    e->role = KVW_ROLE_PREFILL;
    e->ops = &kvw__prefill_ops;
    e->control_wake_fd = eventfd(0, EFD_NONBLOCK);
    assert_true(e->control_wake_fd >= 0);
    pthread_mutex_init(&e->lock, NULL);
    return e;
}

static void free_engine(kvw_engine_t *e)
{
    while (e->reqs)
        kvw__req_drop_locked(e->reqs);
    kvw__reqtab_fini(e);
    close(e->control_wake_fd);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x9e3779b97f4a7c15ull;
    return x ^ (x >> 29);
}

/* 10,000 rooms: each found by its room, none by a room not there, and the
 * table shrinks back to nothing. */
static void test_room_hash(void **state)
{
    (void)state;
    kvw_engine_t *e = bare_engine();
    for (uint64_t i = 0; i < N; i++)
        assert_non_null(kvw__req_new_locked(e, KVW_ROLE_PREFILL, mix(i)));
    assert_int_equal(e->tab.num_reqs, N);
    for (uint64_t i = 0; i < N; i++) {
        kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, mix(i));
        assert_non_null(r);
        assert_int_equal(r->room, mix(i));
        assert_null(kvw__req_find_locked(e, KVW_ROLE_DECODE, mix(i)));
    }
    assert_null(kvw__req_find_locked(e, KVW_ROLE_PREFILL, mix(N)));
    for (uint64_t i = 0; i < N; i += 2)
        kvw__req_drop_locked(kvw__req_find_locked(e, KVW_ROLE_PREFILL, mix(i)));
    assert_int_equal(e->tab.num_reqs, N / 2);
    for (uint64_t i = 0; i < N; i++)
        assert_true((kvw__req_find_locked(e, KVW_ROLE_PREFILL, mix(i)) != NULL) == (i % 2 == 1));
    free_engine(e);
}

/* Deadlines come out earliest first, however they were set, changed and
 * cleared; a dropped request leaves the heap. */
static void test_deadline_heap(void **state)
{
    (void)state;
    kvw_engine_t *e = bare_engine();
    kvw_req_t **r = calloc(N, sizeof(*r));
    assert_non_null(r);
    for (uint64_t i = 0; i < N; i++) {
        r[i] = kvw__req_new_locked(e, KVW_ROLE_PREFILL, i);
        kvw__req_set_deadline_locked(r[i], 1000 + mix(i) % 100000);
    }
    for (uint64_t i = 0; i < N; i += 3) /* changed */
        kvw__req_set_deadline_locked(r[i], 1000 + mix(i + N) % 100000);
    for (uint64_t i = 1; i < N; i += 7) /* cleared */
        kvw__req_set_deadline_locked(r[i], 0);
    for (uint64_t i = 2; i < N; i += 11) /* dropped */
        kvw__req_drop_locked(r[i]);
    size_t expect = 0;
    for (uint64_t i = 0; i < N; i++)
        expect += i % 7 != 1 && i % 11 != 2;
    assert_int_equal(e->tab.heap_len, expect);
    uint64_t last = 0, popped = 0;
    assert_null(kvw__pop_expired_locked(e, 999)); /* nothing due yet */
    kvw_req_t *x;
    while ((x = kvw__pop_expired_locked(e, UINT64_MAX))) {
        assert_true(x->deadline_ns >= last);
        assert_int_equal(x->heap_pos, 0);
        last = x->deadline_ns;
        popped++;
    }
    assert_int_equal(popped, expect);
    assert_int_equal(kvw__next_deadline_locked(e), 0);
    free(r);
    free_engine(e);
}

/* The work list holds each request once and keeps it alive after it left
 * the table. */
static void test_work_list(void **state)
{
    (void)state;
    kvw_engine_t *e = bare_engine();
    kvw_req_t *a = kvw__req_new_locked(e, KVW_ROLE_PREFILL, 1);
    kvw_req_t *b = kvw__req_new_locked(e, KVW_ROLE_PREFILL, 2);
    kvw__req_touch_locked(a);
    kvw__req_touch_locked(b);
    kvw__req_touch_locked(a); /* once only */
    atomic_fetch_add(&b->refs, 1);
    kvw__req_drop_locked(b); /* off the table, still queued */
    assert_false(b->listed);
    assert_ptr_equal(kvw__pop_work_locked(e), a);
    kvw__req_unref(a);
    assert_ptr_equal(kvw__pop_work_locked(e), b);
    assert_int_equal(atomic_load(&b->refs), 2); /* ours and the list's */
    kvw__req_unref(b);
    kvw__req_unref(b);
    assert_null(kvw__pop_work_locked(e));
    free_engine(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_room_hash),
        cmocka_unit_test(test_deadline_heap),
        cmocka_unit_test(test_work_list),
    };
    return cmocka_run_group_tests_name("request table", tests, NULL, NULL);
}
