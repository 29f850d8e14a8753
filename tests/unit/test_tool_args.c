/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for the tools' strict number and address parsing
 * (tools/kvw-tools.h): what every tool accepts on its command line. The
 * tools' own messages and exit codes are checked by
 * tests/tools/tool_args.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../tools/kvw-tools.h"

static uint64_t ok(const char *s, uint64_t min, uint64_t max)
{
    uint64_t v = 12345;
    const char *why = NULL;
    assert_int_equal(kvw_parse_u64(s, min, max, &v, &why), 0);
    assert_null(why);
    return v;
}

static const char *refused(const char *s, uint64_t min, uint64_t max)
{
    uint64_t v = 12345;
    const char *why = NULL;
    assert_int_equal(kvw_parse_u64(s, min, max, &v, &why), -1);
    assert_int_equal(v, 12345); /* untouched */
    assert_non_null(why);
    return why;
}

static void test_decimal(void **state)
{
    (void)state;
    assert_int_equal(ok("0", 0, 10), 0);
    assert_int_equal(ok("10", 0, 10), 10);
    assert_int_equal(ok("010", 0, 100), 10); /* never octal */
    assert_int_equal(ok("0007", 0, 100), 7);
    assert_true(ok("18446744073709551615", 0, UINT64_MAX) == UINT64_MAX);
}

static void test_hex(void **state)
{
    (void)state;
    assert_int_equal(ok("0x10", 0, 100), 16);
    assert_int_equal(ok("0XfF", 0, 1000), 255);
    assert_true(ok("0xffffffffffffffff", 0, UINT64_MAX) == UINT64_MAX);
    assert_string_equal(refused("0x", 0, 100), "not a hex number (0x, then hex digits only)");
    assert_string_equal(refused("0x1g", 0, 100), "not a hex number (0x, then hex digits only)");
    assert_string_equal(refused("0x-1", 0, 100), "not a hex number (0x, then hex digits only)");
}

/* The inputs the issue lists, and their kin. */
static void test_not_numbers(void **state)
{
    (void)state;
    const char *bad[] = {"",   "10x", "1e3", "-1",    "+1",  " 5",
                         "5 ", "1.5", "abc", "1,000", "0b1", "--5"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_non_null(strstr(refused(bad[i], 0, UINT64_MAX), "not a"));
}

static void test_range(void **state)
{
    (void)state;
    assert_string_equal(refused("0", 1, 10), "out of range");
    assert_string_equal(refused("11", 1, 10), "out of range");
    assert_string_equal(refused("18446744073709551616", 0, UINT64_MAX), "out of range");
    assert_string_equal(refused("99999999999999999999999", 0, UINT64_MAX), "out of range");
    assert_string_equal(refused("0x10000000000000000", 0, UINT64_MAX), "out of range");
    assert_string_equal(refused("4294967296", 0, UINT32_MAX), "out of range");
    assert_int_equal(ok("4294967295", 0, UINT32_MAX), UINT32_MAX);
}

static void test_ipv4_port(void **state)
{
    (void)state;
    char host[INET_ADDRSTRLEN];
    uint16_t port = 1;
    const char *why = NULL;
    assert_int_equal(kvw_parse_ipv4_port("127.0.0.1:5555", host, sizeof(host), &port, &why), 0);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 5555);
    assert_int_equal(kvw_parse_ipv4_port("10.0.0.5", host, sizeof(host), &port, &why), 0);
    assert_int_equal(port, 0);
    assert_int_equal(kvw_parse_ipv4_port("10.0.0.5:65535", host, sizeof(host), &port, &why), 0);
    assert_int_equal(port, 65535);
    const char *bad_port[] = {"127.0.0.1:99999", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:80x",
                              "127.0.0.1:65536"};
    for (size_t i = 0; i < sizeof(bad_port) / sizeof(bad_port[0]); i++) {
        assert_int_equal(kvw_parse_ipv4_port(bad_port[i], host, sizeof(host), &port, &why), -1);
        assert_string_equal(why, "the port is not a number from 0 to 65535");
    }
    const char *bad_ip[] = {
        "banana", "banana:5", "1.2.3:5", "256.0.0.1", "", ":5", "1.2.3.4.5.6.7.8.9.10.11.12:5"};
    for (size_t i = 0; i < sizeof(bad_ip) / sizeof(bad_ip[0]); i++) {
        assert_int_equal(kvw_parse_ipv4_port(bad_ip[i], host, sizeof(host), &port, &why), -1);
        assert_string_equal(why, "not an IPv4 address (a.b.c.d)");
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decimal),     cmocka_unit_test(test_hex),
        cmocka_unit_test(test_not_numbers), cmocka_unit_test(test_range),
        cmocka_unit_test(test_ipv4_port),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
