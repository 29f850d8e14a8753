#include "ctrl/zsock.h"

#include "common/clock.h"
#include "common/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

bool kvw__zmore(void *sock)
{
    int more = 0;
    size_t len = sizeof(more);
    return zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) == 0 && more;
}

int kvw__zskip_rest(void *sock)
{
    int n = 0;
    while (kvw__zmore(sock)) {
        zmq_msg_t z;
        zmq_msg_init(&z);
        int rc = zmq_msg_recv(&z, sock, 0);
        zmq_msg_close(&z);
        if (rc < 0)
            break;
        n++;
    }
    return n;
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
    /* The whole message goes, whatever it holds: a stray frame left behind
     * would be read as the next message (or a ROUTER's next identity). */
    int extra = kvw__zskip_rest(sock);
    kvw_status_t st = KVW_ERR_PROTOCOL;
    if (extra)
        snprintf(reason, reason_size, "a message of %d frames, not 1", extra + 1);
    else
        st = kvw__wire_decode(zmq_msg_data(&z), zmq_msg_size(&z), m_p, reason, reason_size);
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
    (void)heartbeat_ms;
    int linger = 0;
    /* Bounded queues. Receiving: a peer that floods us costs at most
     * KVW_ZSOCK_HWM messages of at most the largest valid one each; beyond
     * that ZeroMQ stops reading its connection (TCP pushes back). Sending:
     * our own messages only (one per request in flight at most, and there
     * are at most 65536 of those), so a burst of requests queues instead of
     * failing; our sends never block. */
    int hwm = KVW_ZSOCK_HWM, send_hwm = KVW_ZSOCK_SEND_HWM, one = 1;
    int64_t maxmsg = KVW_WIRE_MAX_MSG;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s, ZMQ_SNDHWM, &send_hwm, sizeof(send_hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    /* No ZMTP heartbeats: the engines' own PING/PONG (paced by load, see
     * idle_heartbeat_ms) and the sockets' monitors already tell a dead peer,
     * and ZMTP's would wake every idle engine's I/O thread several times a
     * second. */
    /* A reply to a peer whose connection is gone fails (EHOSTUNREACH)
     * instead of vanishing, so the sender can count and log it. */
    if (type == ZMQ_ROUTER)
        zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
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
    kvw__zskip_rest(monitor);
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

/* ------------------------------------------------------------ security */

#define ZAP_ENDPOINT "inproc://zeromq.zap.01" /* fixed by RFC 27 */
#define ZAP_DOMAIN "kvwire"

struct kvw_zsecurity {
    char secret[KVW_ZKEY_Z85_LEN + 1], public_z85[KVW_ZKEY_Z85_LEN + 1];
    uint8_t public_bin[32];
    void *zctx;
    /* ZAP handler: its REP socket and the PAIR it is stopped through
     * belong to the handler thread once started. */
    void *zap, *stop_rx, *stop_tx;
    pthread_t thread;
    bool serving;
    _Atomic uint64_t refused;
};

static bool valid_z85_key(const char *text)
{
    uint8_t bin[32];
    return strlen(text) == KVW_ZKEY_Z85_LEN && zmq_z85_decode(bin, text) != NULL;
}

/* One line of a key file, without its end of line and trailing blanks. */
static void chomp(char *line)
{
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' ||
                 line[n - 1] == '\t'))
        line[--n] = '\0';
}

static kvw_status_t key_from_lines(FILE *f, const char *path, char *key)
{
    char line[256];
    int keys = 0;
    while (fgets(line, sizeof(line), f)) {
        chomp(line);
        if (!line[0] || line[0] == '#')
            continue;
        if (keys++ || !valid_z85_key(line)) {
            /* Never echo the line: it may be (most of) a secret. */
            KVW_ERROR("cluster key file %s: need exactly one key line of %d Z85 characters "
                      "(kvw-keygen writes one)",
                      path, KVW_ZKEY_Z85_LEN);
            return KVW_ERR_INVALID;
        }
        memcpy(key, line, KVW_ZKEY_Z85_LEN + 1);
    }
    if (!keys) {
        KVW_ERROR("cluster key file %s holds no key", path);
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}

kvw_status_t kvw__zkey_read_file(const char *path, char key_z85[KVW_ZKEY_Z85_LEN + 1])
{
    FILE *f = fopen(path, "re");
    if (!f) {
        KVW_ERROR("cannot read cluster key file %s: %s", path, strerror(errno));
        return KVW_ERR_INVALID;
    }
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077))
        KVW_WARN("cluster key file %s is readable by others (mode %03o); chmod 600 it", path,
                 (unsigned)(st.st_mode & 0777));
    char key[KVW_ZKEY_Z85_LEN + 1];
    kvw_status_t rc = key_from_lines(f, path, key);
    fclose(f);
    if (rc == KVW_OK)
        memcpy(key_z85, key, sizeof(key));
    return rc;
}

int kvw__zkey_write_file(const char *path, bool overwrite, char *key_z85_p)
{
    char pub[KVW_ZKEY_Z85_LEN + 1], key[KVW_ZKEY_Z85_LEN + 1];
    if (zmq_curve_keypair(pub, key))
        return errno ? errno : ENOTSUP;
    /* O_EXCL refuses to follow a planted link as well as an existing key. */
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (overwrite ? O_TRUNC : O_EXCL), 0600);
    if (fd < 0)
        return errno;
    int err = fchmod(fd, 0600) ? errno : 0; /* an overwritten file keeps its old mode */
    FILE *f = err ? NULL : fdopen(fd, "w");
    if (!f) {
        err = err ? err : errno;
        close(fd);
        return err;
    }
    fprintf(f,
            "# kvwire cluster key (ZeroMQ CURVE secret key, Z85). Anyone holding it can\n"
            "# join this cluster's control plane: keep it mode 0600, share it only with\n"
            "# the hosts that run kvwire engines and bootstrap services.\n%s\n",
            key);
    if (fflush(f) || fsync(fd))
        err = errno;
    if (fclose(f) && !err)
        err = errno;
    if (!err && key_z85_p)
        memcpy(key_z85_p, key, sizeof(key));
    return err;
}

static void zap_send(void *zap, const char *s, int more)
{
    zmq_send(zap, s, strlen(s), more ? ZMQ_SNDMORE : 0);
}

/* Log refusals at most once a second, with a count, so a scanner cannot
 * flood the log. */
static void zap_note_refusal(kvw_zsecurity_t *sec, const char *address, kvw_ratelog_t *log)
{
    uint64_t total = atomic_fetch_add(&sec->refused, 1) + 1;
    uint64_t unlogged = kvw__ratelog_hit(log, kvw__now_ns(), kvw__ms_ns(1000));
    if (!unlogged)
        return;
    KVW_WARN("refused %llu control connection(s) without the cluster key (latest from %s; "
             "%llu in all)",
             (unsigned long long)unlogged, address, (unsigned long long)total);
}

/* One ZAP request (RFC 27): version, request id, domain, address, routing
 * id, mechanism, then the client's public key for CURVE. Admit only the
 * cluster's own key. */
static void zap_serve_one(kvw_zsecurity_t *sec, kvw_ratelog_t *log)
{
    char frame[6][64] = {{0}};
    uint8_t cred[32];
    size_t cred_len = 0;
    int n = 0, more = 1;
    while (more) {
        char buf[256];
        int len = zmq_recv(sec->zap, buf, sizeof(buf), 0);
        if (len < 0)
            return;
        if (n < 6) {
            size_t keep = (size_t)len < sizeof(buf) ? (size_t)len : sizeof(buf);
            snprintf(frame[n], sizeof(frame[n]), "%.*s", (int)keep, buf);
        } else if (n == 6 && len == 32) {
            memcpy(cred, buf, 32);
            cred_len = 32;
        }
        n++;
        size_t more_len = sizeof(more);
        if (zmq_getsockopt(sec->zap, ZMQ_RCVMORE, &more, &more_len))
            more = 0;
    }
    /* Whatever came, REP owes a reply; anything malformed is refused. */
    bool ok = n == 7 && strcmp(frame[5], "CURVE") == 0 && cred_len == 32 &&
              memcmp(cred, sec->public_bin, 32) == 0;
    if (!ok)
        zap_note_refusal(sec, n > 3 ? frame[3] : "?", log);
    zap_send(sec->zap, "1.0", 1);
    zap_send(sec->zap, frame[1], 1);
    zap_send(sec->zap, ok ? "200" : "400", 1);
    zap_send(sec->zap, ok ? "OK" : "not a cluster key", 1);
    zap_send(sec->zap, ok ? "kvwire" : "", 1); /* user id */
    zap_send(sec->zap, "", 0);                 /* metadata */
}

static void *zap_main(void *arg)
{
    kvw_zsecurity_t *sec = arg;
    kvw_ratelog_t log = {0};
    for (;;) {
        zmq_pollitem_t items[2] = {{sec->zap, 0, ZMQ_POLLIN, 0}, {sec->stop_rx, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break; /* ETERM: the context is going away */
        }
        if (items[1].revents)
            break;
        if (items[0].revents)
            zap_serve_one(sec, &log);
    }
    return NULL;
}

static kvw_status_t zap_start(kvw_zsecurity_t *sec)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://kvw-zap-stop-%p", (void *)sec);
    int linger = 0;
    sec->zap = zmq_socket(sec->zctx, ZMQ_REP);
    sec->stop_rx = zmq_socket(sec->zctx, ZMQ_PAIR);
    sec->stop_tx = zmq_socket(sec->zctx, ZMQ_PAIR);
    if (!sec->zap || !sec->stop_rx || !sec->stop_tx)
        return KVW_ERR_CONTROL;
    zmq_setsockopt(sec->zap, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sec->stop_rx, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sec->stop_tx, ZMQ_LINGER, &linger, sizeof(linger));
    /* Bound here, before any server socket exists: a CURVE server with no
     * handler would admit any client that knows its public key. */
    if (zmq_bind(sec->zap, ZAP_ENDPOINT) || zmq_bind(sec->stop_rx, ep) ||
        zmq_connect(sec->stop_tx, ep)) {
        KVW_ERROR("cannot start the ZeroMQ authentication handler: %s", zmq_strerror(errno));
        return KVW_ERR_CONTROL;
    }
    if (pthread_create(&sec->thread, NULL, zap_main, sec))
        return KVW_ERR_NO_MEMORY;
    sec->serving = true;
    pthread_setname_np(sec->thread, "kvw-zap");
    return KVW_OK;
}

kvw_status_t kvw__zsecurity_create_key(void *zctx, const char *key_z85, bool serve,
                                       kvw_zsecurity_t **sec_p)
{
    if (!key_z85 || !key_z85[0]) {
        *sec_p = NULL;
        return KVW_OK;
    }
    if (!zmq_has("curve")) {
        KVW_ERROR("a cluster key is configured but this libzmq has no CURVE support "
                  "(needs libzmq built with libsodium)");
        return KVW_ERR_UNSUPPORTED;
    }
    if (!valid_z85_key(key_z85)) {
        KVW_ERROR("the cluster key is not %d Z85 characters (kvw-keygen makes one)",
                  KVW_ZKEY_Z85_LEN);
        return KVW_ERR_INVALID;
    }
    kvw_zsecurity_t *sec = calloc(1, sizeof(*sec));
    if (!sec)
        return KVW_ERR_NO_MEMORY;
    sec->zctx = zctx;
    memcpy(sec->secret, key_z85, KVW_ZKEY_Z85_LEN + 1);
    if (zmq_curve_public(sec->public_z85, sec->secret) ||
        !zmq_z85_decode(sec->public_bin, sec->public_z85)) {
        KVW_ERROR("cannot derive the cluster public key: %s", zmq_strerror(errno));
        kvw__zsecurity_destroy(sec);
        return KVW_ERR_INVALID;
    }
    kvw_status_t st = serve ? zap_start(sec) : KVW_OK;
    if (st) {
        kvw__zsecurity_destroy(sec);
        return st;
    }
    *sec_p = sec;
    return KVW_OK;
}

kvw_status_t kvw__zsecurity_create(void *zctx, const kvw_config_t *cfg, bool serve,
                                   kvw_zsecurity_t **sec_p)
{
    /* Checked here too: the bootstrap service takes a config it does not
     * otherwise validate, and unterminated text would be read past. */
    if (!memchr(cfg->cluster_key, '\0', sizeof(cfg->cluster_key)) ||
        !memchr(cfg->cluster_key_file, '\0', sizeof(cfg->cluster_key_file))) {
        KVW_ERROR("config: cluster_key or cluster_key_file is not a terminated string");
        return KVW_ERR_INVALID;
    }
    if (cfg->cluster_key[0] && cfg->cluster_key_file[0]) {
        KVW_ERROR("config: set either cluster_key or cluster_key_file, not both");
        return KVW_ERR_INVALID;
    }
    char key[KVW_ZKEY_Z85_LEN + 1] = "";
    if (cfg->cluster_key_file[0]) {
        kvw_status_t st = kvw__zkey_read_file(cfg->cluster_key_file, key);
        if (st)
            return st;
    } else {
        /* config guarantees termination; create_key checks the length */
        snprintf(key, sizeof(key), "%s", cfg->cluster_key);
    }
    kvw_status_t st = kvw__zsecurity_create_key(zctx, key, serve, sec_p);
    memset(key, 0, sizeof(key));
    return st;
}

void kvw__zsecurity_destroy(kvw_zsecurity_t *sec)
{
    if (!sec)
        return;
    if (sec->serving) {
        zmq_send(sec->stop_tx, "", 0, ZMQ_DONTWAIT);
        pthread_join(sec->thread, NULL);
    }
    if (sec->zap)
        zmq_close(sec->zap);
    if (sec->stop_rx)
        zmq_close(sec->stop_rx);
    if (sec->stop_tx)
        zmq_close(sec->stop_tx);
    memset(sec->secret, 0, sizeof(sec->secret));
    free(sec);
}

uint64_t kvw__zsecurity_refused(const kvw_zsecurity_t *sec)
{
    return sec ? atomic_load(&((kvw_zsecurity_t *)sec)->refused) : 0;
}

static int curve_setup(void *s, int type, const kvw_zsecurity_t *sec)
{
    int one = 1;
    if (type == ZMQ_ROUTER)
        return zmq_setsockopt(s, ZMQ_CURVE_SERVER, &one, sizeof(one)) ||
               zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec->secret, KVW_ZKEY_Z85_LEN + 1) ||
               zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN, strlen(ZAP_DOMAIN));
    return zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, sec->public_z85, KVW_ZKEY_Z85_LEN + 1) ||
           zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, sec->public_z85, KVW_ZKEY_Z85_LEN + 1) ||
           zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec->secret, KVW_ZKEY_Z85_LEN + 1);
}

void *kvw__zsocket_secure(void *zctx, int type, uint32_t heartbeat_ms, const kvw_zsecurity_t *sec)
{
    void *s = kvw__zsocket(zctx, type, heartbeat_ms);
    if (!s || !sec)
        return s;
    if (curve_setup(s, type, sec)) {
        KVW_ERROR("cannot set CURVE security on a socket: %s", zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}
