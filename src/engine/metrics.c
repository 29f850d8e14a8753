/* SPDX-License-Identifier: Apache-2.0 */
/* An engine's counters in the OpenMetrics text format (kvw_engine_metrics_text),
 * and what the counters alone do not keep: failures by cause, bytes by
 * outcome, the latency histograms. Family names and meanings:
 * docs/operations.md, "Metrics". */
#include "engine/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------- counting */

static void hist_observe(kvw_hist_t *h, uint64_t ns)
{
    uint64_t us = ns / 1000;
    /* The smallest bucket whose bound 2^(i+3) us holds us. */
    unsigned i = us <= 8 ? 0 : (unsigned)(64 - __builtin_clzll(us - 1)) - 3;
    if (i > KVW_HIST_BUCKETS)
        i = KVW_HIST_BUCKETS;
    atomic_fetch_add_explicit(&h->bucket[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

/* Data posted to data landed: prefill, its first post to its last write's
 * completion; decode, its REQUEST to the final immediate. 0: unknown. */
static uint64_t transfer_ns(const kvw_req_t *r, uint64_t now)
{
    uint64_t start, end;
    if (r->role == KVW_ROLE_PREFILL) {
        start = atomic_load_explicit(&r->tx.first_post_ns, memory_order_relaxed);
        end = atomic_load_explicit(&r->tx.done_ns, memory_order_relaxed);
    } else {
        start = atomic_load_explicit(&r->rx.sent_ns, memory_order_relaxed);
        end = atomic_load_explicit(&r->rx.landed_ns, memory_order_relaxed);
    }
    if (!end)
        end = now;
    return start && end > start ? end - start : 0;
}

void kvw__metrics_request_ended(const kvw_req_t *r, bool ok)
{
    kvw_engine_counters_t *c = &r->engine->counters;
    uint64_t bytes = atomic_load_explicit(&r->bytes_posted, memory_order_relaxed);
    if (!ok) {
        unsigned cause = r->fail_status < 0 ? (unsigned)-r->fail_status : 0;
        if (cause < KVW_METRIC_CAUSES)
            atomic_fetch_add_explicit(&c->failed_by[cause], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&c->bytes_failed, bytes, memory_order_relaxed);
        return;
    }
    atomic_fetch_add_explicit(&c->bytes_ok, bytes, memory_order_relaxed);
    uint64_t now = kvw__now_ns();
    uint64_t xfer = transfer_ns(r, now);
    if (xfer)
        hist_observe(&c->transfer_hist, xfer);
    if (r->created_ns && now > r->created_ns)
        hist_observe(&c->request_hist, now - r->created_ns);
}

/* --------------------------------------------------------------- writing */

/* The text so far; pos counts on past len, so that a buffer too small
 * still learns the size it needs. */
typedef struct {
    char *buf;
    size_t len, pos;
    char labels[160]; /* role="prefill",rank="0" */
} writer_t;

__attribute__((format(printf, 2, 3))) static void put(writer_t *w, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *at = w->pos < w->len ? w->buf + w->pos : NULL;
    int n = vsnprintf(at, at ? w->len - w->pos : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        w->pos += (size_t)n;
}

/* A label value as OpenMetrics quotes it: \\, \" and \n escaped. */
static void escape(const char *in, char *out, size_t size)
{
    size_t n = 0;
    for (; *in && n + 3 < size; in++) {
        if (*in == '\\' || *in == '"' || *in == '\n')
            out[n++] = '\\';
        out[n++] = *in == '\n' ? 'n' : *in;
    }
    out[n] = '\0';
}

static void family(writer_t *w, const char *name, const char *type, const char *help)
{
    put(w, "# TYPE kvwire_%s %s\n# HELP kvwire_%s %s\n", name, type, name, help);
}

/* One sample: kvwire_<name>{<engine labels>[,<extra>]} value. */
static void sample(writer_t *w, const char *name, const char *extra, uint64_t value)
{
    put(w, "kvwire_%s{%s%s%s} %llu\n", name, w->labels, extra && *extra ? "," : "",
        extra ? extra : "", (unsigned long long)value);
}

static void counter(writer_t *w, const char *name, const char *help, uint64_t value)
{
    family(w, name, "counter", help);
    char total[96];
    snprintf(total, sizeof(total), "%s_total", name);
    sample(w, total, NULL, value);
}

static uint64_t load(const _Atomic uint64_t *a)
{
    return atomic_load_explicit((_Atomic uint64_t *)a, memory_order_relaxed);
}

static void histogram(writer_t *w, const char *name, const char *help, const kvw_hist_t *h)
{
    family(w, name, "histogram", help);
    char bucket[96], label[48];
    snprintf(bucket, sizeof(bucket), "%s_bucket", name);
    uint64_t cumulative = 0;
    for (unsigned i = 0; i <= KVW_HIST_BUCKETS; i++) {
        cumulative += load(&h->bucket[i]);
        if (i < KVW_HIST_BUCKETS)
            snprintf(label, sizeof(label), "le=\"%.9g\"", (double)(1ull << (i + 3)) / 1e6);
        else
            snprintf(label, sizeof(label), "le=\"+Inf\"");
        sample(w, bucket, label, cumulative);
    }
    char count[96], sum[96];
    snprintf(count, sizeof(count), "%s_count", name);
    sample(w, count, NULL, cumulative);
    snprintf(sum, sizeof(sum), "%s_sum", name);
    uint64_t ns = load(&h->sum_ns);
    put(w, "kvwire_%s{%s} %llu.%09llu\n", sum, w->labels, (unsigned long long)(ns / 1000000000ull),
        (unsigned long long)(ns % 1000000000ull));
}

/* The failure causes: every status but KVW_OK, named as kvw_status_name
 * without its "KVW_ERR_" prefix, lower-case. */
static void cause_name(kvw_status_t st, char *out, size_t size)
{
    const char *name = kvw_status_name(st);
    if (strncmp(name, "KVW_ERR_", 8) == 0)
        name += 8;
    size_t n = 0;
    for (; name[n] && n + 1 < size; n++)
        out[n] = (char)(name[n] >= 'A' && name[n] <= 'Z' ? name[n] - 'A' + 'a' : name[n]);
    out[n] = '\0';
}

static void write_requests(writer_t *w, const kvw_engine_counters_t *c)
{
    family(w, "requests", "counter", "requests ended, by outcome");
    sample(w, "requests_total", "outcome=\"success\"", load(&c->ok));
    sample(w, "requests_total", "outcome=\"failed\"", load(&c->failed));
    family(w, "request_failures", "counter", "requests failed, by cause (kvw_status_t)");
    char label[64], name[32];
#define KVW_CAUSE(st_name, value, msg)                                                             \
    if (value < 0 && -(value) < KVW_METRIC_CAUSES) {                                               \
        cause_name((kvw_status_t)(value), name, sizeof(name));                                     \
        snprintf(label, sizeof(label), "cause=\"%s\"", name);                                      \
        sample(w, "request_failures_total", label, load(&c->failed_by[-(value)]));                 \
    }
    KVW_STATUS_MAP(KVW_CAUSE)
#undef KVW_CAUSE
    family(w, "requests_in_flight", "gauge", "requests created and not yet ended");
    uint64_t created = load(&c->created), ended = load(&c->ok) + load(&c->failed);
    sample(w, "requests_in_flight", NULL, created > ended ? created - ended : 0);
    family(w, "request_bytes", "counter",
           "bytes of ended requests by outcome (prefill: posted; decode: asked for)");
    sample(w, "request_bytes_total", "outcome=\"success\"", load(&c->bytes_ok));
    sample(w, "request_bytes_total", "outcome=\"failed\"", load(&c->bytes_failed));
    histogram(w, "transfer_seconds",
              "data posted to landed (prefill: first post to last completion; decode: "
              "request sent to final immediate), requests that reached Success",
              &c->transfer_hist);
    histogram(w, "request_seconds", "request created to Success", &c->request_hist);
}

static void write_data_path(writer_t *w, const kvw_engine_counters_t *c)
{
    counter(w, "posted_bytes", "payload bytes in posted RDMA writes", load(&c->bytes));
    family(w, "writes", "counter", "RDMA work requests: posted, completed, flushed");
    sample(w, "writes_total", "state=\"posted\"", load(&c->wrs));
    sample(w, "writes_total", "state=\"completed\"", load(&c->wrs_completed));
    sample(w, "writes_total", "state=\"flushed\"", load(&c->wrs_flushed));
    counter(w, "doorbells", "ibv_post_send calls (chains of writes)", load(&c->chains));
    counter(w, "completions", "completion entries retired (send and receive)",
            load(&c->completions));
    counter(w, "completion_errors", "error completions and failed posts", load(&c->errors));
    counter(w, "poller_sleeps", "times the poller blocked on its completion channel",
            load(&c->sleeps));
    counter(w, "caller_passes", "poller passes run on the caller's thread",
            load(&c->caller_passes));
    family(w, "replays", "counter",
           "requests whose writes started over on live lanes after a lane failed, or were "
           "refused that (failed instead)");
    sample(w, "replays_total", "result=\"replayed\"", load(&c->replays));
    sample(w, "replays_total", "result=\"refused\"", load(&c->replay_refused));
}

static void write_control(writer_t *w, const kvw_engine_counters_t *c)
{
    family(w, "handshakes", "counter", "control-plane handshakes (HELLO), by result");
    sample(w, "handshakes_total", "result=\"accepted\"", load(&c->handshakes));
    sample(w, "handshakes_total", "result=\"refused\"", load(&c->handshakes_refused));
    counter(w, "requests_refused",
            "prefill: requests it refused; decode: requests prefill failed or refused",
            load(&c->requests_refused));
    counter(w, "reconnects", "connections to a peer made again after one died or was replaced",
            load(&c->reconnects));
    family(w, "orphans", "counter",
           "prefill: requests decode sent before a sender existed, held and expired");
    sample(w, "orphans_total", "event=\"held\"", load(&c->orphans));
    sample(w, "orphans_total", "event=\"expired\"", load(&c->orphans_expired));
    counter(w, "aborts", "prefill: aborts heard from decode; decode: aborts sent",
            load(&c->aborts));
    counter(w, "abort_confirmations",
            "prefill: aborts confirmed (writes drained); decode: confirmations heard",
            load(&c->abort_confirms));
}

static void write_rails(writer_t *w, const kvw_engine_t *e)
{
    static const struct {
        const char *name, *type, *help;
    } fams[] = {
        {"rail_posted_bytes", "counter", "prefill: payload bytes posted on the rail"},
        {"rail_writes", "counter", "prefill: RDMA writes posted on the rail"},
        {"rail_lanes_failed", "counter", "lanes (QPs) on the rail that failed"},
        {"rail_lanes_rejoined", "counter", "lanes that came back into their connection"},
        {"rail_lanes_out", "gauge", "lanes out of their connection now"},
        {"rail_probes", "counter", "prefill: probes of a paused lane"},
        {"rail_link_mbps", "gauge", "the port's active speed x width, 0: unknown"},
    };
    for (size_t f = 0; f < sizeof(fams) / sizeof(fams[0]); f++) {
        family(w, fams[f].name, fams[f].type, fams[f].help);
        for (uint32_t r = 0; r < e->nrails; r++) {
            char dev[96], label[160], name[64];
            escape(e->rail[r].dev->name, dev, sizeof(dev));
            snprintf(label, sizeof(label), "rail=\"%u\",device=\"%s\"", r, dev);
            uint64_t v[] = {load(&e->rail[r].bytes),  load(&e->rail[r].wrs),
                            load(&e->rail[r].failed), load(&e->rail[r].rejoined),
                            load(&e->rail[r].out),    load(&e->rail[r].probes),
                            e->rail[r].mbps};
            snprintf(name, sizeof(name), "%s%s", fams[f].name,
                     fams[f].type[0] == 'c' ? "_total" : "");
            sample(w, name, label, v[f]);
        }
    }
}

kvw_status_t kvw_engine_metrics_text(const kvw_engine_t *e, char *buf, size_t len, size_t *needed_p)
{
    if (!e || !needed_p || (!buf && len))
        return KVW_ERR_INVALID;
    writer_t w = {.buf = buf, .len = len};
    snprintf(w.labels, sizeof(w.labels), "role=\"%s\",rank=\"%u\"",
             e->role == KVW_ROLE_PREFILL ? "prefill" : "decode", e->rank);
    char dev[96];
    escape(e->dev->name, dev, sizeof(dev));
    family(&w, "engine", "info", "the engine: library version, first device");
    put(&w, "kvwire_engine_info{%s,version=\"%s\",device=\"%s\"} 1\n", w.labels,
        kvw_version_string(), dev);
    const kvw_engine_counters_t *c = &e->counters;
    write_requests(&w, c);
    write_data_path(&w, c);
    write_rails(&w, e);
    write_control(&w, c);
    put(&w, "# EOF\n");
    *needed_p = w.pos + 1;
    return w.pos < len ? KVW_OK : KVW_ERR_LIMIT;
}
