/* SPDX-License-Identifier: Apache-2.0 */
/* The control thread's framing, shared by the loop (control.c) and each
 * role's handlers (ctl_prefill.c, ctl_decode.c): receiving a whole ROUTER
 * message, routing one to a peer, failure messages, and the count of
 * dropped messages with its rate-limited log line. Control thread only. */
#include "engine/control.h"

#include "common/log.h"
#include "ctrl/zsock.h"

#include <stdarg.h>
#include <stdio.h>

enum { DROP_LOG_MS = 1000 };

kvw_msg_t kvw__failure_msg(uint16_t type, uint64_t room, uint32_t token, kvw_status_t st,
                           const char *why)
{
    kvw_msg_t m = {.type = type, .status = st < 0 ? st : KVW_ERR_PEER};
    m.u.failed.room = room;
    m.u.failed.token = token;
    snprintf(m.u.failed.reason, sizeof(m.u.failed.reason), "%s", why);
    return m;
}

void kvw__ctl_dropped(kvw_engine_t *e, const char *fmt, ...)
{
    uint64_t drops = atomic_fetch_add(&e->drops, 1) + 1;
    if (!kvw__ratelog_hit(&e->ctl->drop_log, kvw__now_ns(), kvw__ms_ns(DROP_LOG_MS)))
        return;
    char why[KVW_WIRE_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    KVW_WARN("control: dropped a message: %s (%llu dropped so far)", why,
             (unsigned long long)drops);
}

kvw_status_t kvw__ctl_recv_routed(kvw_engine_t *e, void *sock, uint8_t *id, size_t *id_len,
                                  kvw_msg_t *m_p)
{
    int n = zmq_recv(sock, id, KVW_CTL_MAX_ID, ZMQ_DONTWAIT);
    if (n < 0)
        return KVW_ERR_NOT_FOUND;
    if (!kvw__zmore(sock)) {
        kvw__ctl_dropped(e, "an identity frame without a body");
        return KVW_ERR_PROTOCOL;
    }
    char why[KVW_WIRE_REASON_MAX] = "";
    if (kvw__zrecv(sock, m_p, ZMQ_DONTWAIT, why, sizeof(why))) {
        kvw__ctl_dropped(e, "%s", why[0] ? why : "no body frame");
        return KVW_ERR_PROTOCOL;
    }
    *id_len = (size_t)n;
    return KVW_OK;
}

kvw_status_t kvw__ctl_route(kvw_engine_t *e, const uint8_t *id, size_t id_len, const kvw_msg_t *m)
{
    kvw_status_t st = kvw__zsend_to(e->router, id, id_len, m);
    if (st)
        kvw__ctl_dropped(e, "%s to a peer whose connection is gone (unroutable)",
                         kvw__wire_type_name(m->type));
    return st;
}
