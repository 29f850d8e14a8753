#include "ctrl/zsock.h"

#include "common/log.h"

#include <errno.h>
#include <stdio.h>
#include <stdatomic.h>
#include <string.h>

_Atomic(kvw_zdrop_fn) kvw__zdrop_hook;

bool kvw__zdropped(void *sock, const kvw_msg_t *m)
{
    kvw_zdrop_fn drop = atomic_load_explicit(&kvw__zdrop_hook, memory_order_acquire);
    return drop && drop(sock, m); /* lost on the way: the sender cannot tell */
}

kvw_status_t kvw__zsend_raw(void *sock, const kvw_msg_t *m, int flags)
{
    size_t size = kvw__wire_size(m), len = 0;
    zmq_msg_t z;
    if (zmq_msg_init_size(&z, size))
        return KVW_ERR_NO_MEMORY;
    kvw_status_t st = kvw__wire_encode(m, zmq_msg_data(&z), size, &len);
    if (st) {
        zmq_msg_close(&z);
        return st;
    }
    if (zmq_msg_send(&z, sock, flags) < 0) {
        int err = errno;
        zmq_msg_close(&z);
        if (err != EAGAIN)
            KVW_WARN("zmq send of %s failed: %s", kvw__wire_type_name(m->type), zmq_strerror(err));
        return KVW_ERR_CONTROL;
    }
    return KVW_OK;
}

kvw_status_t kvw__zsend(void *sock, const kvw_msg_t *m, int flags)
{
    return kvw__zdropped(sock, m) ? KVW_OK : kvw__zsend_raw(sock, m, flags);
}

kvw_status_t kvw__zsend_to(void *sock, const void *id, size_t id_len, const kvw_msg_t *m)
{
    /* Decide before the identity frame: a dropped body must not leave a
     * half-sent multi-part message behind. */
    if (kvw__zdropped(sock, m))
        return KVW_OK;
    if (zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return KVW_ERR_CONTROL;
    return kvw__zsend_raw(sock, m, ZMQ_DONTWAIT);
}

kvw_status_t kvw__zrecv(void *sock, kvw_msg_t *m_p, int flags, char *reason, size_t reason_size)
{
    zmq_msg_t z;
    zmq_msg_init(&z);
    if (zmq_msg_recv(&z, sock, flags) < 0) {
        int err = errno;
        zmq_msg_close(&z);
        if (err == EAGAIN)
            return KVW_ERR_NOT_FOUND;
        snprintf(reason, reason_size, "zmq receive failed: %s", zmq_strerror(err));
        return KVW_ERR_CONTROL;
    }
    kvw_status_t st =
        kvw__wire_decode(zmq_msg_data(&z), zmq_msg_size(&z), m_p, reason, reason_size);
    zmq_msg_close(&z);
    return st;
}

void *kvw__zsocket(void *zctx, int type, uint32_t heartbeat_ms)
{
    void *s = zmq_socket(zctx, type);
    if (!s) {
        KVW_ERROR("zmq_socket failed: %s", zmq_strerror(errno));
        return NULL;
    }
    int linger = 0, ivl = (int)heartbeat_ms, timeout = (int)heartbeat_ms * 4;
    int64_t maxmsg = KVW_WIRE_MAX_MSG;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof(timeout));
    return s;
}

void *kvw__zmonitor(void *zctx, void *sock, const char *name, int events)
{
    char ep[96];
    snprintf(ep, sizeof(ep), "inproc://kvw-monitor-%s", name);
    if (zmq_socket_monitor(sock, ep, events)) {
        KVW_WARN("zmq_socket_monitor failed: %s", zmq_strerror(errno));
        return NULL;
    }
    void *pair = zmq_socket(zctx, ZMQ_PAIR);
    int linger = 0;
    if (pair)
        zmq_setsockopt(pair, ZMQ_LINGER, &linger, sizeof(linger));
    if (!pair || zmq_connect(pair, ep)) {
        KVW_WARN("cannot connect a monitor to %s: %s", ep, zmq_strerror(errno));
        if (pair)
            zmq_close(pair);
        zmq_socket_monitor(sock, NULL, 0);
        return NULL;
    }
    return pair;
}

void kvw__zmonitor_close(void *sock, void *monitor)
{
    if (!monitor)
        return;
    if (sock)
        zmq_socket_monitor(sock, NULL, 0);
    zmq_close(monitor);
}

int kvw__zmonitor_event(void *monitor)
{
    /* Frame 1: u16 event id + u32 value; frame 2: the endpoint. */
    uint8_t head[6];
    int n = zmq_recv(monitor, head, sizeof(head), ZMQ_DONTWAIT);
    if (n < 0)
        return 0;
    int more = 0;
    size_t more_len = sizeof(more);
    char rest[256];
    while (zmq_getsockopt(monitor, ZMQ_RCVMORE, &more, &more_len) == 0 && more)
        zmq_recv(monitor, rest, sizeof(rest), 0);
    if (n < 2)
        return -1;
    uint16_t ev;
    memcpy(&ev, head, 2);
    return ev;
}

void kvw__zendpoint(const char *addr, char *buf, size_t size)
{
    if (strncmp(addr, "tcp://", 6) == 0)
        snprintf(buf, size, "%s", addr);
    else
        snprintf(buf, size, "tcp://%s", addr);
}
