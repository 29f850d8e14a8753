# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.plugins (upstream sglang's plugin framework,
python/sglang/srt/plugins/__init__.py; not in the pinned snapshot, which
holds only the disaggregation package, and the real module imports
sglang's hook registry and platform plugins). The contract kvwire relies
on, and nothing else: load_plugins() discovers the entry points of group
"sglang.srt.plugins" through importlib.metadata (installed distributions),
skips those not named in $SGLANG_PLUGINS when it is set (comma-separated),
loads each and calls it with no arguments, logging and going on past one
that fails; once per process. sglang calls it in `python -m
sglang.launch_server` before it parses the arguments and at the start of
every scheduler process. (Upstream then applies its HookRegistry's hooks;
kvwire registers none.)"""
import logging
from importlib.metadata import entry_points

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)
GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
_plugins_loaded = False


def load_plugins_by_group(group):
    allowed = envs.SGLANG_PLUGINS.get()
    allowed_set = {x.strip() for x in allowed.split(",") if x.strip()} if allowed else None
    plugins = {}
    for ep in entry_points(group=group):
        if allowed_set is not None and ep.name not in allowed_set:
            continue
        try:
            plugins[ep.name] = (ep.load(), ep.dist.name if ep.dist else None)
        except Exception:
            logger.exception("Failed to load plugin %s from group %s", ep.name, group)
    return plugins


def load_plugins():
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name, (func, _dist) in load_plugins_by_group(GENERAL_PLUGINS_GROUP).items():
        try:
            func()
        except Exception:
            logger.exception("Failed to execute general plugin: %s", name)
