/* SPDX-License-Identifier: Apache-2.0 */
/* libkvwire with the fake NIC (tests/support/fake_nic.c) built in, for the
 * Python tests on the host: `make python-fake-nic` links the library's
 * objects, the fake NIC and this file into one test-only shared object
 * (never installed), which the tests load as KVWIRE_LIB. It exports the
 * public API as libkvwire.so does, plus the calls below, which a test
 * makes through ctypes to start the fake devices ("fake0", "fake1", both
 * 127.0.0.1) and to delay the wire's writes. It is not RDMA and proves
 * nothing about RDMA: see fake_nic.h. */
#include "support/fake_nic.h"
#include "verbs/ops.h"

#include <string.h>

#define EXPORT __attribute__((visibility("default")))

EXPORT int kvw_test_fake_nic_start(int num_devices);
EXPORT void kvw_test_fake_nic_stop(void);
EXPORT void kvw_test_fake_nic_delay(unsigned delay_us, unsigned ack_delay_us);
EXPORT unsigned long long kvw_test_fake_nic_outstanding(void);

/* Create the devices and make every engine created from now on use them.
 * 0, or -1 (already started). */
int kvw_test_fake_nic_start(int num_devices)
{
    fake_nic_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.num_devices = num_devices;
    if (fake_nic_init(&cfg) != 0)
        return -1;
    kvw__verbs_set_ops(&fake_nic_ops);
    return 0;
}

/* Every engine must be destroyed first. */
void kvw_test_fake_nic_stop(void)
{
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
}

/* Each write posted from now on lands delay_us after its post; a send's
 * completion is seen ack_delay_us after that. 0, 0: no faults. */
void kvw_test_fake_nic_delay(unsigned delay_us, unsigned ack_delay_us)
{
    fake_nic_faults_t f;
    memset(&f, 0, sizeof(f));
    f.delay_us = delay_us;
    f.ack_delay_us = ack_delay_us;
    fake_nic_set_faults(delay_us || ack_delay_us ? &f : NULL);
}

/* Send WRs posted and not yet executed, failed or flushed. */
unsigned long long kvw_test_fake_nic_outstanding(void)
{
    fake_nic_stats_t s;
    fake_nic_stats(&s);
    return (unsigned long long)s.wrs_outstanding;
}
