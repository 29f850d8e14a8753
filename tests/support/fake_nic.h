/* SPDX-License-Identifier: Apache-2.0 */
/* A fake, in-process NIC behind kvw_verbs_ops_t, for unit tests and fault
 * injection ONLY. It is not RDMA and proves nothing about RDMA: a "remote
 * write" is a memmove() inside this process, done by a background "wire"
 * thread so that completions arrive asynchronously, as from a real NIC.
 *
 * It mirrors the verbs semantics kvwire relies on: RC QP state machine,
 * per-QP in-order execution, signaled/unsignaled completions, flush on
 * error, lkey/rkey and range checks, RNR with rnr_retry (7 = forever),
 * completion channels with arm/event/ack, send-queue slots freed only when a
 * covering completion is polled, and CQ overrun detection. Several fake
 * devices ("fake0", "fake1", ...) share the one wire, so a prefill and a
 * decode engine in one test process can talk to each other.
 *
 *     fake_nic_init(NULL);
 *     kvw__verbs_set_ops(&fake_nic_ops);
 *     ... engines with .device = "fake0" / "fake1", .local_ip = "127.0.0.1" ...
 *     kvw__verbs_set_ops(NULL);
 *     fake_nic_fini();
 *
 * Every function here and every op is thread-safe (one global mutex). */
#ifndef KVW_TESTS_FAKE_NIC_H
#define KVW_TESTS_FAKE_NIC_H

#include "verbs/ops.h"

#include <stdint.h>

#define FAKE_NIC_MAX_DEVICES 8

typedef struct fake_nic_config {
    int num_devices;                      /* 0: 2 */
    const char *ip[FAKE_NIC_MAX_DEVICES]; /* IPv4 of each device; NULL: "127.0.0.1" */
    uint32_t max_msg_sz;                  /* port max_msg_sz; 0: 8 MiB */
    uint32_t max_qp_wr;                   /* device max_qp_wr; 0: 16384 */
    uint32_t retry_us;                    /* how long an unreachable peer is retried before
                                           * IBV_WC_RETRY_EXC_ERR; 0: fail at once */
    uint32_t rnr_delay_us;                /* between RNR retries; 0: 640 (min_rnr_timer 12) */
    /* ibv_reg_dmabuf_mr fails with EOPNOTSUPP (as on rxe); else it
     * registers the host memory at iova (tests pose it as GPU memory). */
    int no_dmabuf;
} fake_nic_config_t;

/* Faults. All counts are 1-based and 0 means off; the counters restart at
 * every fake_nic_set_faults(). */
typedef struct fake_nic_faults {
    uint32_t fault_qp_num; /* count only post_send calls / WRs of this QP; 0: all QPs */
    /* The fail_post_call-th post_send call accepts WRs [0, fail_post_wr) of
     * its list and fails at index fail_post_wr (its last WR if the list is
     * shorter), returning fail_post_rc (0: EIO) with *bad_wr on that WR. */
    uint64_t fail_post_call;
    uint32_t fail_post_wr; /* 0-based index into that call's list */
    int fail_post_rc;
    /* The error_wr-th send WR the wire executes completes with error_status
     * (0: IBV_WC_REM_ACCESS_ERR) instead of being applied; its QP goes to
     * ERR and flushes. */
    uint64_t error_wr;
    enum ibv_wc_status error_status;
    /* Each WR posted from now on executes no earlier than its post time +
     * delay_us + a pseudo-random 0..delay_jitter_us (from seed). */
    uint32_t delay_us;
    uint32_t delay_jitter_us;
    uint64_t seed;
    /* A successful send's completion can be polled only ack_delay_us after
     * its data landed (a late ACK): the receiver may act on the data first. */
    uint32_t ack_delay_us;
    /* Armed CQs raise no channel event: a sleeping poller then learns of
     * completions only from its idle timeout or from a caller's pass. */
    int mute_events;
    /* Send WRs of the QP with this number neither execute nor fail while
     * it is set (a path that stopped carrying packets, before any timeout
     * notices): they resume, in order, once the faults change. Such WRs do
     * not count as work for fake_nic_quiesce(). */
    uint32_t stall_qp_num;
    /* The fail_recv_call-th post_recv call (of fault_qp_num's QP, or any)
     * accepts receives [0, fail_recv_wr) of its list and fails with ENOMEM
     * at index fail_recv_wr (its last receive if the list is shorter). */
    uint64_t fail_recv_call;
    uint32_t fail_recv_wr;
    /* Silent corruption in flight: the flip_byte-th byte the wire places
     * (1-based, over the payload of successful writes in scope) lands with
     * its bits inverted; the write completes as if nothing happened (what
     * the transport's own checks would miss, e.g. a bad PCIe or memory
     * path). Counted in stats.bytes_flipped. */
    uint64_t flip_byte;
} fake_nic_faults_t;

typedef struct fake_nic_stats {
    uint64_t post_send_calls;
    uint64_t wrs_accepted;    /* send WRs taken by post_send */
    uint64_t wrs_succeeded;   /* executed successfully, signaled or not */
    uint64_t wrs_errored;     /* completed with an error other than a flush */
    uint64_t wrs_flushed;     /* IBV_WC_WR_FLUSH_ERR, or discarded by destroy_qp */
    uint64_t wrs_outstanding; /* accepted - succeeded - errored - flushed */
    uint64_t recvs_posted, recvs_consumed, recvs_flushed;
    uint64_t cqes;        /* completions produced (polled or not) */
    uint64_t cq_overruns; /* must stay 0; each is also a fatal error */
    uint64_t bytes_written;
    uint64_t bytes_flipped; /* the flip_byte fault's */
    /* Misuse that real verbs would punish (CQ overrun, destroy_cq with
     * unacked events, ...): counted, the first one described. */
    uint64_t fatal_errors;
    char fatal[160];
    uint64_t fork_init_calls; /* ibv_fork_init() calls, successful or not */
    /* Objects not yet destroyed (an engine must leave 0 of each). */
    uint32_t live_contexts, live_pds, live_mrs, live_channels, live_cqs, live_qps;
} fake_nic_stats_t;

/* Create the devices and start the wire. cfg may be NULL (defaults).
 * Returns 0, or -1 with errno (EBUSY if already initialised, EINVAL). */
int fake_nic_init(const fake_nic_config_t *cfg);
/* Stop the wire and free every object, even ones the caller leaked. After
 * this, fake_nic_init() may be called again. */
void fake_nic_fini(void);

/* What ibv_is_fork_initialized() answers (process-wide, kept across
 * fake_nic_init; IBV_FORK_DISABLED at start); ibv_fork_init() turns
 * DISABLED into ENABLED unless memory is registered already (EINVAL). */
void fake_nic_set_fork_status(enum ibv_fork_status s);
/* Asynchronous events, as the device would raise them: a port event
 * (IBV_EVENT_PORT_ERR, _PORT_ACTIVE, _DEVICE_FATAL) on every context of the
 * named device, or a QP event (IBV_EVENT_QP_FATAL, ...) on the context of
 * that QP's device. 0, or -1 when no such device or QP. */
int fake_nic_raise_port_event(const char *name, enum ibv_event_type type);
int fake_nic_raise_qp_event(uint32_t qp_num, enum ibv_event_type type);
/* Replace the fault set (NULL: no faults) and restart its counters. */
void fake_nic_set_faults(const fake_nic_faults_t *faults);
/* The device's "process died" (or its link went down): WRs towards its
 * QPs fail with IBV_WC_RETRY_EXC_ERR, its own QPs send nothing more, its
 * port reads IBV_PORT_DOWN, moving its QPs to RTR fails with ENETUNREACH
 * (RoCE finds no route), yet its objects stay valid so its engine can
 * still be destroyed. Returns 0, -1 if unknown. */
int fake_nic_kill_device(const char *name);
/* One byte of memory the wire may be writing, read race-free (for tests
 * that watch data land before the request ends). */
uint8_t fake_nic_peek(const void *addr);
/* A new process on a killed device, or its link back up: its port reads
 * IBV_PORT_ACTIVE and its QPs work again (those whose peers failed them
 * meanwhile stay in ERR until reset). Returns 0, -1 if unknown. */
int fake_nic_revive_device(const char *name);

void fake_nic_stats(fake_nic_stats_t *stats);
/* Access flags (IBV_ACCESS_*) of the MR covering addr, or of the QP with
 * this number: what a peer could do to them. -1 if there is none. */
int fake_nic_mr_access(const void *addr);
int fake_nic_qp_access(uint32_t qp_num);
/* The address vector the QP with this number was given at RTR (as
 * ibv_modify_qp received it), in *ah_p. 0, or -1 if there is no such QP or
 * it never reached RTR. */
int fake_nic_qp_ah(uint32_t qp_num, struct ibv_ah_attr *ah_p);
/* Wait until no send WR can still execute (a WR that RNR-retries forever
 * for want of a receive counts as done waiting). 0, or -1 on timeout. */
int fake_nic_quiesce(int timeout_ms);

extern const kvw_verbs_ops_t fake_nic_ops;

#endif
