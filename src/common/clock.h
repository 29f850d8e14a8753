/* The library's one clock (CLOCK_MONOTONIC, in nanoseconds) and a rate
 * limit for log lines about events that a peer or a scanner can repeat at
 * will (dropped messages, refused connections). */
#ifndef KVW_COMMON_CLOCK_H
#define KVW_COMMON_CLOCK_H

#include <stdbool.h>
#include <stdint.h>

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t kvw__now_ns(void);

static inline uint64_t kvw__ms_ns(uint64_t ms)
{
    return ms * 1000000ull;
}

/* At most one log line per period about a repeated event. The owner
 * counts each event with kvw__ratelog_hit (zero-initialised state); a nonzero answer says a line is
 * due now and how many events it covers (those since the last line, this
 * one included). The first event is always logged. Not thread-safe: one
 * owner thread per kvw_ratelog_t. */
typedef struct kvw_ratelog {
    uint64_t last_ns; /* when the last line was due; 0: none yet */
    uint64_t pending; /* events since then, not yet in a line */
} kvw_ratelog_t;

/* Events pending and a line due (period_ns since the last one, or force:
 * due now, e.g. at shutdown): their count, and the count restarts; else 0. */
static inline uint64_t kvw__ratelog_flush(kvw_ratelog_t *r, uint64_t now, uint64_t period_ns,
                                          bool force)
{
    if (!r->pending || (!force && r->last_ns && now - r->last_ns < period_ns))
        return 0;
    uint64_t n = r->pending;
    r->pending = 0;
    r->last_ns = now;
    return n;
}

/* Count one event at now; as kvw__ratelog_flush (not forced). */
static inline uint64_t kvw__ratelog_hit(kvw_ratelog_t *r, uint64_t now, uint64_t period_ns)
{
    r->pending++;
    return kvw__ratelog_flush(r, now, period_ns, false);
}

#endif
