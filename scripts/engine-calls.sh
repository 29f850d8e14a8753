#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Who calls whom inside src/engine/ (and its subfolders, named folder/file):
# for each object file of the engine, the other engine files whose
# functions (kvw_/kvw__ symbols) it calls, read with nm from the built
# objects (defined vs undefined symbols, each undefined one mapped to the
# engine file that defines it). Prints the file-to-file edges with their
# call counts (distinct functions), the cycles (strongly connected
# components, mutual pairs, elementary cycles), and the calls that go "up"
# against the intended order (docs/architecture.md):
#
#   0  wake, txq, reqtab, request, landing, metrics
#                                  (the ground floor: thread wake-ups; one
#                                   QP's send queue; the request table; a
#                                   request's life; decode's landing buffer;
#                                   the request-end counters)
#   1  peer, verify, ctl_frame, stage_jobs
#                                  (connections; verified transfers' digests;
#                                   control messages' framing; the staging
#                                   jobs: their queue and copies)
#   2  rails/*, part              (failover, replay, REPLAY_ASK, LANE_*,
#                                   rejoin; a sender's parts)
#   3  poller, stager, stage_send, stage_recv, copier
#                                  (the poller's pass; staging's two halves;
#                                   the copy executor's thread: staging's
#                                   loop and the landing buffer's scatter)
#   4  sender, receiver            (one request's owner for each role)
#   5  txset, rxset, ctl_prefill, ctl_decode
#                                  (sets of requests; each role's control
#                                   messages)
#   6  control                     (the control thread)
#   7  api_sender, api_receiver, engine, outputs, symver
#                                  (the public API: sender and receiver
#                                   handles, create, destroy, the sized
#                                   outputs, the older symbol versions)
#
# A file may call files of its own rank or lower; a call to a higher rank is
# a back-up call. Files not listed above get rank 4. Lower files reach the
# ones above only through hooks those register downward (kvw_role_ops_t,
# a set's member_failed_locked).
#
# Usage: scripts/engine-calls.sh [OBJDIR]   (default build/obj/src/engine;
# run `make all` first). Needs nm and python3.
set -eu
dir=${1:-build/obj/src/engine}
[ -d "$dir" ] || { echo "engine-calls: no $dir (run make all first)" >&2; exit 1; }
find "$dir" -name '*.o' | sort | while read -r o; do
    f=${o#"$dir"/}
    f=${f%.o}
    nm "$o" | awk -v f="$f" '$2 ~ /^[TDBR]$/ && $3 ~ /^kvw_/ { print "D", f, $3 }'
    nm -u "$o" | awk -v f="$f" '$2 ~ /^kvw_/ { print "U", f, $2 }'
done | python3 -c '
import sys, itertools
rank = {}
for r, names in enumerate([["wake", "txq", "reqtab", "request", "landing", "metrics"],
                           ["peer", "verify", "ctl_frame", "stage_jobs"],
                           ["part"],
                           ["poller", "stager", "stage_send", "stage_recv", "copier"],
                           ["sender", "receiver"],
                           ["txset", "rxset", "ctl_prefill", "ctl_decode"],
                           ["control"], ["api_sender", "api_receiver", "engine", "outputs", "symver"]]):
    for n in names:
        rank[n] = r
def rk(f):
    if f.startswith("rails/"):
        return 2
    return rank.get(f, 4)
owner, uses = {}, {}
for line in sys.stdin:
    k, f, s = line.split()
    if k == "D":
        owner[s] = f
    else:
        uses.setdefault(f, set()).add(s)
files = sorted(set(owner.values()) | set(uses))
edges = {}
for f in files:
    for s in uses.get(f, ()):
        g = owner.get(s)
        if g and g != f:
            edges.setdefault((f, g), []).append(s)
print("edges (caller -> callee: functions)")
for (f, g), syms in sorted(edges.items()):
    up = "  UP" if rk(g) > rk(f) else ""
    print("  %-12s -> %-12s %3d%s" % (f, g, len(syms), up))
adj = {f: sorted(g for (a, g) in edges if a == f) for f in files}
# Tarjan SCCs
idx, low, on, st, sccs, n = {}, {}, set(), [], [], [0]
def visit(v):
    idx[v] = low[v] = n[0]; n[0] += 1; st.append(v); on.add(v)
    for w in adj[v]:
        if w not in idx:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        c = []
        while True:
            w = st.pop(); on.discard(w); c.append(w)
            if w == v:
                break
        sccs.append(sorted(c))
for v in files:
    if v not in idx:
        visit(v)
big = [c for c in sccs if len(c) > 1]
mutual = sorted((a, b) for (a, b) in edges if a < b and (b, a) in edges)
# elementary cycles (each counted once, from its smallest file), capped
cap, count = 1000000, [0]
order = {f: i for i, f in enumerate(files)}
def cycles(start, v, seen):
    for w in adj[v]:
        if count[0] >= cap:
            return
        if w == start:
            count[0] += 1
        elif order[w] > order[start] and w not in seen:
            seen.add(w); cycles(start, w, seen); seen.discard(w)
for s in files:
    cycles(s, s, {s})
upcalls = [(f, g, s) for (f, g), syms in edges.items() if rk(g) > rk(f) for s in syms]
print("files:", len(files))
print("edges:", len(edges), " calls (distinct caller-function pairs):",
      sum(len(v) for v in edges.values()))
print("cycles: %d strongly connected component(s) of more than one file %s" %
      (len(big), " ".join("[" + " ".join(c) + "]" for c in big)))
print("        %d mutual pair(s): %s" % (len(mutual), " ".join("%s<->%s" % m for m in mutual)))
print("        %s elementary cycle(s)" % (str(count[0]) + ("+" if count[0] >= cap else "")))
print("back-up calls: %d in %d edge(s)" % (len(upcalls), len({(f, g) for f, g, _ in upcalls})))
for f, g, s in sorted(upcalls):
    print("  %-12s -> %-12s %s" % (f, g, s))
'
