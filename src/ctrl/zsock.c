#include "ctrl/zsock.h"

#include "common/log.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

kvw_status_t kvw__zsend(void *sock, const kvw_msg_t *m, int flags)
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
            KVW_WARN("zmq send of %s failed: %s", kvw__wire_type_name(m->type),
                     zmq_strerror(err));
        return KVW_ERR_CONTROL;
    }
    return KVW_OK;
}

kvw_status_t kvw__zsend_to(void *sock, const void *id, size_t id_len, const kvw_msg_t *m)
{
    if (zmq_send(sock, id, id_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return KVW_ERR_CONTROL;
    return kvw__zsend(sock, m, ZMQ_DONTWAIT);
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
    kvw_status_t st = kvw__wire_decode(zmq_msg_data(&z), zmq_msg_size(&z), m_p, reason,
                                       reason_size);
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
    int linger = 0, ivl = (int)heartbeat_ms, timeout = (int)heartbeat_ms * 3;
    int64_t maxmsg = KVW_WIRE_MAX_MSG;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &timeout, sizeof(timeout));
    return s;
}

void kvw__zendpoint(const char *addr, char *buf, size_t size)
{
    if (strncmp(addr, "tcp://", 6) == 0)
        snprintf(buf, size, "%s", addr);
    else
        snprintf(buf, size, "tcp://%s", addr);
}
