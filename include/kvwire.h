/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvwire: move LLM KV cache from a prefill engine to a decode engine over
 * RDMA (raw ibverbs), with a ZeroMQ control plane.
 *
 * This header is the whole public surface of the library.
 *
 * Concepts
 *   engine    One per process and role. Registers the process's KV memory
 *             (buffer groups: KV layers with any number of regions per
 *             layer, aux buffers, state buffers; see kvw_group_t) with one
 *             RDMA device, runs one control thread (ZeroMQ) and one
 *             completion-queue poller thread.
 *   bootstrap A small directory service. Prefill engines register their
 *             control endpoint under (engine rank); decode engines look them
 *             up. It runs embedded in a prefill process (kvw_bootstrap_create)
 *             or standalone (tools/kvw-bootstrap).
 *   room      A 64-bit request id chosen by the caller, unique per request
 *             across the whole deployment (the "bootstrap room").
 *   sender    Prefill side of one request: init(pages, aux), send(source
 *             page indices) once or once per prefill chunk, or per layer
 *             range as the forward pass produces them (send_part), poll.
 *   receiver  Decode side of one request: init(destination page indices,
 *             aux), poll. Decode learns that the data landed from its own
 *             completion queue (the request's last RDMA write carries an
 *             immediate); no control message follows the data.
 *
 * Failure
 *   A request fails only itself (bad pages, abort, destroy, timeout), unless
 *   its connection breaks (QP error, failed post, peer dead or silent): then
 *   every request on that connection fails with the reason, and the next
 *   request on that peer pair reconnects. Decode never reports Success unless
 *   every write of the request landed (the immediate rides the last write,
 *   and RC delivers in order), and never reports Failed while writes of the
 *   request can still land. With GPU memory reached through the staging
 *   pool, decode's own copy from the pool to its pages counts as such a
 *   write: a request whose data all landed ends only once that copy is
 *   over, a Success unless decode itself gave it up meanwhile (a failure
 *   of the network then changes nothing: every byte had arrived).
 *
 * Producers
 *   kvwire reads the source pages of a part at any moment after the call
 *   that hands them over, on threads and CUDA streams of its own that know
 *   nothing of the application's streams. So the pages handed to
 *   kvw_sender_send() or kvw_sender_send_part() must be fully written when
 *   the call is made (for pages a GPU writes: that work completed, not
 *   merely queued), or the caller passes a CUDA event recorded after the
 *   writes with kvw_sender_send_after() / kvw_sender_send_part_after(),
 *   and kvwire reads nothing of the part before the event completed,
 *   without the call waiting for it. See "Producer contract" below.
 *
 * Thread safety
 *   kvw_engine_* functions on one engine may be called from any thread.
 *   Senders and receivers of the same engine may be used concurrently from
 *   different threads, and so may one sender or receiver: its calls are
 *   serialised by its engine (e.g. the parts of one request handed over
 *   from the threads of several CUDA streams), except its destroy, which
 *   must not race with any other call on the same object (it frees it).
 *   The same holds for kvw_engine_destroy() and kvw_bootstrap_destroy().
 *   kvw_*_poll() is cheap and may be called in a busy loop: it never waits
 *   for another thread, beyond the engine's lock (held briefly). Progress
 *   is made by the engine's poller thread; while that thread sleeps
 *   (nothing happened for KVW_POLL_SPIN_US), the caller's own thread does
 *   its work instead: send calls post their writes before returning (those
 *   of a part whose CUDA event has not completed yet excepted), and
 *   polling a request that is Transferring polls the completion queues, so
 *   no thread wake-up sits on a request's path when the caller is there
 *   anyway. That pass is a few verbs calls, taken only if no other thread
 *   is in one (counted in kvw_counters_t.caller_passes). Destroy a request
 *   before its engine.
 *
 * Errors
 *   Functions return kvw_status_t (KVW_OK == 0, errors < 0); output
 *   parameters are suffixed _p, come last, and are written only on success.
 *   A NULL handle or a NULL required pointer is KVW_ERR_INVALID (destroy
 *   functions accept NULL). The library never prints or exits: it reports
 *   through the log handler (kvw_set_log_handler), by default silent below
 *   WARN and to stderr.
 *
 * Ownership
 *   Handles (kvw_engine_t, kvw_sender_t, kvw_receiver_t, kvw_bootstrap_t)
 *   are created by the library and owned by the caller until their destroy
 *   function. Structs and arrays passed in are copied before the call
 *   returns, unless a function says otherwise; the memory regions an engine
 *   registers stay the caller's. Strings returned are owned by the library
 *   and valid for the lifetime the function states.
 *
 * Versions
 *   The version macros and kvw_version() below; what may change in which
 *   release: docs/api-policy.md.
 */
#ifndef KVWIRE_H
#define KVWIRE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVW_API __attribute__((visibility("default")))

/* The library's version, MAJOR.MINOR.PATCH (docs/api-policy.md). MAJOR is
 * the shared library's SONAME (libkvwire.so.MAJOR) and changes with any
 * incompatible change; MINOR with additions; PATCH with fixes. The Makefile
 * reads these three lines: keep them in this order and form. */
#define KVW_VERSION_MAJOR 1
#define KVW_VERSION_MINOR 5
#define KVW_VERSION_PATCH 0
/* One number that orders versions: MAJOR * 10000 + MINOR * 100 + PATCH. */
#define KVW_VERSION (KVW_VERSION_MAJOR * 10000 + KVW_VERSION_MINOR * 100 + KVW_VERSION_PATCH)

/* The version of the library actually loaded, as KVW_VERSION packs it. It
 * may differ from the header the caller was compiled with: the dynamic
 * loader picks the library by SONAME, so the MAJOR is the same, but the
 * MINOR may be older (lacking what was added since; the symbol versions in
 * the library make a program that needs one of those fail to load) or
 * newer. Thread-safe, never fails. */
KVW_API unsigned kvw_version(void);
/* The same as static text, "MAJOR.MINOR.PATCH"; never NULL. */
KVW_API const char *kvw_version_string(void);

/* ---------------------------------------------------------------- status */

/* X(name, value, message): one table makes the enum, the names and
 * kvw_strerror() together so they cannot drift apart. */
#define KVW_STATUS_MAP(X)                                                                          \
    X(OK, 0, "success")                                                                            \
    X(ERR_INVALID, -1, "invalid argument")                                                         \
    X(ERR_NO_MEMORY, -2, "out of memory")                                                          \
    X(ERR_NO_DEVICE, -3, "no usable RDMA device")                                                  \
    X(ERR_VERBS, -4, "RDMA verbs call failed")                                                     \
    X(ERR_REGISTER, -5, "memory registration failed")                                              \
    X(ERR_CONTROL, -6, "control plane (ZeroMQ) error")                                             \
    X(ERR_PROTOCOL, -7, "malformed or unexpected message from peer")                               \
    X(ERR_OUT_OF_RANGE, -8, "page or aux index outside the registered region")                     \
    X(ERR_MISMATCH, -9, "peers disagree on layout (layers, item lengths or page counts)")          \
    X(ERR_TIMEOUT, -10, "timed out")                                                               \
    X(ERR_PEER, -11, "peer failed or disconnected")                                                \
    X(ERR_TRANSFER, -12, "RDMA transfer completed with an error")                                  \
    X(ERR_STATE, -13, "call not allowed in the current state")                                     \
    X(ERR_NOT_FOUND, -14, "not found")                                                             \
    X(ERR_EXISTS, -15, "already exists")                                                           \
    X(ERR_UNSUPPORTED, -16, "not supported on this device or build")                               \
    X(ERR_ABORTED, -17, "request aborted")                                                         \
    X(ERR_LIMIT, -18, "a configured limit was reached")                                            \
    X(ERR_CORRUPT, -19, "bytes differ from what prefill sent")

typedef enum {
#define KVW_STATUS_ENUM(name, value, msg) KVW_##name = value,
    KVW_STATUS_MAP(KVW_STATUS_ENUM)
#undef KVW_STATUS_ENUM
} kvw_status_t;

/* Static English text for a status; never NULL ("unknown status" for values
 * outside the table). */
KVW_API const char *kvw_strerror(kvw_status_t status);
/* Static name of a status, e.g. "KVW_ERR_TIMEOUT"; never NULL. */
KVW_API const char *kvw_status_name(kvw_status_t status);

/* --------------------------------------------------------------- logging */

typedef enum {
    KVW_LOG_ERROR = 0,
    KVW_LOG_WARN = 1,
    KVW_LOG_INFO = 2,
    KVW_LOG_DEBUG = 3,
} kvw_log_level_t;

/* Called from any library thread, possibly concurrently; must not call back
 * into kvwire. msg is valid only during the call. */
typedef void (*kvw_log_fn)(void *arg, kvw_log_level_t level, const char *msg);

/* Install a process-wide log handler (NULL restores the default, which
 * writes to stderr) and the most verbose level delivered. Thread-safe, but
 * meant to be called once at start-up. The initial level is KVW_LOG_WARN,
 * or KVW_LOG_LEVEL=error|warn|info|debug from the environment.
 *
 * Lines (docs/operations.md, "Logs"): the default writes each as
 *   2026-01-31T12:34:56.789012Z kvwire[PID.TID] LEVEL SUBSYS ENGINE: message
 * (UTC, microseconds; ENGINE "prefill r0 <engine id>" on the engine's own
 * threads, during its creation and in the init and send calls of its
 * requests, absent where no engine is known), whole however long. SUBSYS is INIT, CTRL, DATA, RAIL, MEM or VERIFY;
 * KVW_LOG_SUBSYS=INIT,CTRL (or ^DATA: all but) keeps info and debug lines
 * of those only (errors and warnings always pass). KVW_LOG_FILE=path (%h
 * the host name, %p the pid) appends every line to that file as well as
 * handing it to a handler, and instead of stderr when there is none.
 * A handler gets only the message (msg); one installed with
 * kvw_set_log_record_handler() gets the record below. Installing either
 * replaces the other. */
KVW_API void kvw_set_log_handler(kvw_log_fn fn, void *arg, kvw_log_level_t max_level);

/* One log line, for kvw_set_log_record_handler(). Every pointer is valid
 * only during the call. Fields are only ever appended. Since 1.5. */
typedef struct kvw_log_record {
    kvw_log_level_t level;
    const char *subsystem; /* "INIT", "CTRL", "DATA", "RAIL", "MEM" or "VERIFY" */
    const char *engine;    /* "prefill r0 <16 hex digits>", "" where not known */
    const char *msg;       /* the message alone, as kvw_log_fn gets it */
    const char *line;      /* the whole line the default writes, without its newline */
} kvw_log_record_t;

/* Called as kvw_log_fn is: from any library thread, possibly concurrently,
 * under the library's log lock; must not call back into kvwire. */
typedef void (*kvw_log_record_fn)(void *arg, const kvw_log_record_t *record);

/* kvw_set_log_handler() for a handler that takes the whole record (NULL
 * restores the default). Since 1.5. */
KVW_API void kvw_set_log_record_handler(kvw_log_record_fn fn, void *arg,
                                        kvw_log_level_t max_level);

/* ---------------------------------------------------------- sized structs
 *
 * The structs a caller fills in and hands over (kvw_config_t,
 * kvw_engine_params_t, kvw_bootstrap_params_t) start with
 * `size_t struct_size`, the sizeof the caller was compiled with, set by
 * their init function (kvw_config_init(), kvw_engine_params_init(),
 * kvw_bootstrap_params_init()) or by the caller (.struct_size =
 * sizeof(...)). New fields are only ever appended, so the library reads
 * exactly the fields an older caller's size covers and takes the defaults
 * for the rest. A struct_size below the smallest the library accepts (0:
 * never set) is KVW_ERR_INVALID; so is one larger than the library knows
 * (a caller built against a newer kvwire.h) whose fields past the
 * library's end are not all zero: the library cannot honour them. Both are
 * logged. See docs/api-policy.md. */

/* ---------------------------------------------------------------- config */

/* Tuning knobs. kvw_config_init() fills the defaults below and then applies
 * the KVW_* environment variable named beside each field. New fields only at
 * the end (sized structs, above). */
typedef struct kvw_config {
    size_t struct_size;            /* sizeof(kvw_config_t): kvw_config_init() sets it */
    uint32_t sq_depth;             /* KVW_SQ_DEPTH, 512: send WRs outstanding per QP */
    uint32_t rq_depth;             /* KVW_RQ_DEPTH, 256: receives posted per QP (decode) */
    uint32_t chain_max;            /* KVW_CHAIN_MAX, 64: WRs linked per ibv_post_send */
    uint32_t signal_every;         /* KVW_SIGNAL_EVERY, 32: signal every Nth WR (and chain ends) */
    uint32_t poll_spin_us;         /* KVW_POLL_SPIN_US, 50: busy-poll this long before sleeping */
    uint32_t bootstrap_timeout_ms; /* KVW_BOOTSTRAP_TIMEOUT_MS, 30000: connect + request */
    uint32_t transfer_timeout_ms;  /* KVW_TRANSFER_TIMEOUT_MS, 60000: data posted -> landed */
    uint32_t heartbeat_ms;         /* KVW_HEARTBEAT_MS, 500: control-plane liveness ping */
    /* KVW_PEER_TIMEOUT_MS, 2000: a silent peer is declared dead, and the
     * longest an abort waits for prefill's acknowledgement. A peer process
     * that exits is noticed sooner, when its control connection closes. */
    uint32_t peer_timeout_ms;
    /* KVW_IDLE_HEARTBEAT_MS, 5000: a connection with no request of decode's
     * on it is pinged this often instead (an idle engine costs next to
     * nothing), and prefill declares a decode engine dead after 3 of these
     * (or peer_timeout_ms, if longer) of silence. A decode engine that
     * exits is noticed at once either way. */
    uint32_t idle_heartbeat_ms;
    /* KVW_BOOTSTRAP_REFRESH_MS, 5000: prefill re-registers its rank this
     * often, so a restarted bootstrap service relearns it within that. */
    uint32_t bootstrap_refresh_ms;
    /* KVW_MAX_PEERS, 256: live control connections (decode engines on
     * prefill, prefill ranks on decode); one more is refused, naming this
     * limit. Dead connections free their slot once their writes drained. */
    uint32_t max_peers;
    /* Requests decode sends before prefill created the room's sender
     * ("orphans") are kept at most KVW_ORPHAN_TTL_MS (30000) and, per
     * decode connection, at most KVW_MAX_ORPHANS_PER_PEER (1024) of them
     * holding at most KVW_MAX_ORPHAN_MIB_PER_PEER (64) MiB of page indices;
     * beyond that decode's request fails at once with KVW_ERR_LIMIT. An
     * ABORT for a room prefill holds nothing for is kept as one (no page
     * indices), so that a sender created later fails at once; past the
     * caps it is only answered. */
    uint32_t orphan_ttl_ms;
    uint32_t max_orphans_per_peer;
    uint32_t max_orphan_mib_per_peer;
    int32_t gid_index;    /* KVW_GID_INDEX, -1: -1 picks RoCEv2 IPv4-mapped GID */
    uint8_t ib_port;      /* KVW_IB_PORT, 1 */
    uint8_t qp_timeout;   /* KVW_QP_TIMEOUT, 14: ACK timeout 4.096us*2^n */
    uint8_t qp_retry_cnt; /* KVW_QP_RETRY_CNT, 7 */
    uint8_t qp_rnr_retry; /* KVW_QP_RNR_RETRY, 7 */
    /* Authentication and encryption of the control plane (ZeroMQ CURVE),
     * off by default. The cluster key is one secret shared by every engine
     * and bootstrap service of a deployment (tools/kvw-keygen makes one):
     * with it set, every control connection is encrypted and only parties
     * holding the same key can register, look up, handshake or request.
     * Set at most one of the two; see README "Trust model".
     *   cluster_key_file  KVW_CLUSTER_KEY_FILE, "": a file written by
     *                     kvw-keygen ('#' comment lines, then the key).
     *   cluster_key       KVW_CLUSTER_KEY, "": the key itself, 40 Z85
     *                     characters (kvw_config_print never shows it). */
    char cluster_key_file[256];
    char cluster_key[41];
    /* Fabric settings, applied to every QP as it moves to RTR (README
     * "Fabric settings"); the QP bring-up log at info level shows them.
     *   traffic_class  KVW_TRAFFIC_CLASS, 0 (0..255): the GRH traffic
     *                  class. RoCE: DSCP << 2 (plus ECN bits), e.g. 106
     *                  for DSCP 26; it picks the switch queue.
     *   service_level  KVW_SERVICE_LEVEL, 0 (0..15): the IB SL (SL to VL
     *                  mapping of the subnet); on RoCE the 802.1p priority
     *                  of VLAN-tagged traffic, where the NIC uses it.
     *   hop_limit      KVW_HOP_LIMIT, 255 (1..255): the GRH hop limit (IP
     *                  TTL on RoCEv2), as NCCL and perftest set it.
     *   flow_label     KVW_FLOW_LABEL, -1 (-1..0xfffff): the GRH flow
     *                  label; RoCEv2 NICs hash it into the UDP source
     *                  port, the ECMP entropy. -1 derives it per QP from
     *                  both QPNs (the Linux rdma_calc_flow_label hash, the
     *                  same value on both sides), spreading connections
     *                  over paths; 0 leaves it to the NIC; else fixed.
     *   ib_use_grh     KVW_IB_USE_GRH, -1 (-1..1): InfiniBand only (RoCE
     *                  always carries a GRH). -1: a GRH when the peer's
     *                  GID is in another subnet or gid_index was set, LID
     *                  routing otherwise; 0: LID routing; 1: a GRH. */
    uint8_t traffic_class;
    uint8_t service_level;
    uint8_t hop_limit;
    int32_t flow_label;
    int32_t ib_use_grh;
    /* GPU memory (README "GPU memory"). Host regions ignore all three.
     *   gpu_path     KVW_GPU_PATH, "" (= "auto"): how GPU regions are
     *                registered: "auto" tries dma-buf, then nvidia_peermem,
     *                then staging, and logs why the better paths were not
     *                taken; "dmabuf", "peermem" or "staging" force one.
     *   gpu_flush    KVW_GPU_FLUSH, -1 (-1..1): decode flushes the NIC's
     *                writes into GPU regions (cuFlushGPUDirectRDMAWrites)
     *                before reporting Success. -1: only on GPUs that do not
     *                order those writes for their own kernels (before
     *                compute capability 9.0); 0: never; 1: always.
     *   gpu_relaxed_ordering  KVW_GPU_RELAXED_ORDERING, -1 (-1..1): PCIe
     *                relaxed ordering on the MRs (IBV_ACCESS_RELAXED_ORDERING,
     *                ignored by NICs and kernels without it). -1: GPU
     *                regions; 0: none; 1: every region. */
    char gpu_path[16];
    int32_t gpu_flush;
    int32_t gpu_relaxed_ordering;
    /* Staging (GPU regions the NIC cannot reach; README "GPU memory").
     * Memory is pinned host memory allocated at engine creation, and only
     * when a region takes the staging path.
     *   staging_mib        KVW_STAGING_MIB, 256 (1..1048576): the pool.
     *                      Prefill streams any request through it chunk by
     *                      chunk. Decode holds a request's pages in it from
     *                      its REQUEST until they are copied to the GPU, so
     *                      a request larger than the pool fails with
     *                      KVW_ERR_LIMIT and requests wait (in order) for
     *                      room, until bootstrap_timeout_ms after the
     *                      receiver's creation (then KVW_ERR_TIMEOUT, on
     *                      both sides: its request never reached prefill).
     *   staging_chunk_kib  KVW_STAGING_CHUNK_KIB, 4096 (64..1048576): prefill
     *                      copies and writes in chunks of this size.
     *   staging_lanes      KVW_STAGING_LANES, 2 (1..4): CUDA streams per GPU
     *                      copying in turn, so one chunk is copied while the
     *                      NIC writes the one before. */
    uint32_t staging_mib;
    uint32_t staging_chunk_kib;
    uint32_t staging_lanes;
    /* KVW_QPS_PER_PEER, 1 (1..16): RC QPs per connection. Prefill stripes
     * each request's writes over them a chain at a time, with send-queue
     * and immediate credits per QP; a request that used several ends with
     * an immediate on each, and decode reports it landed only once all of
     * them arrived. A connection uses the smaller of the two sides' counts.
     * 1 suits rxe (one kernel thread per device does the work); on real
     * NICs 2-4 spread a connection over the NIC's processing units and, on
     * RoCE, over more ECMP paths (each QP has its own flow label). */
    uint32_t qps_per_peer;
    /* KVW_POLL_BUSY_US, 0 (0..1000000): while the engine has requests
     * under way (not yet Success or Failed), the poller busy-polls this
     * long after its last event instead of poll_spin_us before it sleeps,
     * so the write or completion that is about to come is seen without a
     * thread wake-up. An engine with nothing under way still sleeps after
     * poll_spin_us. Off by default: under steady traffic it holds a core,
     * and on a 2-core machine it halved the throughput of everything else
     * in the process (README "Benchmarks"); turn it on (e.g. 1000) where
     * cores are spare and small requests' latency matters. */
    uint32_t poll_busy_us;
    /* KVW_MAX_HANDSHAKES, 16 (1..65536): prefill sets up at most this many
     * connections (QPs created and connected, HELLO_ACK sent) per pass of
     * its control loop (a batch also ends after heartbeat_ms / 2); the
     * HELLOs beyond wait in arrival order, and between
     * two batches the loop serves the connected peers (requests, PINGs,
     * aborts). A decode engine left waiting is told (a PONG), and again
     * every heartbeat_ms, that its HELLO is queued, so it waits (up to
     * bootstrap_timeout_ms) instead of resending it: many decode engines
     * connecting at once are served in turn, never into timeouts
     * (docs/topology.md, "Many peers at once"). */
    uint32_t max_handshakes;
    /* KVW_LANDING_MIB, 64 (0..1048576): decode's landing buffer for head
     * slicing over several prefill ranks (kvw_receiver_create_ranks, decode
     * TP < prefill TP; docs/head-slicing.md). Each prefill rank writes its
     * heads contiguously into a slice of it (as many writes as equal TP),
     * and decode copies them into its rows (host memcpy, or
     * cuMemcpy2DAsync for GPU regions) before Success. Registered once at
     * engine creation, only by a decode engine whose KV groups describe
     * their heads (GPU memory of the KV regions' GPU for GPU regions). A
     * request that finds no room, or 0 here, takes one write per token row
     * (NHD) or page (HND) instead. */
    uint32_t landing_mib;
    /* KVW_DEVICES, "" (at most 127 characters): several RDMA devices
     * ("rails") for one engine, by name, comma-separated ("mlx5_0,mlx5_1",
     * at most 4). Every region is registered on each; a connection gets
     * qps_per_peer QPs on every rail the two sides share (rail i of decode
     * pairs with rail i mod n of prefill), and prefill stripes each request
     * over them, weighted by the rails' link speeds; decode reports it
     * landed once every rail that carried part of it delivered. When a
     * rail fails (an error completion, its port going down) while another
     * lives, the requests it left unfinished start over on the others
     * (one whose final immediate may already have reached decode fails
     * instead). "near": the device picked by affinity as rail 0, and every
     * other one up at the same distance from the KV regions' GPU (or the
     * caller's NUMA node) that no other GPU of the node picks, up to 4
     * (rail 0 alone where nothing tells the devices apart, as with rxe, or
     * where it is across sockets). "" (the default): one device, engine
     * params' `device` or the one picked by affinity. Set, it overrides
     * `device`. Not with staged GPU regions (KVW_ERR_UNSUPPORTED).
     * docs/topology.md, "Every near device", "Several rails per engine" and
     * "A rail that goes down". */
    char devices[128];
    /* 1.3's tail padding, which an older caller may have left unset: never
     * read (docs/api-policy.md). */
    uint32_t reserved_1_4;
    /* KVW_VERIFY, 0 (0..1): an end-to-end check of every request's bytes
     * (docs/failure-semantics.md, "Verified transfers"). Prefill sends a
     * digest of what it wrote (CRC32C per item, see there), decode
     * computes the digest of what landed, and reports Success only when
     * the two agree: a difference is Failed with KVW_ERR_CORRUPT, the
     * reason naming the room and both digests. Host memory and staged GPU
     * memory: kvwire computes both digests. GPU memory the NIC reaches
     * directly (dma-buf, nvidia_peermem): the caller computes them and
     * hands them over (kvw_sender_set_digest, kvw_receiver_landed,
     * kvw_receiver_verify), kvwire carries and compares them. Both sides
     * must agree: a request between an engine with it and one without
     * fails on both sides with KVW_ERR_MISMATCH. Not with head slicing
     * (a sliced connection, kvw_receiver_create_ranks): KVW_ERR_UNSUPPORTED.
     * Costs a pass over the bytes on each side (bench/bench.sh prints the
     * ratio); off, nothing on the data path changes. Since 1.4. */
    uint32_t verify;
} kvw_config_t;

/* Fill defaults, then apply KVW_* environment overrides, and set
 * struct_size. Numbers are decimal, or hexadecimal after 0x. Returns
 * KVW_ERR_INVALID (and logs which variable, once) if a variable does not
 * parse or is out of range (or, for text, is too long), if KVW_LOG_LEVEL
 * names no level, or if the variables set disagree with each other
 * (kvw_config_validate's relations); cfg then holds the defaults for a
 * field that did not parse. The first call in a process also warns once
 * about each unknown KVW_* variable, naming the nearest known one
 * (docs/configuration.md). The cluster key is only
 * checked when an engine or bootstrap service is created with it
 * (KVW_ERR_INVALID, logged). Thread-safe (it only reads the environment).
 * kvw_config_init() is kvw_config_init_size() with the caller's sizeof: the
 * library writes exactly that many bytes (fields it does not know, from a
 * newer header, are zeroed) and sets struct_size to it; KVW_ERR_INVALID,
 * writing nothing, for a NULL cfg or a size too small to hold struct_size. */
KVW_API kvw_status_t kvw_config_init_size(kvw_config_t *cfg, size_t size);
static inline kvw_status_t kvw_config_init(kvw_config_t *cfg)
{
    return kvw_config_init_size(cfg, sizeof(*cfg));
}
/* Write "name = value (ENV_VAR)" lines for every field to out (the fields
 * cfg's struct_size does not cover with their defaults). A bad struct_size
 * is logged and prints nothing. Only reads cfg. */
KVW_API void kvw_config_print(const kvw_config_t *cfg, FILE *out);
/* The checks kvw_engine_create makes on a config, without creating one:
 * every field in its range and the relations between them (chain_max and
 * signal_every at most sq_depth / 2, heartbeat_ms below peer_timeout_ms,
 * not both cluster_key and cluster_key_file, a known gpu_path). KVW_OK, or
 * KVW_ERR_INVALID with the reason logged. Only reads cfg. Since 1.5. */
KVW_API kvw_status_t kvw_config_validate(const kvw_config_t *cfg);

/* ---------------------------------------------------------------- engine */

typedef enum { KVW_ROLE_PREFILL = 0, KVW_ROLE_DECODE = 1 } kvw_role_t;

/* One registered memory region. The caller owns the memory, which must stay
 * valid until kvw_engine_destroy() returns. item_len is the bytes per page
 * index (per aux index for aux regions); len must be a multiple of it. */
typedef struct kvw_region {
    void *addr;
    size_t len;
    size_t item_len;
} kvw_region_t;

/* Buffer groups describe an engine's memory when one K and one V region
 * per layer does not fit the model:
 *   KVW_GROUP_KV     pages, indexed by the request's page indices, written
 *                    layer by layer. 1 region per layer for MLA (DeepSeek's
 *                    latent cache), 2 for K and V, more for split layouts.
 *                    All KV groups of an engine have the same num_layers and
 *                    share the page index space.
 *   KVW_GROUP_AUX    metadata buffers, one item per request (the request's
 *                    aux index), written with the request's final part.
 *   KVW_GROUP_STATE  state buffers with their own index space (Mamba or
 *                    sliding-window state): the request's state indices,
 *                    written with its final part.
 * Both sides of a connection must have the same groups, region for region
 * and item length for item length (except KV groups that describe their
 * heads, whose item lengths follow each side's head range: see
 * kvw_group_heads_t); the handshake says exactly what differs. */
typedef enum {
    KVW_GROUP_KV = 0,
    KVW_GROUP_AUX = 1,
    KVW_GROUP_STATE = 2,
} kvw_group_kind_t;

typedef struct kvw_group {
    kvw_group_kind_t kind;
    uint32_t num_layers;        /* AUX: 1 */
    uint32_t regions_per_layer; /* KV: 1 (MLA), 2 (K, V), ...; AUX: the number of buffers */
    /* num_layers * regions_per_layer regions, region-major: region j of
     * layer l at [j * num_layers + l] (a K/V group lists the K layers, then
     * the V layers). Each region has its own item length. Since 1.4 the
     * engine params' group_num_regions can say how many the array holds. */
    const kvw_region_t *regions;
} kvw_group_t;

/* Head slicing (docs/head-slicing.md): prefill and decode may run with
 * different tensor parallelism, each rank's KV regions holding a range of
 * the model's attention heads. A KV group describes its regions' pages:
 * page_tokens tokens of num_heads heads of head_bytes each (so each
 * region's item_len must be page_tokens * num_heads * head_bytes), laid
 * out token-major (KVW_PAGE_NHD, [token][head][dim]) or head-major per
 * page (KVW_PAGE_HND, [head][token][dim]). Both sides must agree on
 * total_heads, head_bytes, page_tokens and page_order; the head ranges may
 * differ. A decode rank holding a subset of a prefill rank's heads
 * receives them from it with gather writes (several token or page slices
 * per RDMA write, no write per token). Supported now: a decode receiver
 * takes all its heads from the one prefill rank it names (decode TP >=
 * prefill TP; with GQA or MLA replication, name one rank holding them), or
 * a receiver over several prefill ranks (kvw_receiver_create_ranks: decode
 * TP < prefill TP); a request for heads the rank does not hold fails with
 * the ranges in its reason. Not yet: staged GPU memory
 * (KVW_GPU_PATH=staging) on a sliced connection.
 *
 * Since 1.5 a decode engine may leave its heads to prefill ("learning"):
 * an entry {total_heads 0, first_head 0, num_heads 0, head_bytes 0,
 * page_tokens P, page_order} with the engine params' attn_tp_size set
 * (its attn_tp_rank r of attn_tp_size t: the ranks splitting the model's
 * heads). The first handshake with a prefill rank describing the group
 * gives it prefill's head_bytes and total_heads; num_heads = item_len /
 * (P * head_bytes), exactly, the same for every region of the group;
 * first_head = r * num_heads when total_heads >= t (num_heads * t must be
 * total_heads), else (replicated heads) num_heads 1 and first_head = r *
 * total_heads / t, t a multiple of total_heads. Anything else refuses that
 * handshake with the numbers in its reason; later handshakes (other
 * prefill ranks) must give the same heads or are refused. Until learned
 * the group pairs as undescribed (with a prefill rank that describes
 * none). Learning needs a 1.5 prefill (a 1.4.x prefill describing its
 * heads refuses it). An entry with total_heads 0 is "not described", as
 * before, whenever attn_tp_size is 0 (a caller built against 1.4). */
typedef enum { KVW_PAGE_NHD = 0, KVW_PAGE_HND = 1 } kvw_page_order_t;

typedef struct kvw_group_heads {
    uint32_t total_heads; /* the model's KV heads over all ranks (MLA: 1); 0: not described */
    uint32_t first_head;  /* this rank holds [first_head, first_head + num_heads) */
    uint32_t num_heads;
    uint32_t head_bytes;  /* one head of one token: head_dim * element size */
    uint32_t page_tokens; /* tokens per page */
    uint32_t page_order;  /* kvw_page_order_t */
} kvw_group_heads_t;

/* New fields only at the end (sized structs, above). */
typedef struct kvw_engine_params {
    size_t struct_size; /* sizeof(kvw_engine_params_t): kvw_engine_params_init() sets it */
    kvw_role_t role;
    uint32_t engine_rank; /* prefill: rank it registers under; decode: informational */
    /* RDMA device by name ("rxe0", "mlx5_0"), or NULL: the device nearest
     * (PCIe switch, root complex, NUMA node) the GPU that owns the KV
     * regions, or the caller's NUMA node for host memory, among those up
     * on local_ip's network (docs/topology.md); when the topology cannot
     * tell them apart, the one that owns local_ip (librdmacm). */
    const char *device;
    /* IP address of this host on the RDMA network; the control endpoint
     * binds here (ephemeral port) and the device is found from it when
     * device is NULL. Required. */
    const char *local_ip;
    /* Prefill: "host:port" of the bootstrap service to register with.
     * Decode: ignored (each receiver names its bootstrap address). */
    const char *bootstrap_addr;
    /* The classic layout: one K/V group and one aux group. Leave them 0/NULL
     * when using groups. */
    uint32_t num_layers;            /* L; kv_regions has 2L entries (num_kv_regions) */
    const kvw_region_t *kv_regions; /* K layers 0..L-1, then V layers 0..L-1 */
    uint32_t num_aux;
    const kvw_region_t *aux_regions; /* may be NULL when num_aux == 0 */
    const kvw_config_t *config;      /* NULL: kvw_config_init() defaults */
    /* Any layout (copied): at least one KV group, at most 64 groups. */
    uint32_t num_groups;
    const kvw_group_t *groups;
    /* Head slicing (kvw_group_heads_t, copied): NULL, or one entry per
     * group (num_groups of them; 1 for the classic layout, its K/V group).
     * Only KV groups may describe heads. */
    const kvw_group_heads_t *group_heads;
    /* Since 1.4: how many entries the arrays above hold where their length
     * is otherwise implied, so that a short or long array is refused
     * instead of read past or partly ignored. 0 (NULL), as a caller built
     * against an older kvwire.h leaves them: the length is implied, as
     * before. Set, each must be exactly what the layout needs, else
     * KVW_ERR_INVALID, logged naming the field:
     *   num_kv_regions     entries in kv_regions: 2 * num_layers (0 when
     *                      using groups).
     *   num_group_heads    entries in group_heads: num_groups, 1 for the
     *                      classic layout (0 when group_heads is NULL).
     *   group_num_regions  NULL, or num_groups entries (the count of
     *                      groups itself): entry i the number of regions
     *                      groups[i].regions holds, which must be that
     *                      group's num_layers * regions_per_layer (NULL
     *                      with the classic layout).
     * The Python binding always fills them. */
    size_t num_kv_regions;
    size_t num_group_heads;
    const size_t *group_num_regions;
    /* Since 1.5, decode only: this engine's rank among the attn_tp_size
     * ranks that split the model's KV heads (attention tensor parallelism),
     * for KV groups that learn their heads from prefill (the learning entry
     * of kvw_group_heads_t). 0, 0: none learns. Set, some KV group must
     * learn and attn_tp_rank < attn_tp_size, else KVW_ERR_INVALID. */
    uint32_t attn_tp_rank;
    uint32_t attn_tp_size;
} kvw_engine_params_t;

/* Zero every field and set struct_size (inline: the caller's sizeof). */
static inline void kvw_engine_params_init(kvw_engine_params_t *params)
{
    memset(params, 0, sizeof(*params));
    params->struct_size = sizeof(*params);
}

typedef struct kvw_engine kvw_engine_t;

/* Create an engine: open the device, register every region once, start the
 * control and poller threads, and (prefill) register with the bootstrap
 * service. Blocks while the memory is registered and, for a prefill engine,
 * at most config.bootstrap_timeout_ms waiting for the bootstrap service.
 * The params, the config and the region and group arrays are copied; the
 * memory they describe is not. KVW_ERR_INVALID for bad params (struct_size
 * included) or config, KVW_ERR_NO_DEVICE, KVW_ERR_REGISTER, KVW_ERR_CONTROL,
 * KVW_ERR_TIMEOUT (bootstrap service), KVW_ERR_EXISTS (the rank is held by
 * another live engine), ...; all logged. On error nothing is left allocated
 * or registered. Thread-safe. */
KVW_API kvw_status_t kvw_engine_create(const kvw_engine_params_t *params, kvw_engine_t **engine_p);
/* Stop the threads, fail any request still in flight, deregister and free.
 * Accepts NULL. All senders/receivers must have been destroyed. A decode
 * engine ends each live connection in order: it tells prefill it is going
 * and keeps its QPs until prefill has the completions of the writes it
 * posted (one control round trip; at most peer_timeout_ms and one
 * heartbeat_ms for a prefill that does not answer), so that a request that
 * ended Success here ends Success at prefill too. A prefill engine waits
 * for no peer: its UNREGISTER to the bootstrap service is given at most
 * 250 ms to leave. */
KVW_API void kvw_engine_destroy(kvw_engine_t *engine);

/* Name of the opened device and the GID index chosen; the name is valid for
 * the engine's lifetime. */
KVW_API const char *kvw_engine_device_name(const kvw_engine_t *engine);
KVW_API int kvw_engine_gid_index(const kvw_engine_t *engine);
/* "tcp://ip:port" the engine's control socket is bound to. */
KVW_API const char *kvw_engine_endpoint(const kvw_engine_t *engine);

/* Monotonic counters of one engine (all since creation). */
typedef struct kvw_counters {
    uint64_t bytes_posted;  /* payload bytes in posted RDMA writes */
    uint64_t wrs_posted;    /* work requests posted */
    uint64_t chains_posted; /* ibv_post_send calls (doorbells) */
    uint64_t completions;   /* completion entries retired (send and recv) */
    /* Posted WRs end one of two ways: completed (landed at the peer) or
     * flushed (failed, or dropped with a broken connection). Once an engine
     * is idle, wrs_posted == wrs_completed + wrs_flushed. */
    uint64_t wrs_completed;
    uint64_t wrs_flushed;
    uint64_t errors;          /* error completions and failed posts */
    uint64_t requests_ok;     /* requests that reached Success */
    uint64_t requests_failed; /* requests that reached Failed */
    uint64_t cq_sleeps;       /* times the poller blocked on the completion channel */
    /* Poller passes run by the caller's own thread (send, poll) because the
     * poller slept: each saved a wake-up on the request's critical path. */
    uint64_t caller_passes;
    /* Since 1.5 (kvw_engine_counters_ex only): control-plane handshakes
     * completed and refused (prefill: by it; decode: by its prefills). */
    uint64_t handshakes;
    uint64_t handshakes_refused;
} kvw_counters_t;

/* Snapshot the counters; thread-safe, values are each exact but not taken
 * atomically together. Fills the fields up to caller_passes (1.4's
 * struct) only; kvw_engine_counters_ex() fills the rest. */
KVW_API void kvw_engine_counters(const kvw_engine_t *engine, kvw_counters_t *counters_p);
/* Sized outputs (since 1.5), as ibv_query_device_ex takes its size: the
 * caller passes sizeof its own struct, and the library fills the first
 * min(size, its own sizeof) bytes and writes nothing beyond them. New
 * figures are appended to the struct (each marked with the release that
 * added it), never inserted, so a program built against an older header
 * keeps working with a newer library and the reverse: fields the library
 * does not have are left as the caller set them (zero the struct first to
 * read them as 0), and kvw_version() says which release filled it.
 * KVW_ERR_INVALID for a NULL handle or output, or a size below the
 * struct's first release's (KVW_COUNTERS_SIZE_1_0, KVW_REQ_METRICS_SIZE_1_0). */
#define KVW_COUNTERS_SIZE_1_0 88u
#define KVW_REQ_METRICS_SIZE_1_0 40u
KVW_API kvw_status_t kvw_engine_counters_ex(const kvw_engine_t *engine, kvw_counters_t *counters_p,
                                            size_t size);

/* One rail (RDMA device) of an engine: KVW_DEVICES names several, else
 * the engine has one (docs/topology.md, "Several rails"). */
typedef struct kvw_rail {
    char device[64];
    int32_t gid_index;
    uint32_t link_mbps;    /* the port's active speed x width; 0: unknown */
    uint64_t wrs_posted;   /* prefill: RDMA writes posted on this rail */
    uint64_t bytes_posted; /* prefill: their payload bytes */
} kvw_rail_t;

/* The engine's rails: returns how many it has, and fills the first
 * min(that, max) entries of rails (NULL with max 0: just the count).
 * Thread-safe; the counts are each exact but not taken together. */
KVW_API uint32_t kvw_engine_rails(const kvw_engine_t *engine, kvw_rail_t *rails, uint32_t max);

/* How one rail's lanes (QPs, over all connections) fared since the engine
 * was created: a lane that fails leaves its connection while another rail
 * lives, and prefill probes it back (docs/topology.md, "A rail that goes
 * down"). All counts since creation except lanes_out. */
typedef struct kvw_rail_health {
    uint32_t lanes_failed;   /* lanes on this rail that failed */
    uint32_t lanes_rejoined; /* lanes that came back into their connection */
    uint32_t lanes_out;      /* lanes out of their connection now */
    uint32_t probes;         /* prefill: probes of a paused lane (its port, then a reset) */
    /* Prefill: from a lane's failure to its rejoin, in microseconds, the
     * last and the longest (0: none yet). */
    uint64_t recovery_us_last, recovery_us_max;
} kvw_rail_health_t;

/* Rail health in the order of kvw_engine_rails(): returns the number of
 * rails and fills the first min(that, max) entries (NULL with max 0: just
 * the count). Thread-safe; each count exact, not taken together. */
KVW_API uint32_t kvw_engine_rail_health(const kvw_engine_t *engine, kvw_rail_health_t *health,
                                        uint32_t max);

/* The engine's metrics in the OpenMetrics text format (what a Prometheus
 * scrape reads; the library serves no HTTP: the caller's exporter does,
 * e.g. the Python package's collector, kvwire.metrics). One complete
 * exposition ending "# EOF\n", every family named kvwire_* and labelled
 * role="prefill"|"decode" and rank="<engine rank>" (docs/operations.md,
 * "Metrics", lists them): requests by outcome and failure cause, bytes by
 * outcome, transfer and request latency histograms, writes and doorbells,
 * per-rail bytes and health, replays, and the control plane (handshakes,
 * refusals, reconnects, orphans, aborts and their confirmations).
 *
 * Writes at most len bytes into buf (the caller's), NUL-terminated, and
 * the size the whole text needs, NUL included, into *needed_p. KVW_OK when
 * it fit; KVW_ERR_LIMIT when len was too small (then *needed_p is still
 * written, unlike other output parameters, and buf holds a cut text: call
 * again with at least *needed_p bytes; buf NULL with len 0 asks just the
 * size). KVW_ERR_INVALID for a NULL engine or needed_p, or a NULL buf with
 * len > 0. Thread-safe, takes no lock and allocates nothing: each value is
 * exact, but they are not taken atomically together (a scrape during a
 * transfer may see a write counted posted and not yet completed). The
 * needed size changes only with the library version and the number of
 * rails, never with the values' magnitude beyond their digits: allow some
 * slack (e.g. twice the size) when sizing a buffer once. Since 1.5. */
KVW_API kvw_status_t kvw_engine_metrics_text(const kvw_engine_t *engine, char *buf, size_t len,
                                             size_t *needed_p);

/* -------------------------------------------------------------- requests */

typedef enum {
    KVW_POLL_FAILED = 0,
    KVW_POLL_BOOTSTRAPPING = 1,
    KVW_POLL_WAITING_FOR_INPUT = 2,
    KVW_POLL_TRANSFERRING = 3,
    KVW_POLL_SUCCESS = 4,
} kvw_poll_t;

/* Static name of a poll state ("Failed", "Bootstrapping", ...). */
KVW_API const char *kvw_poll_name(kvw_poll_t state);

#define KVW_NO_AUX UINT32_MAX

typedef struct kvw_sender kvw_sender_t;
typedef struct kvw_receiver kvw_receiver_t;

/* Prefill side. Create a sender for room on a prefill engine. Its state is
 * Bootstrapping until decode's request for the room arrives, then
 * WaitingForInput; Transferring after kvw_sender_send(); Success once every
 * write of the request has completed. KVW_ERR_INVALID on a decode engine,
 * KVW_ERR_EXISTS when a live sender already has the room, KVW_ERR_NO_MEMORY.
 * It serves one decode request: should several decode engines have asked
 * for the room before it was created, it serves one and the others are
 * refused at once (KVW_ERR_EXISTS); kvw_sender_create_fanout() serves
 * several. The caller owns *sender_p until kvw_sender_destroy(). */
KVW_API kvw_status_t kvw_sender_create(kvw_engine_t *engine, uint64_t room,
                                       kvw_sender_t **sender_p);
/* Declare how many pages will be sent and which aux item (or KVW_NO_AUX).
 * KVW_ERR_STATE if called twice or after the request failed;
 * KVW_ERR_OUT_OF_RANGE (and Failed) for a page count or aux index the
 * regions cannot hold, KVW_ERR_MISMATCH (and Failed) when decode asked for
 * another page count (or for an aux item and none is given, or the
 * reverse). */
KVW_API kvw_status_t kvw_sender_init(kvw_sender_t *sender, size_t num_pages, uint32_t aux_index);
/* Hand over the next num_pages source page indices of the request, for
 * every layer: all of them at once, or one prefill chunk per call. They are
 * checked against the registered regions and copied, and their writes start
 * as soon as decode's request is known, while later chunks are still being
 * computed: the pages must be fully written when the call is made (or use
 * kvw_sender_send_after(); see "Producer contract" below). The call that reaches init's page count
 * is the final part: it also writes the aux item and the state, and its last write carries the
 * immediate that completes the request at decode.
 * KVW_ERR_OUT_OF_RANGE (a page outside the regions: the request turns
 * Failed) or KVW_ERR_INVALID (more pages than init declared: nothing
 * changes) without posting anything. */
KVW_API kvw_status_t kvw_sender_send(kvw_sender_t *sender, const uint64_t *page_indices,
                                     size_t num_pages);

/* One part of a request: source pages for the request's page positions
 * [first_page, first_page + num_pages), for KV layers [layer_begin,
 * layer_end) (0, 0: every layer). Layer-wise streaming hands each layer
 * (or range) over as soon as the forward pass produced it; chunks and
 * layers combine. For each layer, parts must cover the page positions in
 * order, without gaps or overlap. */
typedef struct kvw_part {
    const uint64_t *pages;
    size_t num_pages;
    size_t first_page;
    uint32_t layer_begin, layer_end;
} kvw_part_t;

/* Hand over one part (see kvw_part_t), its pages fully written (or use
 * kvw_sender_send_part_after(), below). The request completes with the part
 * that covers its last (page, layer) pair, once the state (if any) was
 * given. KVW_ERR_INVALID without any change for a part out of order or
 * out of bounds; KVW_ERR_OUT_OF_RANGE (and Failed) for a page outside the
 * registered regions; KVW_ERR_STATE before init or after the request
 * ended. Thread-safe with the sender's other calls. A request whose writes
 * posted so far wait for its next part longer than transfer_timeout_ms
 * after its first write fails (KVW_ERR_TIMEOUT), alone: its connection and
 * the other requests on it go on. */
KVW_API kvw_status_t kvw_sender_send_part(kvw_sender_t *sender, const kvw_part_t *part);

/* Producer contract (GPU memory)
 *
 * kvwire may read a part's source pages from the moment the call that
 * hands them over is made: the NIC reads registered memory (GPU memory
 * through dma-buf or nvidia_peermem, host memory) directly, and staging
 * copies GPU memory to host chunks on non-blocking CUDA streams of
 * kvwire's own, which wait for no stream of the application. Pages given
 * to kvw_sender_send() and kvw_sender_send_part() must therefore be fully
 * written when the call is made: if a GPU writes them, that work must have
 * completed (the host synchronized with it), not merely been queued.
 *
 * The _after forms take a CUDA event instead. cuda_event is a CUevent (a
 * CUDA runtime cudaEvent_t is the same handle) recorded by the caller on
 * its producing stream after the work that writes the part's pages.
 * kvwire reads none of the part's pages before the event completed: the
 * NIC's writes of directly registered memory are posted, and staging's
 * copies of staged memory are queued, only once it did. The call does not
 * wait for it: kvwire's poller (or stager) thread queries the event
 * (cuEventQuery, about every 100 us and never blocking) while the other
 * requests, on the same connection or not, go on. A request's parts are
 * still written in order, so a later part of it waits behind an earlier
 * one's event; the aux item and the state, written with the final part,
 * wait for the final part's event (when kvw_sender_send_state() is the
 * call that completes the request, they must be written when it is made).
 * The event is honoured for every kind of memory, host memory included (a
 * kernel may write pinned host memory). An event never recorded counts as
 * completed, as cuEventQuery says.
 *
 * An event that fails (its query returns an error other than
 * CUDA_ERROR_NOT_READY: a fault of the work it waits for, a sticky error
 * of its context, an invalid handle) fails the request with
 * KVW_ERR_TRANSFER and a reason naming the part and the CUDA error.
 * Nothing of that part or of a later one is written; decode's receiver
 * turns Failed with the same reason ("prefill: ...") once the writes
 * already posted for the request completed (as for any failure: after
 * decode's Failed, nothing lands). The connection and its other requests
 * are not affected.
 *
 * Ownership: kvwire neither takes nor retains the event. The caller must
 * neither destroy it nor record it again until the request has ended:
 * kvw_sender_poll() returned Success or Failed, or kvw_sender_destroy()
 * returned. From then on kvwire never touches it. (Recording it again
 * sooner on the same stream, as a per-layer event reused by the next
 * forward pass is, stays safe, since the newer record completes after the
 * older, but the part then waits for the newer record.)
 *
 * Layer-wise streaming: hand each layer over as soon as its kernels are
 * queued, with an event recorded right after them, and go on computing:
 *
 *     for (uint32_t l = 0; l < layers; l++) {
 *         run_layer(l, stream);                 // writes layer l's KV pages
 *         cudaEventRecord(done[l], stream);
 *         kvw_part_t part = {pages, n, 0, l, l + 1};
 *         kvw_sender_send_part_after(sender, &part, done[l]);
 *     }
 *
 * Layer l is written as soon as its event completed, while later layers
 * are still being computed. Waiting for an event counts toward the
 * transfer timeouts as a slow forward pass does.
 *
 * Both return what kvw_sender_send_part() / kvw_sender_send() return, and
 * KVW_ERR_UNSUPPORTED (logged; nothing changes) for an event when CUDA is
 * not available (no libcuda.so.1, or cuInit failed). A NULL event is the
 * call without _after. */
KVW_API kvw_status_t kvw_sender_send_part_after(kvw_sender_t *sender, const kvw_part_t *part,
                                                void *cuda_event);
/* kvw_sender_send() with a producer's event (see above). */
KVW_API kvw_status_t kvw_sender_send_after(kvw_sender_t *sender, const uint64_t *page_indices,
                                           size_t num_pages, void *cuda_event);
/* Hybrid models: each state group its own index list. A request carries,
 * per KVW_GROUP_STATE group, the indices of that group's items: Mamba's
 * recurrent state one slot per request, a sliding-window (SWA) or sparse
 * (DSA) KV pool its own page list, usually shorter than the KV page list.
 * group is the group's index in kvw_engine_params_t.groups; count 0 skips
 * the group for this request (nothing of it is written). A state group
 * given no list takes the request's shared state indices (kvw_indices_t
 * .state, or send_state's), which is what kvw_receiver_init_indices() and
 * kvw_sender_send_state() give every state group. Each list is checked
 * against its own group's regions (every index below the items of each of
 * them) before anything is sent or posted. Prefill's and decode's counts
 * must agree group by group: a request where they differ fails on both
 * sides (KVW_ERR_MISMATCH, naming the group and both counts). */
typedef struct kvw_state_list {
    uint32_t group;    /* index of a KVW_GROUP_STATE group in the engine's groups */
    uint32_t reserved; /* 0 */
    const uint64_t *indices;
    size_t count; /* 0: the group is skipped */
} kvw_state_list_t;

/* Source indices of the state groups (as many as decode asked for). They
 * are written with the final part; a request whose decode side asked for
 * state completes only once they are given. */
KVW_API kvw_status_t kvw_sender_send_state(kvw_sender_t *sender, const uint64_t *state_indices,
                                           size_t num_state);
/* kvw_sender_send_state() with an index list for some state groups
 * (kvw_state_list_t above): the groups not listed take state_indices. The
 * source side of kvw_receiver_init_lists(), with the same checks:
 * KVW_ERR_INVALID (nothing changes) for a list naming no state group or a
 * group twice, KVW_ERR_OUT_OF_RANGE (and Failed, decode told) for an index
 * outside its group's regions, KVW_ERR_MISMATCH (and Failed) when decode
 * asked for another count in some group. Since 1.2. */
KVW_API kvw_status_t kvw_sender_send_state_lists(kvw_sender_t *sender,
                                                 const uint64_t *state_indices, size_t num_state,
                                                 const kvw_state_list_t *lists, size_t num_lists);
/* The request's state. Not a pure read: while the request is Transferring
 * and the poller thread sleeps, it runs the poller's pass itself (retires
 * completions, posts queued writes; see "Thread safety"). */
KVW_API kvw_poll_t kvw_sender_poll(kvw_sender_t *sender);
/* Why a Failed sender failed: status (return value) and a message owned by
 * the sender (valid until it is destroyed) in *reason_p if not NULL.
 * KVW_OK if it has not failed. */
KVW_API kvw_status_t kvw_sender_failure(const kvw_sender_t *sender, const char **reason_p);
/* Give the request up: it turns Failed (KVW_ERR_ABORTED) at once and no
 * further write is posted for it. Decode is told once the writes already
 * posted for the room have completed, so decode's Failed always means that
 * nothing more lands in its pages. Other requests, on the same connection or
 * not, are not affected. KVW_ERR_STATE if the request already ended
 * (Success or Failed). */
KVW_API kvw_status_t kvw_sender_abort(kvw_sender_t *sender);
/* Accepts NULL. Destroying a sender that has not ended aborts it first
 * (kvw_sender_abort); it does not wait. */
KVW_API void kvw_sender_destroy(kvw_sender_t *sender);

/* Verified transfers (config verify; docs/failure-semantics.md, "Verified
 * transfers"), when kvwire cannot read the memory itself: an engine with
 * a region of GPU memory the NIC reaches directly (dma-buf, nvidia_peermem)
 * leaves both digests to the caller, who computes them on the GPU (e.g.
 * with torch), any 64-bit function of the request's bytes, the same on
 * both sides; kvwire only carries prefill's to decode and compares.
 *
 * Prefill: the digest of what this request sends, once. It may be given
 * at any time while the sender lives, before or after its Success (the
 * writes may complete before the caller's digest is computed); kvwire
 * sends it to decode once every write completed and the digest was given,
 * so decode waits (up to its transfer_timeout_ms) for one given late. A
 * sender destroyed before it was given sends none (decode then times
 * out). KVW_ERR_STATE when the engine's check is off, when kvwire computes
 * the digest itself (host or staged memory), once given, or after the
 * request failed; KVW_ERR_INVALID for NULL. A fan-out sender
 * (kvw_sender_create_fanout) sends every decode receiver the same bytes
 * (head slicing is not verified): the one digest goes to each of them
 * (KVW_ERR_STATE only when no request of it takes one). Thread safety as
 * any call on the sender. Since 1.4. */
KVW_API kvw_status_t kvw_sender_set_digest(kvw_sender_t *sender, uint64_t digest);

/* Decode side. Create a receiver for room, fetching its data from the
 * prefill engine registered as prefill_rank at bootstrap_addr ("host:port").
 * Bootstrapping until the peer is looked up and connected (once per peer),
 * then WaitingForInput; Transferring after kvw_receiver_init(); Success when
 * the request's last write has landed in this engine's memory. It does not
 * wait: the lookup and connection happen on the control thread.
 * KVW_ERR_INVALID on a prefill engine or for a bad address, KVW_ERR_EXISTS
 * when a receiver for the room is still on the engine, KVW_ERR_NO_MEMORY
 * (also past 65536 receivers in flight). The caller owns *receiver_p until
 * kvw_receiver_destroy(). */
KVW_API kvw_status_t kvw_receiver_create(kvw_engine_t *engine, const char *bootstrap_addr,
                                         uint32_t prefill_rank, uint64_t room,
                                         kvw_receiver_t **receiver_p);
/* Destination page indices (copied, checked against the local regions) and
 * aux index (or KVW_NO_AUX). May be called while still Bootstrapping: the
 * request is sent once the peer is connected. KVW_ERR_OUT_OF_RANGE when a
 * page or the aux index does not fit: the receiver then turns Failed with
 * that reason and prefill's sender for the room is told (it fails too).
 * KVW_ERR_STATE if called twice or after the request ended. */
KVW_API kvw_status_t kvw_receiver_init(kvw_receiver_t *receiver, const uint64_t *page_indices,
                                       size_t num_pages, uint32_t aux_index);

/* Every index space of a request: KV pages, the aux item, state indices. */
typedef struct kvw_indices {
    const uint64_t *pages;
    size_t num_pages;
    uint32_t aux_index; /* KVW_NO_AUX: none */
    const uint64_t *state;
    size_t num_state; /* 0 when the layout has no state group */
} kvw_indices_t;

/* kvw_receiver_init with state indices. */
KVW_API kvw_status_t kvw_receiver_init_indices(kvw_receiver_t *receiver,
                                               const kvw_indices_t *indices);

/* kvw_receiver_init_indices() with an index list for some state groups
 * (num_lists entries, each group at most once; the others take
 * indices->state). As with init's other checks the receiver then turns
 * Failed, with the reason: KVW_ERR_INVALID for a list naming no state
 * group or a group twice, KVW_ERR_OUT_OF_RANGE for an index outside its
 * group's regions. Since 1.2. */
KVW_API kvw_status_t kvw_receiver_init_lists(kvw_receiver_t *receiver, const kvw_indices_t *indices,
                                             const kvw_state_list_t *lists, size_t num_lists);
/* As kvw_sender_poll(): Transferring, it may reap the completion queue. */
KVW_API kvw_poll_t kvw_receiver_poll(kvw_receiver_t *receiver);
/* Why a Failed receiver failed (as kvw_sender_failure). KVW_ERR_ABORTED
 * after an abort, KVW_ERR_TIMEOUT after a transfer timeout, KVW_ERR_PEER
 * when the connection died, or prefill's status with a reason starting
 * "prefill: " when prefill failed the request. */
KVW_API kvw_status_t kvw_receiver_failure(const kvw_receiver_t *receiver, const char **reason_p);
/* Give the request up without blocking. Before the request was sent to
 * prefill it turns Failed (KVW_ERR_ABORTED) at once. After, it stays
 * Transferring until prefill confirms that every write it posted for the
 * room has completed (one control round trip), or, if no confirmation
 * comes within peer_timeout_ms, until the connection is declared dead and
 * its QP moved to the error state; then it turns Failed. A staged request
 * (GPU memory copied through the staging pool) whose data all landed and
 * is being copied to the GPU needs no confirmation: it turns Failed once
 * that copy is over. Invariant: once a receiver reports Failed, no byte of
 * its request lands in its pages again (from the NIC or from the staging
 * copy), so they may be given to another request at once. Only this
 * request fails unless the connection itself breaks. (A transfer timeout
 * aborts the same way, with KVW_ERR_TIMEOUT; it measures the data landing,
 * not the staging copy after it.) KVW_ERR_STATE if it already ended. */
KVW_API kvw_status_t kvw_receiver_abort(kvw_receiver_t *receiver);
/* Per-request metrics. bytes and writes: what prefill posted for the
 * request (decode: what it expects, from its own pages). transfer_us:
 * prefill, from its first post to its last write completing; decode, from
 * sending its request to the data landing. start_ns and end_ns are those
 * two moments on CLOCK_MONOTONIC (compare them with the caller's own
 * clock_gettime(CLOCK_MONOTONIC) to see where a request's time went). 0
 * until known. */
typedef struct kvw_req_metrics {
    uint64_t bytes;
    uint64_t writes;
    uint64_t transfer_us;
    uint64_t start_ns;
    uint64_t end_ns;
} kvw_req_metrics_t;

KVW_API kvw_status_t kvw_sender_metrics(const kvw_sender_t *sender, kvw_req_metrics_t *metrics_p);
KVW_API kvw_status_t kvw_receiver_metrics(const kvw_receiver_t *receiver,
                                          kvw_req_metrics_t *metrics_p);
/* The same as sized outputs (kvw_engine_counters_ex() says how): size is
 * sizeof the caller's kvw_req_metrics_t. Since 1.5. */
KVW_API kvw_status_t kvw_sender_metrics_ex(const kvw_sender_t *sender,
                                           kvw_req_metrics_t *metrics_p, size_t size);
KVW_API kvw_status_t kvw_receiver_metrics_ex(const kvw_receiver_t *receiver,
                                             kvw_req_metrics_t *metrics_p, size_t size);

/* Accepts NULL. A receiver that has not ended is aborted first, and destroy
 * waits for the abort's barrier (normally one control round trip; without
 * prefill's confirmation the connection is declared dead after
 * peer_timeout_ms), so that when it returns nothing more lands in the
 * receiver's pages. The wait is bounded by 2 x peer_timeout_ms + 1 s, plus,
 * for staged GPU memory, however long a copy from the staging pool to the
 * GPU already under way takes. Should the bound pass first (the control
 * thread stuck), destroy logs an error and returns anyway; the engine then
 * keeps the request, and its staging slots, until it ends, and the
 * receiver's pages must not be reused before that. */
KVW_API void kvw_receiver_destroy(kvw_receiver_t *receiver);

/* Decode's half of a caller-computed digest (see kvw_sender_set_digest):
 * kvw_receiver_landed() says whether every write of the request landed in
 * its pages (1), so that the caller may now compute the digest of its
 * pages and hand it over with kvw_receiver_verify(); 0 while not yet (or
 * the request ended, or kvwire computes the digest itself). The receiver
 * stays Transferring until the digest is given and prefill's arrived;
 * then Success when they are equal, Failed with KVW_ERR_CORRUPT when not,
 * the reason naming the room and both digests. All of that within
 * transfer_timeout_ms of the request (then KVW_ERR_TIMEOUT, as for data
 * that does not land). kvw_receiver_verify(): KVW_ERR_STATE before the
 * request landed, once a digest was given, after it ended, or when the
 * check is off or kvwire computes it; KVW_ERR_INVALID for NULL or a
 * receiver over several prefill ranks. Thread safety as any call on the
 * receiver. Since 1.4. */
KVW_API int kvw_receiver_landed(kvw_receiver_t *receiver);
KVW_API kvw_status_t kvw_receiver_verify(kvw_receiver_t *receiver, uint64_t digest);

/* Engines that bring their own discovery (sglang's bootstrap server carries
 * each prefill rank's kvw_engine_endpoint()): kvw_receiver_create for a
 * prefill engine whose control endpoint ("tcp://ip:port") is already known,
 * with no bootstrap lookup. prefill_rank only names the peer in logs and
 * reasons; receivers naming the same endpoint share one connection. One
 * engine may hold receivers for the same room from different endpoints
 * (sglang contacts every prefill TP rank of a request); KVW_ERR_EXISTS for
 * the same room and endpoint twice. A handshake that is refused or
 * unanswered is retried on the same endpoint until bootstrap_timeout_ms,
 * then the receiver fails; logs name the peer "@" and its endpoint. Such a
 * prefill engine may be created with bootstrap_addr NULL (it then
 * registers nowhere). KVW_ERR_INVALID for an endpoint that is not tcp://
 * (and, for kvw_receiver_create, for a bootstrap address starting "@"). */
KVW_API kvw_status_t kvw_receiver_create_at(kvw_engine_t *engine, const char *endpoint,
                                            uint32_t prefill_rank, uint64_t room,
                                            kvw_receiver_t **receiver_p);
/* Decode over several prefill ranks (head slicing with decode TP < prefill
 * TP, docs/head-slicing.md): one receiver for a room whose heads come from
 * num_ranks prefill ranks, each named by a bootstrap address and rank, or
 * (bootstrap_addr NULL) a control endpoint as kvw_receiver_create_at. */
typedef struct kvw_prefill_rank {
    const char *bootstrap_addr; /* a bootstrap service; NULL: endpoint */
    const char *endpoint;       /* "tcp://ip:port" of a prefill engine, when bootstrap_addr NULL */
    uint32_t rank;
} kvw_prefill_rank_t;

typedef struct kvw_receiver_params {
    size_t struct_size; /* sizeof(kvw_receiver_params_t) */
    uint64_t room;
    uint32_t num_ranks; /* 1..KVW_MAX_PREFILL_RANKS */
    const kvw_prefill_rank_t *ranks;
    /* Since 1.5: how many decode receivers ask each of these prefill ranks
     * for the room, as kvw_receiver_set_room_receivers(); 0: not said. */
    uint32_t room_receivers;
    /* New fields only at the end (sized structs, above). */
} kvw_receiver_params_t;

#define KVW_MAX_PREFILL_RANKS 64

/* The receiver is used as any other (init, poll, failure, abort, metrics,
 * destroy). Once every rank is connected it learns which heads each holds
 * and asks each for the heads it sends (exactly one sender per head, the
 * first rank in the list holding it, a rank keeping a run of heads it
 * started; ranks holding only heads another sends owe nothing and finish
 * at once, as do GQA replicas); the first rank owing heads also sends the
 * aux item and the state. Success once every rank delivered; when one
 * fails, the others are aborted and the receiver turns Failed only once
 * every rank confirmed that nothing more lands, with a reason naming the
 * rank that failed. Every KV group must describe its heads (group_heads),
 * and the engine must register its memory directly (not staged):
 * KVW_ERR_UNSUPPORTED otherwise; KVW_ERR_INVALID for a bad list (none,
 * too many, the same rank twice). metrics' bytes are the sum over ranks.
 * Each rank fills a slice of decode's rows. By default it writes that
 * slice contiguously into a slice of decode's landing buffer (config
 * landing_mib, registered once per decode engine: as many RDMA writes as
 * equal TP), and decode copies it into the rows (host memcpy, or
 * cuMemcpy2DAsync for GPU regions) before the rank's part is Success; a
 * request that finds no room in the buffer, or landing_mib 0, takes one
 * RDMA write per token row (NHD) or per page (HND) instead.
 * docs/head-slicing.md measures both. */
KVW_API kvw_status_t kvw_receiver_create_ranks(kvw_engine_t *engine,
                                               const kvw_receiver_params_t *params,
                                               kvw_receiver_t **receiver_p);

/* Decode side, before kvw_receiver_init*(): how many decode receivers ask
 * this receiver's prefill rank (each rank of a receiver over several) for
 * the room, this one included (decode TP > prefill TP: sglang's
 * required_dst_info_num), 1..KVW_MAX_DECODE_RECEIVERS; 0 (the default):
 * not said. The request carries it where the connection agreed on wire
 * 12's KVW_WIRE_CAP_FANOUT, and prefill's sender learns its receiver count
 * from it (kvw_sender_create_learn) or checks it. KVW_ERR_INVALID for
 * NULL or more than KVW_MAX_DECODE_RECEIVERS, KVW_ERR_STATE after init or
 * once the receiver ended. Since 1.5. */
KVW_API kvw_status_t kvw_receiver_set_room_receivers(kvw_receiver_t *receiver, uint32_t n);

/* Prefill over several decode receivers (decode TP > prefill TP: one
 * prefill rank holds what num_receivers decode ranks each need, the same
 * room for all of them, as sglang's decode ranks ask): one sender for room
 * that serves num_receivers decode requests for it, one per decode engine.
 * Each request is served as a plain sender serves its one: its own pages,
 * aux item and state, and, with head slicing (group_heads), the heads that
 * decode engine holds (decode's heads from the handshake: a gather when it
 * holds fewer than this rank, docs/head-slicing.md); MLA's replicated
 * latent goes whole to each. The calls (init, send, send_part, send_state,
 * their _after forms) apply to every request, and are checked against
 * each; the source pages must stay unchanged until the sender ended.
 * Success once every request is delivered. A failure of any (its decode
 * engine died or aborted, a count mismatch, a timeout) fails the others at
 * once, each decode receiver is told once none of its writes can still
 * land, and the sender is Failed once every request ended, its reason
 * naming the first one that failed ("decode receiver 1 of 2: ..."). A
 * second request for the room from a decode engine that already has one
 * (another token) is refused to it with KVW_ERR_EXISTS, a request past
 * num_receivers with KVW_ERR_LIMIT; the requests already accepted go on.
 * Requests decode sent before the sender existed are adopted, up to
 * num_receivers. kvw_sender_requested() answers for the first request to
 * arrive; kvw_sender_metrics() sums bytes and writes over the requests.
 * With num_receivers 2 or more, a request that says another receiver
 * count (wire 12, kvw_receiver_set_room_receivers) fails the room (see
 * kvw_sender_create_learn() below). num_receivers 1 is kvw_sender_create(),
 * which checks no count.
 * KVW_ERR_INVALID for 0 or more
 * than KVW_MAX_DECODE_RECEIVERS, or a decode engine; KVW_ERR_EXISTS as
 * kvw_sender_create(); KVW_ERR_UNSUPPORTED on an engine staging GPU memory
 * (KVW_GPU_PATH=staging). Thread safety as any sender: one thread at a time
 * per handle. The caller owns *sender_p until kvw_sender_destroy(), which
 * ends every request. */
#define KVW_MAX_DECODE_RECEIVERS 64
KVW_API kvw_status_t kvw_sender_create_fanout(kvw_engine_t *engine, uint64_t room,
                                              uint32_t num_receivers, kvw_sender_t **sender_p);

/* Prefill, when it does not know how many decode receivers ask for the
 * room (sglang without --disaggregation-decode-tp): a sender as
 * kvw_sender_create_fanout()'s whose num_receivers is the count the first
 * decode request for the room says (kvw_receiver_set_room_receivers() on
 * decode; 1 when the request says none: a decode engine before 1.5, or a
 * connection that did not agree on wire 12's KVW_WIRE_CAP_FANOUT, so a
 * decode rank that reads alone is served as by kvw_sender_create()).
 * Requests that arrived before the sender existed count: the first of
 * them says. A request that says another count than the sender serves
 * (the first request's, or kvw_sender_create_fanout()'s num_receivers)
 * fails the room for every receiver with KVW_ERR_MISMATCH, the reason
 * naming both counts ("a request says 3 decode receivers ask for it, the
 * room's sender serves 2"). Until the first request arrived the sender is
 * Bootstrapping and its calls that hand work over (init, send, send_part,
 * send_state and their _after forms) return KVW_ERR_STATE without any
 * change: make them once poll() says WaitingForInput (every receiver
 * asked), as sglang does. Otherwise as kvw_sender_create_fanout(): its
 * errors, thread safety and ownership. Since 1.5. */
KVW_API kvw_status_t kvw_sender_create_learn(kvw_engine_t *engine, uint64_t room,
                                             kvw_sender_t **sender_p);

/* Prefill side: what decode asked for in the request for this sender's
 * room, once it has arrived: its page count and whether it wants the aux
 * item (*aux_p: KVW_NO_AUX or 0). KVW_ERR_STATE while still Bootstrapping
 * (no request yet). Lets a caller recognise a decode rank that reads
 * nothing from this prefill rank (0 pages, no aux: MLA with prefill TP >
 * decode TP, where one prefill rank sends and the others only finish). */
KVW_API kvw_status_t kvw_sender_requested(const kvw_sender_t *sender, size_t *num_pages_p,
                                          uint32_t *aux_p);

/* ------------------------------------------------------------- bootstrap */

typedef struct kvw_bootstrap kvw_bootstrap_t;

/* A prefill engine re-registers its rank every bootstrap_refresh_ms
 * (default KVW_BOOTSTRAP_REFRESH_MS), so a restarted service is
 * repopulated within about that long. The service keeps a rank for its
 * owner (the engine that registered it) for a lease (default
 * KVW_BOOTSTRAP_LEASE_MS) after each refresh: another engine on another
 * host registering the rank meanwhile is refused with KVW_ERR_EXISTS (an
 * engine on the owner's host, i.e. a restarted process, takes it over at
 * once), and a lookup after the lease ran out answers "not registered". An
 * engine destroyed cleanly unregisters at once. */
#define KVW_BOOTSTRAP_REFRESH_MS 5000
#define KVW_BOOTSTRAP_LEASE_MS 15000

/* New fields only at the end (sized structs, above). */
typedef struct kvw_bootstrap_params {
    size_t struct_size;    /* sizeof(kvw_bootstrap_params_t): kvw_bootstrap_params_init() */
    const char *bind_addr; /* "ip:port"; port 0 picks an ephemeral port. Required. */
    /* Only the cluster key fields are used (see kvw_config_t): with a key,
     * only engines holding the same key can register or look up, and all
     * traffic is encrypted. NULL: kvw_config_init() (the KVW_* env). */
    const kvw_config_t *config;
    /* 0: KVW_BOOTSTRAP_LEASE_MS. Keep it several refresh intervals long,
     * or a live engine may lose its rank to a late refresh. */
    uint32_t lease_ms;
} kvw_bootstrap_params_t;

/* Zero every field (config NULL, the default lease) and set struct_size
 * (inline: the caller's sizeof). */
static inline void kvw_bootstrap_params_init(kvw_bootstrap_params_t *params)
{
    memset(params, 0, sizeof(*params));
    params->struct_size = sizeof(*params);
}

/* Start a bootstrap service on its own thread. KVW_ERR_INVALID for bad
 * params (no bind_addr, a bad struct_size) or a bad cluster key,
 * KVW_ERR_UNSUPPORTED for a key with a libzmq lacking CURVE,
 * KVW_ERR_CONTROL when it cannot bind; all logged. The params and the
 * config are copied; the caller keeps them. Thread-safe. */
KVW_API kvw_status_t kvw_bootstrap_create(const kvw_bootstrap_params_t *params,
                                          kvw_bootstrap_t **bootstrap_p);
/* "ip:port" it actually listens on; owned by the service, valid for its
 * lifetime. */
KVW_API const char *kvw_bootstrap_addr(const kvw_bootstrap_t *bootstrap);
/* Stop the service and free it. Registrations are lost: the prefill
 * engines' refreshes repopulate a new service on the same address.
 * Accepts NULL. kvw_bootstrap_* calls on one service must not race with
 * its destroy; otherwise they are thread-safe. */
KVW_API void kvw_bootstrap_destroy(kvw_bootstrap_t *bootstrap);

#ifdef __cplusplus
}
#endif

#endif /* KVWIRE_H */
