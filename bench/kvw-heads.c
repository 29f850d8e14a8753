/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-heads: what head slicing costs in writes, on the host, no RDMA
 * needed. For a Llama-like layout (8 KV heads of 128 bytes, K and V
 * regions per layer) and page sizes 16 and 64 it plans one request per
 * TP ratio with the head planner (src/plan/heads.c) and prints, per
 * request and over every decode rank: the writes (WRs), their
 * scatter/gather entries, and the writes of "one write per token row" and
 * of the same bytes at equal TP. It also times, on this core, the
 * planner per write and the 2D copy a receiver landing its slices
 * contiguously would do (host memcpy: slices of a token row's heads into
 * every other row slot), which together with a device's message rate
 * decides between one write per row and landing plus copy.
 *
 *   kvw-heads [--tokens N] [--layers L] [--max-sge S] [--contig C]
 *       N tokens a request (4096), L layers (32), S entries per write (30,
 *       mlx5's max_sge), source pages contiguous C at a time (0: all;
 *       decode's pages are always contiguous runs of C too). */
#include "plan/heads.h"

#include "kvw-tools.h"

#include <inttypes.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { HEADS = 8, HEAD_BYTES = 128, MAX_TP = 8 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static kvw_heads_t rank_heads(uint32_t tp, uint32_t r, uint32_t page_tokens)
{
    uint32_t n = HEADS / tp;
    return (kvw_heads_t){HEADS, r * n, n, HEAD_BYTES, page_tokens, KVW_HEADS_NHD};
}

typedef struct tally {
    uint64_t writes, sges, rows, bytes;
    double plan_s;
} tally_t;

/* One region pair's plan for every decode rank, times 2 regions x layers. */
static void plan_ratio(uint32_t ptp, uint32_t dtp, uint32_t page_tokens, uint32_t order,
                       int landing, const kvw_run_t *runs, size_t num_runs, uint32_t max_sge,
                       uint32_t layers, tally_t *t)
{
    memset(t, 0, sizeof(*t));
    kvw_heads_t ph[MAX_TP];
    for (uint32_t r = 0; r < ptp; r++) {
        ph[r] = rank_heads(ptp, r, page_tokens);
        ph[r].order = order;
    }
    for (uint32_t q = 0; q < dtp; q++) {
        kvw_heads_t dh = rank_heads(dtp, q, page_tokens);
        dh.order = order;
        kvw_head_range_t owed[MAX_TP];
        char why[200];
        if (kvw__heads_assign(&dh, ph, ptp, owed, why, sizeof(why))) {
            fprintf(stderr, "kvw-heads: %s\n", why);
            exit(1);
        }
        for (uint32_t r = 0; r < ptp; r++) {
            if (!owed[r].count)
                continue;
            /* Addresses are never touched: the planner only computes them. */
            kvw_heads_plan_t p = {.local_addr = 1u << 20,
                                  .remote_addr = 1u << 30,
                                  .runs = runs,
                                  .num_runs = num_runs,
                                  .max_sge = max_sge,
                                  .max_msg = 1u << 30};
            if (kvw__heads_geom(&ph[r], &dh, owed[r], &p.geom, why, sizeof(why))) {
                fprintf(stderr, "kvw-heads: %s\n", why);
                exit(1);
            }
            if (landing && kvw__heads_mode(&p.geom) == KVW_HEADS_ROWS) {
                kvw_heads_geom_t land;
                kvw__heads_landing(&p.geom, &land);
                p.geom = land;
            }
            kvw_heads_cursor_t c = {0, 0, 0};
            kvw_gwrite_t w;
            uint64_t n = 0, sges = 0, bytes = 0;
            double t0 = now_s();
            while (kvw__heads_next(&p, &c, &w)) {
                n++;
                sges += w.num_sge;
                bytes += w.len;
            }
            t->plan_s += (now_s() - t0) * 2 * layers;
            t->writes += n * 2 * layers;
            t->sges += sges * 2 * layers;
            t->bytes += bytes * 2 * layers;
            /* One write per token row: a write per token and region. */
            t->rows +=
                kvw__heads_units(&p) * 2 * layers * (order == KVW_HEADS_HND ? page_tokens : 1);
        }
    }
}

/* Host 2D copy: rows of `slice` bytes from a contiguous landing buffer to
 * every pitch bytes, GB/s over `bytes`. */
static double copy2d_gbs(uint64_t slice, uint64_t pitch, uint64_t bytes)
{
    uint64_t rows = bytes / slice;
    uint8_t *src = malloc(bytes), *dst = malloc(rows * pitch);
    if (!src || !dst) {
        fprintf(stderr, "kvw-heads: out of memory\n");
        exit(1);
    }
    memset(src, 1, bytes);
    memset(dst, 0, rows * pitch);
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now_s();
        for (uint64_t i = 0; i < rows; i++)
            memcpy(dst + i * pitch, src + i * slice, slice);
        double gbs = (double)bytes / (now_s() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    volatile uint8_t sink = dst[(rows - 1) * pitch];
    (void)sink;
    free(src);
    free(dst);
    return best;
}

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvw-heads [--tokens N] [--layers L] [--max-sge S] [--contig C]\n"
           "Head slicing's write plans on a Llama-like layout, host only: WRs and SGEs per\n"
           "request for each prefill:decode TP ratio, against equal TP and a write per\n"
           "token row, and the planner's cost per WR. Numbers are decimal, or hex after 0x.\n"
           "  --tokens N     tokens a request (4096)\n"
           "  --layers L     layers (32)\n"
           "  --max-sge S    scatter/gather entries a WR may carry (30)\n"
           "  --contig C     pages in runs of C (0: contiguous)\n"
           "  -h, --help     this help\n"
           "  -V, --version  the kvwire version\n"
           "Exit status: 0 every plan checked; 1 a plan was wrong, or a bad command line.\n");
    exit(0);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-heads";
    uint32_t tokens = 4096, layers = 32, max_sge = 30, contig = 0;
    static const struct option lo[] = {
        {"tokens", 1, 0, 't'}, {"layers", 1, 0, 'L'}, {"max-sge", 1, 0, 's'},
        {"contig", 1, 0, 'c'}, {"help", 0, 0, 'h'},   {"version", 0, 0, 'V'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "hV", lo, NULL)) != -1) {
        if (c == 't')
            tokens = kvw_tool_u32("--tokens", optarg, 1, 1u << 20);
        else if (c == 'L')
            layers = kvw_tool_u32("--layers", optarg, 1, 65535);
        else if (c == 's')
            max_sge = kvw_tool_u32("--max-sge", optarg, 1, 65535);
        else if (c == 'c')
            contig = kvw_tool_u32("--contig", optarg, 0, 1u << 20);
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
    printf("Llama-like layout: %u KV heads x %u bytes, K and V, %u layers, %u tokens a request, "
           "max_sge %u, pages %s\n",
           HEADS, HEAD_BYTES, layers, tokens, max_sge, contig ? "in runs" : "contiguous");
    printf("%-5s %-4s %-7s %-8s %10s %10s %10s %8s %8s %9s\n", "page", "ord", "P:D", "path", "WRs",
           "SGEs", "row WRs", "vs eqTP", "vs rows", "ns/WR");
    static const uint32_t ratios[][2] = {{1, 1}, {2, 1}, {1, 2}, {4, 1}, {1, 4}, {8, 2}};
    for (uint32_t page = 16; page <= 64; page *= 4)
        for (uint32_t order = 0; order <= 1; order++) {
            size_t npages = (tokens + page - 1) / page;
            kvw_run_t *runs = calloc(npages, sizeof(*runs));
            uint64_t *src = calloc(npages, sizeof(*src)), *dst = calloc(npages, sizeof(*dst));
            if (!runs || !src || !dst)
                return 1;
            for (size_t i = 0; i < npages; i++) {
                src[i] = contig ? (i / contig) * (contig + 1) + i % contig : i;
                dst[i] = contig ? (i / contig) * (contig + 3) + i % contig : i;
            }
            size_t num_runs = kvw__plan_runs(src, dst, npages, runs);
            tally_t eq;
            plan_ratio(1, 1, page, order, 0, runs, num_runs, max_sge, layers, &eq);
            for (size_t k = 0; k < sizeof(ratios) / sizeof(ratios[0]); k++)
                for (int landing = 0; landing <= (ratios[k][0] > ratios[k][1]); landing++) {
                    tally_t t;
                    plan_ratio(ratios[k][0], ratios[k][1], page, order, landing, runs, num_runs,
                               max_sge, layers, &t);
                    const char *path = ratios[k][0] == ratios[k][1]  ? "copy"
                                       : ratios[k][0] < ratios[k][1] ? "gather"
                                       : landing                     ? "land+2D"
                                                                     : "rows";
                    char pd[16];
                    snprintf(pd, sizeof(pd), "%u:%u", ratios[k][0], ratios[k][1]);
                    printf("%-5u %-4s %-7s %-8s %10" PRIu64 " %10" PRIu64 " %10" PRIu64
                           " %7.2fx %7.3fx %9.1f\n",
                           page, order ? "HND" : "NHD", pd, path, t.writes, t.sges, t.rows,
                           (double)t.writes / (double)eq.writes, (double)t.writes / (double)t.rows,
                           t.plan_s * 1e9 / (double)t.writes);
                }
            free(runs);
            free(src);
            free(dst);
        }
    /* The receiver's copy for 2:1 NHD (each prefill rank's 4 heads into
     * decode's rows of 8): 512-byte slices to a 1024-byte pitch. */
    uint64_t bytes = (uint64_t)tokens * 4 * HEAD_BYTES * 8;
    printf("host 2D copy, 512 B slices to a 1024 B pitch, %" PRIu64 " MiB: %.2f GB/s; "
           "contiguous memcpy of the same: %.2f GB/s\n",
           bytes >> 20, copy2d_gbs(512, 1024, bytes), copy2d_gbs(bytes / 64, bytes / 64, bytes));
    return 0;
}
