/* SPDX-License-Identifier: Apache-2.0 */
/* The etcd backend of the fleet registry (registry.h). etcd's v3 API is
 * spoken through its gRPC JSON gateway (POST /v3/..., keys and values
 * base64) with libcurl and json-c, so kvwire needs neither gRPC nor
 * protobuf. Every call tries the listed members in turn, each with a
 * connect and a request timeout, so a dead member costs one refused
 * connect and a hung one at most the request timeout.
 *
 * Keys: PREFIX/rank/N, value the prefill engine's control endpoint (the
 * only thing a decode engine needs before its HELLO), tied to a lease.
 * Prefill's thread keeps the lease alive; a prefill that dies stops doing
 * so and etcd deletes the key when the lease runs out. Decode's thread
 * reads the ranks once and then holds a watch from the revision it read,
 * so every change (a rank gone, a rank moved to another port) is in its
 * table as soon as etcd says it; lookups are a copy under a mutex.
 *
 * Only the registry's thread (or the creating thread, before it starts)
 * makes calls; the curl handles are its own. */
#include "ctrl/registry.h"

#include "common/clock.h"
#include "common/log.h"
#include "ctrl/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool kvw__registry_endpoint_ok(const char *value, size_t len, char *why, size_t why_size)
{
    if (len >= KVW_WIRE_ENDPOINT_MAX) {
        snprintf(why, why_size, "an endpoint of %zu bytes (at most %d)", len,
                 KVW_WIRE_ENDPOINT_MAX - 1);
        return false;
    }
    for (size_t i = 0; i < len; i++)
        if (value[i] < 0x21 || value[i] > 0x7e) {
            snprintf(why, why_size, "an endpoint with a byte 0x%02x at %zu",
                     (unsigned char)value[i], i);
            return false;
        }
    /* Prefill engines bind tcp:// only; another scheme (ipc://, inproc://,
     * pgm://) would have us dial a local file or a multicast group on the
     * registry's word. */
    if (len < 7 || strncmp(value, "tcp://", 6) != 0) {
        snprintf(why, why_size, "an endpoint that is not tcp://: %.64s", value);
        return false;
    }
    return true;
}

kvw_status_t kvw__registry_open_env(kvw_registry_t **reg_p)
{
    const char *url = getenv("KVW_REGISTRY");
    *reg_p = NULL;
    if (!url || !url[0])
        return KVW_OK;
    return kvw__registry_open(url, reg_p);
}

#ifndef KVW_HAVE_ETCD

/* ------------------------------------------------ built without etcd */

kvw_status_t kvw__registry_open(const char *url, kvw_registry_t **reg_p)
{
    *reg_p = NULL;
    if (!url || !url[0])
        return KVW_OK;
    KVW_ERROR("KVW_REGISTRY=%.64s: this kvwire was built without the etcd registry (build it with "
              "libcurl and json-c: `make ETCD=1`, Debian packages libcurl4-openssl-dev and "
              "libjson-c-dev); unset KVW_REGISTRY to use the bootstrap service",
              url);
    return KVW_ERR_UNSUPPORTED;
}

const char *kvw__registry_name(const kvw_registry_t *reg)
{
    (void)reg;
    return "-";
}

kvw_status_t kvw__registry_register(kvw_registry_t *reg, uint32_t rank, const char *endpoint,
                                    uint64_t engine_id, uint32_t lease_ms, uint32_t timeout_ms)
{
    (void)reg, (void)rank, (void)endpoint, (void)engine_id, (void)lease_ms, (void)timeout_ms;
    return KVW_ERR_UNSUPPORTED;
}

kvw_status_t kvw__registry_watch(kvw_registry_t *reg, uint32_t timeout_ms)
{
    (void)reg, (void)timeout_ms;
    return KVW_ERR_UNSUPPORTED;
}

kvw_status_t kvw__registry_lookup(kvw_registry_t *reg, uint32_t rank, char *endpoint,
                                  size_t endpoint_size, char *why, size_t why_size)
{
    (void)reg, (void)rank, (void)endpoint, (void)endpoint_size;
    snprintf(why, why_size, "no registry in this build");
    return KVW_ERR_UNSUPPORTED;
}

uint64_t kvw__registry_events(kvw_registry_t *reg)
{
    (void)reg;
    return 0;
}

void kvw__registry_close(kvw_registry_t *reg, bool unregister)
{
    (void)reg, (void)unregister;
}

#else /* KVW_HAVE_ETCD */

#include <curl/curl.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <pthread.h>
#include <stdatomic.h>

enum {
    MAX_MEMBERS = 16,
    MEMBER_MAX = 160, /* "http://host:port" */
    PREFIX_MAX = 128,
    MAX_RANKS = 4096,            /* as the bootstrap service's table */
    CONNECT_TIMEOUT_MS = 500,    /* a member that does not accept within this is skipped */
    REQUEST_TIMEOUT_MS = 2000,   /* nor one that does not answer within this */
    RETRY_PAUSE_MS = 200,        /* between rounds over all members */
    MAX_ANSWER = 1 << 20,        /* bytes of one answer (or one watch message) */
    MIN_TTL_S = 2,               /* etcd's own floor is about 1.5 s */
    WATCH_KEEPIDLE_S = 2,        /* TCP keepalive on the watch: a vanished host */
    FAIL_LOG_NS = 5000000000ull, /* a failure that goes on is said every 5 s */
};

typedef struct rank_entry {
    char value[KVW_WIRE_ENDPOINT_MAX];
    size_t len; /* the stored value's full length (may exceed what value holds) */
    bool set;
} rank_entry_t;

typedef struct buffer {
    char *data;
    size_t len, cap;
} buffer_t;

struct kvw_registry {
    char name[256]; /* the URL without credentials */
    char members[MAX_MEMBERS][MEMBER_MAX];
    unsigned nmembers, current; /* current: the member that answered last */
    char prefix[PREFIX_MAX];    /* "/kvwire"; keys are PREFIX/rank/N */
    char user[128], password[128];
    char token[1024]; /* etcd's auth token, "" until authenticated */
    char why[256];    /* the last failure, for the error that ends a round */
    CURL *easy, *stream;
    CURLM *multi;
    pthread_t thread;
    bool started;
    atomic_bool stop;
    /* prefill */
    uint32_t rank, ttl_s, keepalive_ms, request_ms;
    uint64_t engine_id;
    char endpoint[KVW_WIRE_ENDPOINT_MAX];
    int64_t lease_id; /* 0: none granted */
    /* decode: the ranks as etcd last said them, under lock */
    pthread_mutex_t lock;
    rank_entry_t *ranks;
    int64_t revision;   /* of the last read or event applied */
    buffer_t line;      /* the watch stream's incomplete message */
    bool watch_restart; /* the watch said to start over (compaction, an error) */
    uint64_t events;    /* watch events applied */
};

/* ------------------------------------------------------------- base64 */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_encode(const char *in, size_t n, char *out, size_t size)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 <= size; i += 3) {
        uint32_t v = (uint32_t)(unsigned char)in[i] << 16;
        if (i + 1 < n)
            v |= (uint32_t)(unsigned char)in[i + 1] << 8;
        if (i + 2 < n)
            v |= (unsigned char)in[i + 2];
        out[o++] = B64[(v >> 18) & 63];
        out[o++] = B64[(v >> 12) & 63];
        out[o++] = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    out[o] = '\0';
}

static int b64_value(char c)
{
    const char *p = c ? strchr(B64, c) : NULL;
    return p ? (int)(p - B64) : -1;
}

/* Strict: whole quads, padding only at the end. The decoded length, or -1.
 * Writes at most size bytes (and counts the rest). */
static long b64_decode(const char *in, char *out, size_t size)
{
    size_t n = strlen(in), o = 0;
    if (n % 4)
        return -1;
    for (size_t i = 0; i < n; i += 4) {
        int pad = (in[i + 3] == '=') + (in[i + 2] == '=' && in[i + 3] == '=');
        if (pad && i + 4 != n)
            return -1;
        int v[4];
        for (int k = 0; k < 4 - pad; k++)
            if ((v[k] = b64_value(in[i + k])) < 0)
                return -1;
        for (int k = 4 - pad; k < 4; k++)
            v[k] = 0;
        uint32_t q =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        char bytes[3] = {(char)(q >> 16), (char)(q >> 8), (char)q};
        for (int k = 0; k < 3 - pad; k++, o++)
            if (o < size)
                out[o] = bytes[k];
    }
    return (long)o;
}

/* ---------------------------------------------------------- the URL */

/* "etcd://[user:password@]h:p[,h:p...][/prefix]" */
static kvw_status_t parse_members(kvw_registry_t *r, const char *hosts, size_t n)
{
    const char *p = hosts, *end = hosts + n;
    if (n && hosts[n - 1] == ',')
        return KVW_ERR_INVALID; /* an empty last member */
    while (p < end) {
        const char *comma = memchr(p, ',', (size_t)(end - p));
        size_t len = (size_t)((comma ? comma : end) - p);
        const char *colon = len ? memrchr(p, ':', len) : NULL;
        if (!len || !colon || colon == p || colon + 1 == p + len || r->nmembers == MAX_MEMBERS ||
            len + 8 >= MEMBER_MAX ||
            strspn(colon + 1, "0123456789") < (size_t)(p + len - colon - 1))
            return KVW_ERR_INVALID;
        snprintf(r->members[r->nmembers++], MEMBER_MAX, "http://%.*s", (int)len, p);
        p = comma ? comma + 1 : end;
    }
    return r->nmembers ? KVW_OK : KVW_ERR_INVALID;
}

static kvw_status_t parse_prefix(kvw_registry_t *r, const char *path)
{
    size_t n = strlen(path);
    while (n && path[n - 1] == '/')
        n--;
    if (!n) {
        snprintf(r->prefix, sizeof(r->prefix), "/kvwire");
        return KVW_OK;
    }
    if (n + 2 > sizeof(r->prefix) ||
        strspn(path, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-/") < n)
        return KVW_ERR_INVALID;
    snprintf(r->prefix, sizeof(r->prefix), "%s%.*s", path[0] == '/' ? "" : "/", (int)n, path);
    return KVW_OK;
}

static kvw_status_t parse_credentials(kvw_registry_t *r, const char *s, size_t n)
{
    const char *colon = memchr(s, ':', n);
    size_t ulen = colon ? (size_t)(colon - s) : n;
    if (!ulen || !colon || ulen >= sizeof(r->user) || n - ulen - 1 >= sizeof(r->password))
        return KVW_ERR_INVALID;
    memcpy(r->user, s, ulen);
    memcpy(r->password, colon + 1, n - ulen - 1);
    return KVW_OK;
}

static kvw_status_t parse_url(kvw_registry_t *r, const char *url)
{
    static const char scheme[] = "etcd://";
    if (strncmp(url, scheme, sizeof(scheme) - 1) != 0)
        return KVW_ERR_INVALID;
    const char *rest = url + sizeof(scheme) - 1;
    const char *slash = strchr(rest, '/');
    const char *hosts_end = slash ? slash : rest + strlen(rest);
    const char *at = memrchr(rest, '@', (size_t)(hosts_end - rest));
    kvw_status_t st = KVW_OK;
    if (at)
        st = parse_credentials(r, rest, (size_t)(at - rest));
    const char *hosts = at ? at + 1 : rest;
    if (!st)
        st = parse_members(r, hosts, (size_t)(hosts_end - hosts));
    if (!st)
        st = parse_prefix(r, slash ? slash : "");
    if (!st)
        snprintf(r->name, sizeof(r->name), "etcd://%s%.*s%s", r->user[0] ? "(user)@" : "",
                 (int)(hosts_end - hosts), hosts, r->prefix);
    return st;
}

/* ---------------------------------------------------------- transport */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_status;

static void init_curl(void)
{
    curl_init_status = curl_global_init(CURL_GLOBAL_DEFAULT);
}

static size_t append(char *p, size_t size, size_t n, void *user)
{
    buffer_t *b = user;
    size_t k = size * n;
    if (b->len + k + 1 > MAX_ANSWER)
        return 0; /* CURLE_WRITE_ERROR: an answer this large is not etcd's */
    if (b->len + k + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + k + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, k);
    b->len += k;
    b->data[b->len] = '\0';
    return k;
}

/* Run one transfer through the multi handle, so that close can interrupt
 * it (curl_multi_wakeup) however long the transfer would take. */
static CURLcode perform(kvw_registry_t *r, CURL *h)
{
    CURLcode res = CURLE_ABORTED_BY_CALLBACK;
    if (curl_multi_add_handle(r->multi, h) != CURLM_OK)
        return CURLE_FAILED_INIT;
    int running = 1;
    while (!atomic_load(&r->stop)) {
        curl_multi_perform(r->multi, &running);
        if (!running)
            break;
        curl_multi_poll(r->multi, NULL, 0, 1000, NULL);
    }
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(r->multi, &left)))
        if (m->msg == CURLMSG_DONE && m->easy_handle == h)
            res = m->data.result;
    curl_multi_remove_handle(r->multi, h);
    return res;
}

/* Sleep ms, or less when close wakes us. */
static void pause_ms(kvw_registry_t *r, uint32_t ms)
{
    if (!atomic_load(&r->stop))
        curl_multi_poll(r->multi, NULL, 0, (int)ms, NULL);
}

static struct curl_slist *headers_for(const kvw_registry_t *r, bool watch)
{
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    char line[sizeof(r->token) + 32];
    if (r->token[0]) {
        snprintf(line, sizeof(line), "Authorization: %s", r->token);
        h = curl_slist_append(h, line);
    }
    /* A member cut off from the cluster's leader ends our watch instead of
     * keeping it open and silent (etcd's require-leader metadata). */
    if (watch)
        h = curl_slist_append(h, "Grpc-Metadata-hasleader: true");
    return h;
}

static void set_request(CURL *h, const char *url, const char *body, struct curl_slist *hdr,
                        long timeout_ms)
{
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)CONNECT_TIMEOUT_MS);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
}

/* etcd's error text from an error answer ({"error": ..., "message": ...}). */
static void answer_error(const char *body, char *why, size_t size)
{
    json_object *o = body ? json_tokener_parse(body) : NULL, *v = NULL;
    if (o &&
        (json_object_object_get_ex(o, "message", &v) || json_object_object_get_ex(o, "error", &v)))
        snprintf(why, size, "%.160s", json_object_get_string(v));
    else
        snprintf(why, size, "an answer that is not JSON");
    json_object_put(o);
}

typedef enum { ANSWERED, UNAUTHENTICATED, REFUSED, UNREACHABLE } outcome_t;

/* One POST to one member. ANSWERED with *out (JSON); REFUSED for a
 * definite no (4xx other than 401); UNREACHABLE for anything that another
 * member may answer. r->why says what went wrong. */
static outcome_t post_once(kvw_registry_t *r, unsigned member, const char *path, const char *body,
                           json_object **out)
{
    char url[MEMBER_MAX + 64];
    snprintf(url, sizeof(url), "%s%s", r->members[member], path);
    buffer_t ans = {0};
    struct curl_slist *hdr = headers_for(r, false);
    set_request(r->easy, url, body, hdr, (long)r->request_ms);
    curl_easy_setopt(r->easy, CURLOPT_WRITEFUNCTION, append);
    curl_easy_setopt(r->easy, CURLOPT_WRITEDATA, &ans);
    /* Decode calls rarely (its watch carries the news): no idle connection
     * kept open per engine. Prefill's keepalives reuse theirs. */
    curl_easy_setopt(r->easy, CURLOPT_FORBID_REUSE, r->ranks ? 1L : 0L);
    CURLcode res = perform(r, r->easy);
    long code = 0;
    curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(hdr);
    outcome_t oc = UNREACHABLE;
    char what[200];
    if (res != CURLE_OK) {
        snprintf(r->why, sizeof(r->why), "%s: %s", r->members[member], curl_easy_strerror(res));
    } else if (code == 200 && (*out = json_tokener_parse(ans.data ? ans.data : ""))) {
        oc = ANSWERED;
    } else {
        answer_error(ans.data, what, sizeof(what));
        snprintf(r->why, sizeof(r->why), "%s: HTTP %ld: %s", r->members[member], code, what);
        oc = code == 401 ? UNAUTHENTICATED : code >= 400 && code < 500 ? REFUSED : UNREACHABLE;
    }
    free(ans.data);
    return oc;
}

static outcome_t authenticate(kvw_registry_t *r, unsigned member)
{
    json_object *req = json_object_new_object(), *ans = NULL, *tok;
    json_object_object_add(req, "name", json_object_new_string(r->user));
    json_object_object_add(req, "password", json_object_new_string(r->password));
    r->token[0] = '\0';
    outcome_t oc = post_once(r, member, "/v3/auth/authenticate",
                             json_object_to_json_string_ext(req, JSON_C_TO_STRING_PLAIN), &ans);
    json_object_put(req);
    if (oc == UNAUTHENTICATED)
        oc = REFUSED; /* wrong name or password */
    if (oc == ANSWERED) {
        if (json_object_object_get_ex(ans, "token", &tok) &&
            strlen(json_object_get_string(tok)) < sizeof(r->token))
            snprintf(r->token, sizeof(r->token), "%s", json_object_get_string(tok));
        else {
            snprintf(r->why, sizeof(r->why), "%s: authentication gave no usable token",
                     r->members[member]);
            oc = REFUSED;
        }
    }
    json_object_put(ans);
    return oc;
}

/* One round over the members, from the one that answered last. KVW_OK
 * with *out; KVW_ERR_CONTROL for a definite refusal (permissions, bad
 * credentials); KVW_ERR_TIMEOUT when no member answered. r->why says. */
static kvw_status_t call(kvw_registry_t *r, const char *path, json_object *req, json_object **out)
{
    const char *body = json_object_to_json_string_ext(req, JSON_C_TO_STRING_PLAIN);
    *out = NULL;
    for (unsigned tries = 0; tries < r->nmembers && !atomic_load(&r->stop); tries++) {
        unsigned m = (r->current + tries) % r->nmembers;
        outcome_t oc = ANSWERED;
        if (r->user[0] && !r->token[0])
            oc = authenticate(r, m);
        if (oc == ANSWERED)
            oc = post_once(r, m, path, body, out);
        if (oc == UNAUTHENTICATED && r->user[0]) { /* the token expired */
            KVW_DEBUG("etcd registry %s: %s; logging in again", r->name, r->why);
            if (authenticate(r, m) == ANSWERED)
                oc = post_once(r, m, path, body, out);
        }
        if (oc == ANSWERED) {
            r->current = m;
            return KVW_OK;
        }
        if (oc == REFUSED || oc == UNAUTHENTICATED)
            return KVW_ERR_CONTROL;
    }
    return KVW_ERR_TIMEOUT;
}

/* A call retried round after round until deadline (monotonic ns). */
static kvw_status_t call_until(kvw_registry_t *r, const char *path, json_object *req,
                               json_object **out, uint64_t deadline)
{
    for (;;) {
        kvw_status_t st = call(r, path, req, out);
        if (st != KVW_ERR_TIMEOUT || kvw__now_ns() + kvw__ms_ns(RETRY_PAUSE_MS) >= deadline ||
            atomic_load(&r->stop))
            return st;
        pause_ms(r, RETRY_PAUSE_MS);
    }
}

/* ------------------------------------------------------------ helpers */

static json_object *b64_string(const char *s, size_t n)
{
    char enc[4 * (PREFIX_MAX + KVW_WIRE_ENDPOINT_MAX) / 3 + 8];
    b64_encode(s, n, enc, sizeof(enc));
    return json_object_new_string(enc);
}

static json_object *int64_string(int64_t v)
{
    char s[24];
    snprintf(s, sizeof(s), "%" PRId64, v);
    return json_object_new_string(s);
}

static int64_t get_int64(json_object *o, const char *key)
{
    json_object *v;
    return json_object_object_get_ex(o, key, &v) ? json_object_get_int64(v) : 0;
}

static size_t rank_key(const kvw_registry_t *r, uint32_t rank, char *key, size_t size)
{
    int n = snprintf(key, size, "%s/rank/%u", r->prefix, rank);
    return n < 0 ? 0 : (size_t)n;
}

/* The value of a base64 field, decoded into out (size bytes, NUL added when
 * it fits); its full length, or -1. */
static long get_b64(json_object *o, const char *key, char *out, size_t size)
{
    json_object *v;
    if (!json_object_object_get_ex(o, key, &v)) {
        out[0] = '\0';
        return 0; /* etcd leaves empty values out */
    }
    long n = b64_decode(json_object_get_string(v), out, size);
    if (n >= 0 && (size_t)n < size)
        out[n] = '\0';
    else if (size)
        out[size - 1] = '\0';
    return n;
}

/* "tcp://10.0.0.1:5555" and "tcp://10.0.0.1:6000" are on the same host. */
static bool same_host(const char *a, const char *b)
{
    const char *ca = strrchr(a, ':'), *cb = strrchr(b, ':');
    return ca && cb && ca - a == cb - b && strncmp(a, b, (size_t)(ca - a)) == 0;
}

/* ------------------------------------------------------------ prefill */

static kvw_status_t grant_lease(kvw_registry_t *r, uint64_t deadline)
{
    json_object *req = json_object_new_object(), *ans;
    json_object_object_add(req, "TTL", int64_string(r->ttl_s));
    kvw_status_t st = call_until(r, "/v3/lease/grant", req, &ans, deadline);
    json_object_put(req);
    if (st)
        return st;
    r->lease_id = get_int64(ans, "ID");
    json_object_put(ans);
    if (!r->lease_id) {
        snprintf(r->why, sizeof(r->why), "lease grant answered without a lease");
        return KVW_ERR_CONTROL;
    }
    return KVW_OK;
}

static json_object *put_op(const kvw_registry_t *r, const char *key, size_t klen)
{
    json_object *put = json_object_new_object();
    json_object_object_add(put, "key", b64_string(key, klen));
    json_object_object_add(put, "value", b64_string(r->endpoint, strlen(r->endpoint)));
    json_object_object_add(put, "lease", int64_string(r->lease_id));
    return put;
}

/* Put our key if nobody holds it; else *holder gets the holder's value and
 * *holder_lease its lease. */
static kvw_status_t put_if_free(kvw_registry_t *r, uint64_t deadline, bool *put, char *holder,
                                size_t size, int64_t *holder_lease)
{
    char key[PREFIX_MAX + 32];
    size_t klen = rank_key(r, r->rank, key, sizeof(key));
    json_object *req = json_object_new_object(), *cmp = json_object_new_object();
    json_object *ok = json_object_new_object(), *fail = json_object_new_object();
    json_object *range = json_object_new_object(), *ans = NULL;
    json_object_object_add(cmp, "key", b64_string(key, klen));
    json_object_object_add(cmp, "target", json_object_new_string("CREATE"));
    json_object_object_add(cmp, "create_revision", int64_string(0));
    json_object_object_add(ok, "request_put", put_op(r, key, klen));
    json_object_object_add(range, "key", b64_string(key, klen));
    json_object_object_add(fail, "request_range", range);
    json_object *cmps = json_object_new_array(), *oks = json_object_new_array();
    json_object *fails = json_object_new_array();
    json_object_array_add(cmps, cmp);
    json_object_array_add(oks, ok);
    json_object_array_add(fails, fail);
    json_object_object_add(req, "compare", cmps);
    json_object_object_add(req, "success", oks);
    json_object_object_add(req, "failure", fails);
    kvw_status_t st = call_until(r, "/v3/kv/txn", req, &ans, deadline);
    json_object_put(req);
    if (st)
        return st;
    json_object *v, *resp, *rr, *kvs;
    *put = json_object_object_get_ex(ans, "succeeded", &v) && json_object_get_boolean(v);
    holder[0] = '\0';
    *holder_lease = 0;
    if (!*put && json_object_object_get_ex(ans, "responses", &resp) &&
        json_object_array_length(resp) == 1 &&
        json_object_object_get_ex(json_object_array_get_idx(resp, 0), "response_range", &rr) &&
        json_object_object_get_ex(rr, "kvs", &kvs) && json_object_array_length(kvs) == 1) {
        get_b64(json_object_array_get_idx(kvs, 0), "value", holder, size);
        *holder_lease = get_int64(json_object_array_get_idx(kvs, 0), "lease");
    }
    json_object_put(ans);
    return KVW_OK;
}

static kvw_status_t put_key(kvw_registry_t *r, uint64_t deadline)
{
    char key[PREFIX_MAX + 32];
    size_t klen = rank_key(r, r->rank, key, sizeof(key));
    json_object *req = put_op(r, key, klen), *ans;
    kvw_status_t st = call_until(r, "/v3/kv/put", req, &ans, deadline);
    json_object_put(req);
    if (!st)
        json_object_put(ans);
    return st;
}

/* Claim our rank once: KVW_OK, KVW_ERR_EXISTS while another engine on
 * another host holds it (holder says where), or the call's failure. */
static kvw_status_t claim(kvw_registry_t *r, uint64_t deadline, char *holder, size_t size)
{
    kvw_status_t st = r->lease_id ? KVW_OK : grant_lease(r, deadline);
    bool put = false;
    int64_t holder_lease = 0;
    if (!st)
        st = put_if_free(r, deadline, &put, holder, size, &holder_lease);
    if (st || put || holder_lease == r->lease_id)
        return st;
    /* As the bootstrap service does: a prefill restarted on the same host
     * (its predecessor died without revoking) takes its rank back at once;
     * another host waits for the holder's lease. */
    if (!same_host(holder, r->endpoint))
        return KVW_ERR_EXISTS;
    KVW_INFO("etcd registry %s: rank %u: %s takes over from %s (same host)", r->name, r->rank,
             r->endpoint, holder);
    return put_key(r, deadline);
}

static kvw_status_t keepalive(kvw_registry_t *r)
{
    json_object *req = json_object_new_object(), *ans, *res;
    json_object_object_add(req, "ID", int64_string(r->lease_id));
    kvw_status_t st = call(r, "/v3/lease/keepalive", req, &ans);
    json_object_put(req);
    if (st)
        return st;
    /* {"result": {"ID": .., "TTL": ..}}; no TTL: the lease is gone. */
    bool alive = json_object_object_get_ex(ans, "result", &res) && get_int64(res, "TTL") > 0;
    json_object_put(ans);
    return alive ? KVW_OK : KVW_ERR_NOT_FOUND;
}

/* Say a failure that goes on every FAIL_LOG_NS, and its end once. */
static void note_outcome(kvw_registry_t *r, const char *what, kvw_status_t st, uint64_t *since,
                         uint64_t *logged)
{
    uint64_t now = kvw__now_ns();
    if (st == KVW_OK) {
        if (*since)
            KVW_WARN("etcd registry %s: %s works again after %" PRIu64 " ms", r->name, what,
                     (now - *since) / 1000000);
        *since = 0;
        return;
    }
    if (!*since)
        *since = now;
    if (now - *logged >= FAIL_LOG_NS) {
        *logged = now;
        KVW_WARN("etcd registry %s: %s failed: %s", r->name, what, r->why);
    }
}

static void *keepalive_main(void *arg)
{
    kvw_registry_t *r = arg;
    uint64_t failing_since = 0, logged = 0;
    kvw_status_t st = KVW_OK;
    while (!atomic_load(&r->stop)) {
        pause_ms(r, st ? RETRY_PAUSE_MS : r->keepalive_ms);
        if (atomic_load(&r->stop))
            break;
        st = keepalive(r);
        if (st == KVW_ERR_NOT_FOUND) { /* expired while we could not reach etcd */
            KVW_WARN("etcd registry %s: rank %u's lease ran out; registering again", r->name,
                     r->rank);
            r->lease_id = 0;
        }
        if (st == KVW_ERR_NOT_FOUND || (st == KVW_OK && !r->lease_id)) {
            char holder[KVW_WIRE_ENDPOINT_MAX];
            st = claim(r, kvw__now_ns() + kvw__ms_ns(r->keepalive_ms), holder, sizeof(holder));
            if (st == KVW_ERR_EXISTS)
                snprintf(r->why, sizeof(r->why), "rank %u is held by %s", r->rank, holder);
        }
        note_outcome(r, "keeping the rank registered", st, &failing_since, &logged);
    }
    return NULL;
}

/* ------------------------------------------------------------- decode */

/* Rank N of "PREFIX/rank/N", or -1 for a key that is not one. */
static long key_rank(const kvw_registry_t *r, const char *key, long len)
{
    size_t plen = strlen(r->prefix);
    if (len < 0 || (size_t)len <= plen + 6 || strncmp(key, r->prefix, plen) != 0 ||
        strncmp(key + plen, "/rank/", 6) != 0)
        return -1;
    const char *d = key + plen + 6;
    size_t n = (size_t)len - plen - 6;
    if (n > 4 || strspn(d, "0123456789") != n || (n > 1 && d[0] == '0'))
        return -1;
    long rank = strtol(d, NULL, 10);
    return rank < MAX_RANKS ? rank : -1;
}

/* One key-value from etcd into table (the caller holds what it needs). */
static void take_kv(const kvw_registry_t *r, rank_entry_t *table, json_object *kv, bool deleted)
{
    char key[PREFIX_MAX + 32];
    long klen = get_b64(kv, "key", key, sizeof(key));
    long rank = klen < (long)sizeof(key) ? key_rank(r, key, klen) : -1;
    if (rank < 0)
        return; /* not ours: another tool's key under the prefix */
    rank_entry_t *e = &table[rank];
    memset(e, 0, sizeof(*e));
    if (deleted)
        return;
    long n = get_b64(kv, "value", e->value, sizeof(e->value));
    if (n < 0) { /* etcd's gateway does not send this; keep the rank unusable */
        snprintf(e->value, sizeof(e->value), "(not base64)");
        n = KVW_WIRE_ENDPOINT_MAX;
    }
    e->len = (size_t)n;
    e->set = true;
}

/* Read every rank; the table is replaced whole (deletions missed while the
 * watch was down are gone too). */
static kvw_status_t read_ranks(kvw_registry_t *r, uint64_t deadline)
{
    char from[PREFIX_MAX + 8], to[PREFIX_MAX + 8];
    int n = snprintf(from, sizeof(from), "%s/rank/", r->prefix);
    memcpy(to, from, (size_t)n + 1);
    to[n - 1] = '/' + 1; /* the range's end: every key with the prefix */
    json_object *req = json_object_new_object(), *ans, *kvs;
    json_object_object_add(req, "key", b64_string(from, (size_t)n));
    json_object_object_add(req, "range_end", b64_string(to, (size_t)n));
    kvw_status_t st = call_until(r, "/v3/kv/range", req, &ans, deadline);
    json_object_put(req);
    if (st)
        return st;
    rank_entry_t *fresh = calloc(MAX_RANKS, sizeof(*fresh));
    if (!fresh) {
        json_object_put(ans);
        return KVW_ERR_NO_MEMORY;
    }
    json_object *header;
    int64_t rev =
        json_object_object_get_ex(ans, "header", &header) ? get_int64(header, "revision") : 0;
    if (json_object_object_get_ex(ans, "kvs", &kvs))
        for (size_t i = 0; i < json_object_array_length(kvs); i++)
            take_kv(r, fresh, json_object_array_get_idx(kvs, i), false);
    json_object_put(ans);
    pthread_mutex_lock(&r->lock);
    memcpy(r->ranks, fresh, MAX_RANKS * sizeof(*fresh));
    r->revision = rev;
    pthread_mutex_unlock(&r->lock);
    free(fresh);
    return KVW_OK;
}

/* One message of the watch stream: {"result": {...events...}} or an error. */
static void on_watch_message(kvw_registry_t *r, const char *text)
{
    json_object *o = json_tokener_parse(text), *res, *v, *events;
    if (!o || !json_object_object_get_ex(o, "result", &res)) {
        answer_error(text, r->why, sizeof(r->why));
        r->watch_restart = true;
        json_object_put(o);
        return;
    }
    if (json_object_object_get_ex(res, "canceled", &v) && json_object_get_boolean(v)) {
        snprintf(r->why, sizeof(r->why), "the watch was cancelled (compacted at %" PRId64 ")",
                 get_int64(res, "compact_revision"));
        r->watch_restart = true;
    } else if (json_object_object_get_ex(res, "events", &events)) {
        pthread_mutex_lock(&r->lock);
        for (size_t i = 0; i < json_object_array_length(events); i++) {
            json_object *ev = json_object_array_get_idx(events, i), *type, *kv;
            bool deleted = json_object_object_get_ex(ev, "type", &type) &&
                           strcmp(json_object_get_string(type), "DELETE") == 0;
            if (json_object_object_get_ex(ev, "kv", &kv)) {
                take_kv(r, r->ranks, kv, deleted);
                r->revision = get_int64(kv, "mod_revision");
            }
            r->events++;
        }
        pthread_mutex_unlock(&r->lock);
    }
    json_object_put(o);
}

/* The stream's bytes: one JSON message a line. */
static size_t on_watch_data(char *p, size_t size, size_t n, void *user)
{
    kvw_registry_t *r = user;
    size_t k = append(p, size, n, &r->line);
    if (k != size * n)
        return 0;
    char *nl;
    while ((nl = memchr(r->line.data, '\n', r->line.len))) {
        *nl = '\0';
        if (nl > r->line.data)
            on_watch_message(r, r->line.data);
        size_t used = (size_t)(nl + 1 - r->line.data);
        memmove(r->line.data, nl + 1, r->line.len - used + 1);
        r->line.len -= used;
    }
    return r->watch_restart ? 0 : k;
}

/* Hold a watch on the ranks from the revision after the last read until it
 * ends (the member went, etcd cancelled it, close). */
static void watch_ranks(kvw_registry_t *r)
{
    char from[PREFIX_MAX + 8], to[PREFIX_MAX + 8], url[MEMBER_MAX + 16];
    int n = snprintf(from, sizeof(from), "%s/rank/", r->prefix);
    memcpy(to, from, (size_t)n + 1);
    to[n - 1] = '/' + 1;
    json_object *req = json_object_new_object(), *create = json_object_new_object();
    json_object_object_add(create, "key", b64_string(from, (size_t)n));
    json_object_object_add(create, "range_end", b64_string(to, (size_t)n));
    pthread_mutex_lock(&r->lock);
    json_object_object_add(create, "start_revision", int64_string(r->revision + 1));
    pthread_mutex_unlock(&r->lock);
    json_object_object_add(req, "create_request", create);
    snprintf(url, sizeof(url), "%s/v3/watch", r->members[r->current]);
    struct curl_slist *hdr = headers_for(r, true);
    set_request(r->stream, url, json_object_to_json_string_ext(req, JSON_C_TO_STRING_PLAIN), hdr,
                0);
    curl_easy_setopt(r->stream, CURLOPT_WRITEFUNCTION, on_watch_data);
    curl_easy_setopt(r->stream, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(r->stream, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(r->stream, CURLOPT_TCP_KEEPIDLE, (long)WATCH_KEEPIDLE_S);
    curl_easy_setopt(r->stream, CURLOPT_TCP_KEEPINTVL, 1L);
    r->line.len = 0;
    r->watch_restart = false;
    CURLcode res = perform(r, r->stream);
    if (!r->watch_restart)
        snprintf(r->why, sizeof(r->why), "%s: the watch ended: %s", r->members[r->current],
                 curl_easy_strerror(res));
    curl_slist_free_all(hdr);
    json_object_put(req);
}

static void *watch_main(void *arg)
{
    kvw_registry_t *r = arg;
    uint64_t failing_since = 0, logged = 0;
    while (!atomic_load(&r->stop)) {
        watch_ranks(r);
        if (atomic_load(&r->stop))
            break;
        /* The member went (or cancelled): the next one reads the ranks again
         * and watches from there. */
        r->current = (r->current + 1) % r->nmembers;
        note_outcome(r, "watching the ranks", KVW_ERR_CONTROL, &failing_since, &logged);
        kvw_status_t st;
        while ((st = read_ranks(r, kvw__now_ns() + kvw__ms_ns(REQUEST_TIMEOUT_MS))) &&
               !atomic_load(&r->stop)) {
            note_outcome(r, "reading the ranks", st, &failing_since, &logged);
            pause_ms(r, RETRY_PAUSE_MS);
        }
        if (!st)
            note_outcome(r, "watching the ranks", KVW_OK, &failing_since, &logged);
    }
    return NULL;
}

/* ---------------------------------------------------------------- API */

kvw_status_t kvw__registry_open(const char *url, kvw_registry_t **reg_p)
{
    *reg_p = NULL;
    if (!url || !url[0])
        return KVW_OK;
    kvw_registry_t *r = calloc(1, sizeof(*r));
    if (!r)
        return KVW_ERR_NO_MEMORY;
    if (parse_url(r, url)) {
        KVW_ERROR("KVW_REGISTRY: cannot read \"%.*s...\": the form is etcd://[user:password@]"
                  "host:port[,host:port...][/prefix]",
                  (int)(strchr(url, '@') ? 0 : 64), url);
        free(r);
        return KVW_ERR_INVALID;
    }
    pthread_once(&curl_once, init_curl);
    pthread_mutex_init(&r->lock, NULL);
    r->request_ms = REQUEST_TIMEOUT_MS;
    if (curl_init_status != CURLE_OK || !(r->easy = curl_easy_init()) ||
        !(r->stream = curl_easy_init()) || !(r->multi = curl_multi_init())) {
        KVW_ERROR("etcd registry %s: cannot set up libcurl", r->name);
        kvw__registry_close(r, false);
        return KVW_ERR_NO_MEMORY;
    }
    *reg_p = r;
    return KVW_OK;
}

const char *kvw__registry_name(const kvw_registry_t *reg)
{
    return reg->name;
}

static void log_unreachable(const kvw_registry_t *r, const char *what, uint32_t timeout_ms)
{
    KVW_ERROR("etcd registry %s: cannot %s: no member answered within %u ms (last: %s)", r->name,
              what, timeout_ms, r->why);
}

kvw_status_t kvw__registry_register(kvw_registry_t *r, uint32_t rank, const char *endpoint,
                                    uint64_t engine_id, uint32_t lease_ms, uint32_t timeout_ms)
{
    if (rank >= MAX_RANKS || strlen(endpoint) >= sizeof(r->endpoint)) {
        KVW_ERROR("etcd registry %s: cannot register rank %u: ranks are 0..%d", r->name, rank,
                  MAX_RANKS - 1);
        return KVW_ERR_OUT_OF_RANGE;
    }
    r->rank = rank;
    r->engine_id = engine_id;
    snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    r->ttl_s = (lease_ms + 999) / 1000 < MIN_TTL_S ? MIN_TTL_S : (lease_ms + 999) / 1000;
    r->keepalive_ms = r->ttl_s * 1000 / 3;
    /* A keepalive stuck on one member must leave time for the others. */
    r->request_ms = r->keepalive_ms < REQUEST_TIMEOUT_MS ? r->keepalive_ms : REQUEST_TIMEOUT_MS;
    uint64_t start = kvw__now_ns(), deadline = start + kvw__ms_ns(timeout_ms);
    uint64_t give_up = start + kvw__ms_ns((uint64_t)r->ttl_s * 1000 + r->keepalive_ms);
    char holder[KVW_WIRE_ENDPOINT_MAX] = "";
    kvw_status_t st;
    while ((st = claim(r, deadline, holder, sizeof(holder))) == KVW_ERR_EXISTS &&
           kvw__now_ns() + kvw__ms_ns(RETRY_PAUSE_MS) < (give_up < deadline ? give_up : deadline))
        pause_ms(r, RETRY_PAUSE_MS); /* a dead holder's lease may still run out */
    if (st == KVW_ERR_EXISTS)
        KVW_ERROR("etcd registry %s: cannot register rank %u at %s: another live engine holds it "
                  "(at %s)",
                  r->name, rank, endpoint, holder);
    else if (st == KVW_ERR_TIMEOUT)
        log_unreachable(r, "register", timeout_ms);
    else if (st)
        KVW_ERROR("etcd registry %s: cannot register rank %u: %s", r->name, rank, r->why);
    if (st)
        return st;
    KVW_INFO("etcd registry %s: rank %u registered at %s (lease %" PRIx64 ", TTL %u s)", r->name,
             rank, endpoint, (uint64_t)r->lease_id, r->ttl_s);
    if (pthread_create(&r->thread, NULL, keepalive_main, r))
        return KVW_ERR_NO_MEMORY;
    r->started = true;
    pthread_setname_np(r->thread, "kvw-etcd");
    return KVW_OK;
}

kvw_status_t kvw__registry_watch(kvw_registry_t *r, uint32_t timeout_ms)
{
    r->ranks = calloc(MAX_RANKS, sizeof(*r->ranks));
    if (!r->ranks)
        return KVW_ERR_NO_MEMORY;
    kvw_status_t st = read_ranks(r, kvw__now_ns() + kvw__ms_ns(timeout_ms));
    if (st == KVW_ERR_TIMEOUT)
        log_unreachable(r, "read the ranks", timeout_ms);
    else if (st)
        KVW_ERROR("etcd registry %s: cannot read the ranks: %s", r->name, r->why);
    if (st)
        return st;
    if (pthread_create(&r->thread, NULL, watch_main, r))
        return KVW_ERR_NO_MEMORY;
    r->started = true;
    pthread_setname_np(r->thread, "kvw-etcd");
    return KVW_OK;
}

kvw_status_t kvw__registry_lookup(kvw_registry_t *r, uint32_t rank, char *endpoint,
                                  size_t endpoint_size, char *why, size_t why_size)
{
    if (rank >= MAX_RANKS || !r->ranks) {
        snprintf(why, why_size, "rank %u is outside the registry (at most %d)", rank,
                 MAX_RANKS - 1);
        return KVW_ERR_OUT_OF_RANGE;
    }
    pthread_mutex_lock(&r->lock);
    rank_entry_t e = r->ranks[rank];
    pthread_mutex_unlock(&r->lock);
    if (!e.set)
        return KVW_ERR_NOT_FOUND;
    char bad[160];
    if (!kvw__registry_endpoint_ok(e.value, e.len, bad, sizeof(bad)) || e.len >= endpoint_size) {
        snprintf(why, why_size, "%s gave rank %u %s", r->name, rank, bad);
        return KVW_ERR_PROTOCOL;
    }
    memcpy(endpoint, e.value, e.len + 1);
    return KVW_OK;
}

uint64_t kvw__registry_events(kvw_registry_t *r)
{
    pthread_mutex_lock(&r->lock);
    uint64_t n = r->events;
    pthread_mutex_unlock(&r->lock);
    return n;
}

static void revoke(kvw_registry_t *r)
{
    json_object *req = json_object_new_object(), *ans;
    json_object_object_add(req, "ID", int64_string(r->lease_id));
    if (call(r, "/v3/lease/revoke", req, &ans) == KVW_OK)
        json_object_put(ans);
    else
        KVW_WARN("etcd registry %s: could not remove rank %u (%s); it goes when its lease runs "
                 "out",
                 r->name, r->rank, r->why);
    json_object_put(req);
}

void kvw__registry_close(kvw_registry_t *r, bool unregister)
{
    if (!r)
        return;
    if (r->started) {
        atomic_store(&r->stop, true);
        curl_multi_wakeup(r->multi);
        pthread_join(r->thread, NULL);
        atomic_store(&r->stop, false); /* for the revoke below */
    }
    if (unregister && r->lease_id) {
        r->request_ms = CONNECT_TIMEOUT_MS; /* best effort: a clean exit stays quick */
        revoke(r);
    }
    if (r->easy)
        curl_easy_cleanup(r->easy);
    if (r->stream)
        curl_easy_cleanup(r->stream);
    if (r->multi)
        curl_multi_cleanup(r->multi);
    pthread_mutex_destroy(&r->lock);
    free(r->ranks);
    free(r->line.data);
    free(r);
}

#endif /* KVW_HAVE_ETCD */
