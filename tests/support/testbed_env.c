/* SPDX-License-Identifier: Apache-2.0 */
#include "support/testbed_env.h"

#include <stdio.h>
#include <stdlib.h>

int tb_device(int i, tb_device_t *dev_p)
{
    char name_var[32], ip_var[32];
    snprintf(name_var, sizeof(name_var), "KVW_TB_DEV%d", i);
    snprintf(ip_var, sizeof(ip_var), "KVW_TB_IP%d", i);
    dev_p->name = getenv(name_var);
    dev_p->ip = getenv(ip_var);
    return dev_p->name && dev_p->ip;
}

const char *tb_mode(void)
{
    const char *m = getenv("KVW_TB_MODE");
    return m ? m : "unknown";
}
