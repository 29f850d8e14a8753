/* SPDX-License-Identifier: Apache-2.0 */
/* CRC32C (common/crc32c.c): the standard check value, chaining, and the
 * hardware path against the table on random buffers of every alignment. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/crc32c.h"

static void test_check_value(void **state)
{
    (void)state;
    assert_int_equal(kvw__crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(kvw__crc32c_sw(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(kvw__crc32c(0, "", 0), 0);
    /* 32 zero bytes: RFC 3720 B.4 */
    unsigned char zeros[32] = {0};
    assert_int_equal(kvw__crc32c(0, zeros, sizeof(zeros)), 0x8A9136AAu);
}

static void test_chaining(void **state)
{
    (void)state;
    const char *s = "The quick brown fox jumps over the lazy dog";
    size_t n = strlen(s);
    uint32_t whole = kvw__crc32c(0, s, n);
    for (size_t cut = 0; cut <= n; cut++)
        assert_int_equal(kvw__crc32c(kvw__crc32c(0, s, cut), s + cut, n - cut), whole);
}

static void test_hw_matches_table(void **state)
{
    (void)state;
    if (!kvw__crc32c_hw_available())
        skip(); /* nothing to compare on this CPU */
    enum { MAX = 4099 };
    unsigned char *buf = malloc(MAX + 8);
    assert_non_null(buf);
    srand(28);
    for (size_t i = 0; i < MAX + 8; i++)
        buf[i] = (unsigned char)rand();
    for (size_t off = 0; off < 8; off++)
        for (size_t len = 0; len < MAX; len += 1 + len / 3) {
            uint32_t seed = (uint32_t)rand();
            assert_int_equal(kvw__crc32c_hw(seed, buf + off, len),
                             kvw__crc32c_sw(seed, buf + off, len));
        }
    free(buf);
}

/* One flipped bit anywhere changes the CRC (a CRC catches every error of
 * fewer than its degree's bits in a burst). */
static void test_flip_detected(void **state)
{
    (void)state;
    unsigned char buf[512];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (unsigned char)(i * 7);
    uint32_t good = kvw__crc32c(0, buf, sizeof(buf));
    for (size_t i = 0; i < sizeof(buf); i += 13) {
        buf[i] ^= 0x10;
        assert_int_not_equal(kvw__crc32c(0, buf, sizeof(buf)), good);
        buf[i] ^= 0x10;
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_value),
        cmocka_unit_test(test_chaining),
        cmocka_unit_test(test_hw_matches_table),
        cmocka_unit_test(test_flip_detected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
