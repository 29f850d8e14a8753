/* SPDX-License-Identifier: Apache-2.0 */
/* Log lines (src/common/log.c): their format (time, pid.tid, level,
 * subsystem, engine), KVW_LOG_FILE with %h and %p, KVW_LOG_SUBSYS, lines
 * longer than any fixed buffer, the record handler, and an engine's own
 * lines naming it (fake NIC: not RDMA). */
#include <ctype.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/log.h"
#include "support/engine_pair.h"

static char dir[64], path[256];

static int make_dir(void **state)
{
    (void)state;
    snprintf(dir, sizeof(dir), "/tmp/kvw-test-log-XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(path, sizeof(path), "%s/kvwire.log", dir);
    setenv("KVW_LOG_FILE", path, 1);
    unsetenv("KVW_LOG_SUBSYS");
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    kvw__log_reset();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG); /* reset re-reads the level */
    return 0;
}

static int remove_dir(void **state)
{
    (void)state;
    kvw__log_set_engine(NULL);
    unsetenv("KVW_LOG_FILE");
    unsetenv("KVW_LOG_SUBSYS");
    kvw__log_reset();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_ERROR);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* The file's whole text (freed by the caller). */
static char *slurp(const char *file)
{
    FILE *f = fopen(file, "r");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = calloc(1, (size_t)n + 1);
    assert_non_null(text);
    assert_int_equal(fread(text, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    return text;
}

/* "YYYY-MM-DDTHH:MM:SS.uuuuuuZ " */
static void assert_timestamp(const char *s)
{
    const char *shape = "dddd-dd-ddTdd:dd:dd.ddddddZ ";
    for (size_t i = 0; shape[i]; i++) {
        if (shape[i] == 'd')
            assert_true(isdigit((unsigned char)s[i]));
        else
            assert_int_equal(s[i], shape[i]);
    }
}

static void test_line_format(void **state)
{
    (void)state;
    kvw__log_set_engine("prefill r3 00000000000000ab");
    kvw__log(KVW_LOG_ERROR, KVW_SUB_CTRL, "handshake %s", "refused");
    kvw__log_set_engine(NULL);
    kvw__log(KVW_LOG_INFO, KVW_SUB_MEM, "no engine here");
    char *text = slurp(path);
    char want[160];
    assert_timestamp(text);
    snprintf(want, sizeof(want),
             " kvwire[%ld.%ld] ERROR CTRL prefill r3 00000000000000ab: "
             "handshake refused\n",
             (long)getpid(), (long)syscall(SYS_gettid));
    assert_int_equal(strncmp(text + 27, want, strlen(want)), 0);
    const char *second = text + 27 + strlen(want);
    assert_timestamp(second);
    snprintf(want, sizeof(want), " kvwire[%ld.%ld] INFO MEM: no engine here\n", (long)getpid(),
             (long)syscall(SYS_gettid));
    assert_string_equal(second + 27, want);
    free(text);
}

static void test_file_name_substitution(void **state)
{
    (void)state;
    char host[256] = "";
    gethostname(host, sizeof(host) - 1);
    char pattern[256], expanded[512];
    snprintf(pattern, sizeof(pattern), "%s/kvw-%%h-%%p.log", dir);
    snprintf(expanded, sizeof(expanded), "%s/kvw-%s-%ld.log", dir, host, (long)getpid());
    setenv("KVW_LOG_FILE", pattern, 1);
    kvw__log_reset();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    kvw__log(KVW_LOG_WARN, KVW_SUB_INIT, "to the expanded name");
    char *text = slurp(expanded);
    assert_non_null(strstr(text, " WARN INIT: to the expanded name\n"));
    free(text);
}

static void test_subsystem_filter(void **state)
{
    (void)state;
    setenv("KVW_LOG_SUBSYS", "CTRL,mem", 1);
    kvw__log_reset();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    KVW_DEBUG_IN(KVW_SUB_DATA, "data debug: filtered");
    KVW_DEBUG_IN(KVW_SUB_CTRL, "ctrl debug: kept");
    KVW_DEBUG_IN(KVW_SUB_MEM, "mem debug: kept");
    KVW_INFO("this file is DATA: filtered");
    KVW_ERROR("an error always passes");
    setenv("KVW_LOG_SUBSYS", "^CTRL", 1);
    kvw__log_reset();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    KVW_DEBUG_IN(KVW_SUB_CTRL, "ctrl after ^CTRL: filtered");
    KVW_DEBUG_IN(KVW_SUB_RAIL, "rail after ^CTRL: kept");
    char *text = slurp(path);
    assert_null(strstr(text, "filtered"));
    assert_non_null(strstr(text, " DEBUG CTRL: ctrl debug: kept\n"));
    assert_non_null(strstr(text, " DEBUG MEM: mem debug: kept\n"));
    assert_non_null(strstr(text, " ERROR DATA: an error always passes\n"));
    assert_non_null(strstr(text, " DEBUG RAIL: rail after ^CTRL: kept\n"));
    free(text);
    assert_int_equal(kvw__log_subsys_of("src/engine/ctl_prefill.c"), KVW_SUB_CTRL);
    assert_int_equal(kvw__log_subsys_of("src/engine/verify.c"), KVW_SUB_VERIFY);
    assert_int_equal(kvw__log_subsys_of("src/mem/staging.c"), KVW_SUB_MEM);
    assert_int_equal(kvw__log_subsys_of("src/engine/rejoin.c"), KVW_SUB_RAIL);
    assert_int_equal(kvw__log_subsys_of("poller.c"), KVW_SUB_DATA);
}

static void test_long_line_whole(void **state)
{
    (void)state;
    enum { LONG = 5000 };
    char *big = malloc(LONG + 1);
    assert_non_null(big);
    for (int i = 0; i < LONG; i++)
        big[i] = (char)('a' + i % 26);
    big[LONG] = '\0';
    kvw__log(KVW_LOG_ERROR, KVW_SUB_DATA, "start %s end", big);
    char *text = slurp(path);
    char *at = strstr(text, "ERROR DATA: start ");
    assert_non_null(at);
    at += strlen("ERROR DATA: start ");
    assert_int_equal(strncmp(at, big, LONG), 0);
    assert_string_equal(at + LONG, " end\n");
    free(text);
    free(big);
}

static struct {
    int calls;
    char subsystem[16], engine[64], msg[64], line[256];
} seen;

static void record(void *arg, const kvw_log_record_t *r)
{
    (void)arg;
    seen.calls++;
    snprintf(seen.subsystem, sizeof(seen.subsystem), "%s", r->subsystem);
    snprintf(seen.engine, sizeof(seen.engine), "%s", r->engine);
    snprintf(seen.msg, sizeof(seen.msg), "%s", r->msg);
    snprintf(seen.line, sizeof(seen.line), "%s", r->line);
}

/* The record handler gets every part; the file still gets the line. */
static void test_record_handler(void **state)
{
    (void)state;
    kvw_set_log_record_handler(record, NULL, KVW_LOG_INFO);
    kvw__log_set_engine("decode r1 0000000000000001");
    kvw__log(KVW_LOG_WARN, KVW_SUB_RAIL, "lane %d down", 2);
    kvw__log(KVW_LOG_DEBUG, KVW_SUB_RAIL, "above the level: not delivered");
    kvw__log_set_engine(NULL);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    assert_int_equal(seen.calls, 1);
    assert_string_equal(seen.subsystem, "RAIL");
    assert_string_equal(seen.engine, "decode r1 0000000000000001");
    assert_string_equal(seen.msg, "lane 2 down");
    assert_non_null(strstr(seen.line, " WARN RAIL decode r1 0000000000000001: lane 2 down"));
    char *text = slurp(path);
    assert_non_null(strstr(text, "WARN RAIL decode r1 0000000000000001: lane 2 down\n"));
    free(text);
}

/* An engine's lines, from its creation and its own threads, name it. */
static void test_engine_lines_name_the_engine(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_set_log_handler(NULL, NULL, KVW_LOG_DEBUG);
    assert_int_equal(pair_open(&pair, NULL), KVW_OK);
    pair_room_t pr;
    pair_pick(&pr, 7, 3, 7, 0);
    assert_int_equal(pair_create(&pair, &pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr.r, pr.dst, pr.n, pr.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr.s, pr.n, pr.aux_src), KVW_OK);
    assert_int_equal(kvw_sender_send(pr.s, pr.src, pr.n), KVW_OK);
    assert_int_equal(pair_wait_receiver(&pr, 5000), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(&pr, 5000), KVW_POLL_SUCCESS);
    pair_destroy_room(&pr);
    /* A caller's call that fails names the engine too. */
    kvw_receiver_t *bad = NULL;
    uint64_t far = 1u << 20;
    assert_int_equal(
        kvw_receiver_create(pair.decode, kvw_bootstrap_addr(pair.bootstrap), 0, 8, &bad), KVW_OK);
    assert_int_equal(kvw_receiver_init(bad, &far, 1, KVW_NO_AUX), KVW_ERR_OUT_OF_RANGE);
    kvw_receiver_destroy(bad);
    pair_close(&pair);
    char *text = slurp(path);
    const char *refused = strstr(text, "room 8: ");
    assert_non_null(refused);
    const char *line = refused;
    while (line > text && line[-1] != '\n')
        line--;
    assert_non_null(strstr(line, " decode r"));
    assert_true(strstr(line, " decode r") < refused);
    assert_non_null(strstr(text, "INFO INIT prefill r0 "));  /* creation */
    assert_non_null(strstr(text, "DEBUG CTRL prefill r0 ")); /* its control thread: HELLO */
    assert_non_null(strstr(text, "DEBUG CTRL decode r"));    /* HELLO sent */
    assert_non_null(strstr(text, ": room 7: Success\n"));    /* a request's end, on a poller */
    free(text);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_line_format, make_dir, remove_dir),
        cmocka_unit_test_setup_teardown(test_file_name_substitution, make_dir, remove_dir),
        cmocka_unit_test_setup_teardown(test_subsystem_filter, make_dir, remove_dir),
        cmocka_unit_test_setup_teardown(test_long_line_whole, make_dir, remove_dir),
        cmocka_unit_test_setup_teardown(test_record_handler, make_dir, remove_dir),
        cmocka_unit_test_setup_teardown(test_engine_lines_name_the_engine, make_dir, remove_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
