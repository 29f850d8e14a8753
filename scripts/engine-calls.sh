#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Who calls whom inside src/engine/: for each object file of the engine, the
# other engine files whose functions (kvw_/kvw__ symbols) it calls, read
# with nm from the built objects (defined vs undefined symbols, each
# undefined one mapped to the engine file that defines it). Prints the
# file-to-file edges with their call counts (distinct functions), the
# cycles (strongly connected components, mutual pairs, elementary cycles),
# and the calls that go "up" against the intended order:
#
#   0  wake, txq, reqtab, request, landing
#                                 (thread wake-ups; one QP's send queue; the
#                                  request table; a request's life; decode's
#                                  landing buffer for head slicing)
#   1  peer                        (connections, their QPs and slots)
#   2  part, poller, rejoin; stager, stage_send, stage_recv
#                                  (the data path: a sender's parts, the
#                                  poller's pass and a failed lane's way
#                                  back, the staging thread and its two
#                                  halves)
#   3  sender, receiver, ctl_frame, ctl_prefill, ctl_decode, ctl_rejoin
#                                  (each role's logic)
#   4  control                     (the control thread)
#   5  engine, outputs, symver     (create, destroy, the public API glue: the
#                                  sized outputs, the older symbol versions)
#
# A file may call files of its own rank or lower; a call to a higher rank is
# a back-up call. Files not listed above get rank 3.
#
# Usage: scripts/engine-calls.sh [OBJDIR]   (default build/obj/src/engine;
# run `make all` first). Needs nm and python3.
set -eu
dir=${1:-build/obj/src/engine}
[ -d "$dir" ] || { echo "engine-calls: no $dir (run make all first)" >&2; exit 1; }
for o in "$dir"/*.o; do
    f=$(basename "$o" .o)
    nm "$o" | awk -v f="$f" '$2 ~ /^[TDBR]$/ && $3 ~ /^kvw_/ { print "D", f, $3 }'
    nm -u "$o" | awk -v f="$f" '$2 ~ /^kvw_/ { print "U", f, $2 }'
done | python3 -c '
import sys, itertools
rank = {}
for r, names in enumerate([["wake", "txq", "reqtab", "request", "landing"], ["peer"],
                           ["part", "poller", "rejoin", "stager", "stage_send",
                            "stage_recv"],
                           ["sender", "receiver", "ctl_frame", "ctl_prefill", "ctl_decode",
                            "ctl_rejoin"],
                           ["control"], ["engine", "outputs", "symver"]]):
    for n in names:
        rank[n] = r
def rk(f):
    return rank.get(f, 3)
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
