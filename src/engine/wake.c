/* SPDX-License-Identifier: Apache-2.0 */
/* Waking the engine's threads: an eventfd write, and the poller's wake-up
 * deferred on a thread that may run the poller's pass itself. Below every
 * other engine file: requests, peers, the poller, the stager and the roles
 * all hand work over this way. */
#include "engine/core.h"

#include "common/log.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

void kvw__wake(int fd)
{
    uint64_t one = 1;
    if (write(fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        KVW_WARN("eventfd wake failed: %s", strerror(errno));
}

/* Per thread: a wake-up on the way to a pass this thread runs itself
 * would be a system call and a second thread contending for the pass. */
static _Thread_local bool wake_deferring, wake_wanted;

void kvw__wake_defer(void)
{
    wake_deferring = true;
    wake_wanted = false;
}

bool kvw__wake_deferred_end(void)
{
    bool wanted = wake_wanted;
    wake_deferring = wake_wanted = false;
    return wanted;
}

void kvw__wake_poller(kvw_engine_t *e)
{
    if (wake_deferring)
        wake_wanted = true;
    else if (atomic_load(&e->poller_sleeping))
        kvw__wake(e->poller_wake_fd);
}
