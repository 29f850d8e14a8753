/* SPDX-License-Identifier: Apache-2.0 */
/* What the test bed (tests/tools/kvw-testbed) tells a command about its devices. */
#ifndef KVW_TESTS_TESTBED_ENV_H
#define KVW_TESTS_TESTBED_ENV_H

typedef struct tb_device {
    const char *name;
    const char *ip;
} tb_device_t;

/* Device i (0 or 1) from KVW_TB_DEV<i> / KVW_TB_IP<i>; 0 if absent. */
int tb_device(int i, tb_device_t *dev_p);
/* "vm" (qemu guest with rdma_rxe) or "host". */
const char *tb_mode(void);

#endif
