# SPDX-License-Identifier: Apache-2.0
"""kvwire engines' metrics for prometheus_client (Debian:
python3-prometheus-client; imported only here, so `import kvwire` does not
need it).

The library formats each engine's metrics in the OpenMetrics text format
(Engine.metrics_text, kvw_engine_metrics_text); this module parses that
text with prometheus_client's own parser, so the families, labels and
types are the library's (docs/operations.md, "Metrics"):

    import kvwire.metrics
    kvwire.metrics.register(engine)      # prometheus_client.REGISTRY

Two ways to reach a scrape:
  * one process serves /metrics from its registry (start_http_server,
    the default REGISTRY): KvwireCollector, a custom collector, reads
    every registered engine at each scrape;
  * prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set, as
    sglang sets it with --enable-metrics): /metrics is served by another
    process from files, which a custom collector never reaches. register()
    then starts a mirror thread that writes the engines' values into
    prometheus_client metrics every `interval` seconds (counters by their
    increase, gauges set, histograms bucket by bucket), and once more when
    the engine is unregistered.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

__all__ = ["KvwireCollector", "register", "unregister", "families"]


def families(engine: Any) -> List[Metric]:
    """The engine's metric families, parsed from its OpenMetrics text."""
    return list(text_string_to_metric_families(engine.metrics_text()))


class KvwireCollector:
    """A prometheus_client collector of several engines' metrics: each
    scrape reads every live engine added (weak references: a closed or
    collected engine drops out) and merges their families (the samples of
    different engines differ in their role and rank labels)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: List[weakref.ReferenceType] = []

    def add(self, engine: Any) -> None:
        with self._lock:
            if engine not in self.engines():
                self._engines.append(weakref.ref(engine))

    def remove(self, engine: Any) -> None:
        with self._lock:
            self._engines = [r for r in self._engines if r() is not None and r() is not engine]

    def engines(self) -> List[Any]:
        return [e for e in (r() for r in self._engines) if e is not None and not e.closed]

    def collect(self) -> Iterator[Metric]:
        merged: Dict[str, Metric] = {}
        for engine in self.engines():
            try:
                fams = families(engine)
            except Exception:  # closed meanwhile: it has no metrics any more
                continue
            for fam in fams:
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()

    def describe(self) -> List[Metric]:
        # Nothing up front: registering must not scrape (and the names are
        # the library's, which no other collector of ours uses).
        return []


class _Mirror:
    """Multiprocess mode: the engines' values copied into prometheus_client
    metrics (written to PROMETHEUS_MULTIPROC_DIR) by a thread."""

    def __init__(self, collector: KvwireCollector, interval: float) -> None:
        self.collector = collector
        self.interval = interval
        self.metrics: Dict[str, Any] = {}
        self.last: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvwire-metrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sync()

    def sync(self, engines: Optional[List[Any]] = None) -> None:
        with self.lock:
            for engine in engines if engines is not None else self.collector.engines():
                try:
                    fams = families(engine)
                except Exception:
                    continue
                for fam in fams:
                    self._copy(fam)

    def _metric(self, fam: Metric, kind: str, labelnames: List[str]) -> Any:
        import prometheus_client as pc

        m = self.metrics.get(fam.name)
        if m is None:
            if kind == "counter":
                m = pc.Counter(fam.name, fam.documentation, labelnames, registry=None)
            elif kind == "histogram":
                bounds = [float(s.labels["le"]) for s in fam.samples
                          if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
                m = pc.Histogram(fam.name, fam.documentation, labelnames, registry=None,
                                 buckets=sorted(set(bounds)))
            else:  # gauge, info: the value as it is now
                name = fam.name + "_info" if fam.type == "info" else fam.name
                m = pc.Gauge(name, fam.documentation, labelnames, registry=None,
                             multiprocess_mode="livesum")
            self.metrics[fam.name] = m
        return m

    def _increase(self, key: Any, value: float) -> float:
        before = self.last.get(key, 0.0)
        self.last[key] = value
        return value - before if value > before else 0.0

    def _copy(self, fam: Metric) -> None:
        kind = fam.type if fam.type in ("counter", "histogram") else "gauge"
        if kind == "histogram":
            self._copy_histogram(fam)
            return
        for s in fam.samples:
            if kind == "counter" and not s.name.endswith("_total"):
                continue  # _created
            names = sorted(s.labels)
            child = self._metric(fam, kind, names).labels(**s.labels)
            if kind == "counter":
                child.inc(self._increase((s.name, tuple(sorted(s.labels.items()))), s.value))
            else:
                child.set(s.value)

    def _copy_histogram(self, fam: Metric) -> None:
        groups: Dict[Tuple[Tuple[str, str], ...], Dict[str, Any]] = {}
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            g = groups.setdefault(tuple(sorted(labels.items())), {"buckets": [], "sum": 0.0})
            if s.name.endswith("_bucket"):
                g["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_sum"):
                g["sum"] = s.value
        for key, g in groups.items():
            labels = dict(key)
            child = self._metric(fam, "histogram", sorted(labels)).labels(**labels)
            below = 0.0
            # prometheus_client keeps each bucket's own count (observe adds
            # to one), the text's are cumulative: copy the increases.
            for i, (le, cumulative) in enumerate(sorted(g["buckets"])):
                child._buckets[i].inc(self._increase((fam.name, key, le), cumulative - below))
                below = cumulative
            child._sum.inc(self._increase((fam.name, key, "sum"), g["sum"]))


_state_lock = threading.Lock()
_collectors: Dict[int, KvwireCollector] = {}
_mirror: Optional[_Mirror] = None


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or
                os.environ.get("prometheus_multiproc_dir"))


def register(engine: Any, registry: Any = None, interval: float = 1.0) -> KvwireCollector:
    """Export engine's metrics through prometheus_client: from `registry`
    (None: prometheus_client.REGISTRY) by one KvwireCollector per registry,
    registered once, or, in multiprocess mode, by the mirror thread (every
    `interval` seconds). Returns the collector. Thread-safe; registering
    the same engine twice is harmless."""
    global _mirror
    import prometheus_client

    reg = registry if registry is not None else prometheus_client.REGISTRY
    with _state_lock:
        if _multiprocess() and registry is None:
            if _mirror is None:
                _mirror = _Mirror(KvwireCollector(), interval)
            _mirror.collector.add(engine)
            return _mirror.collector
        collector = _collectors.get(id(reg))
        if collector is None:
            collector = _collectors[id(reg)] = KvwireCollector()
            reg.register(collector)
        collector.add(engine)
        return collector


def unregister(engine: Any) -> None:
    """Stop exporting engine (call before closing it: in multiprocess mode
    its last values are written once more first)."""
    with _state_lock:
        if _mirror is not None and engine in _mirror.collector.engines():
            _mirror.sync([engine])
            _mirror.collector.remove(engine)
        for collector in _collectors.values():
            collector.remove(engine)
