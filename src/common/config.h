/* SPDX-License-Identifier: Apache-2.0 */
#ifndef KVW_COMMON_CONFIG_H
#define KVW_COMMON_CONFIG_H

#include <stdbool.h>

#include "kvwire.h"

/* Range and cross-field checks on a config the caller may have edited. */
kvw_status_t kvw__config_validate(const kvw_config_t *cfg);
/* gpu_path as a forced kvw_mem_path_t (1 dmabuf, 2 peermem, 3 staging),
 * -1 for auto ("" or "auto"), -2 if it names none of them. */
int kvw__config_gpu_path(const kvw_config_t *cfg);

/* KVW_DEVICES (cfg.devices): the device names of an engine's rails,
 * comma-separated, split into names (at most KVW_CONFIG_MAX_DEVICES, each
 * shorter than KVW_CONFIG_DEVICE_NAME, none twice). The count (0: none
 * named, or "near"), or -1 (logged) when the list is malformed. */
enum { KVW_CONFIG_MAX_DEVICES = 4, KVW_CONFIG_DEVICE_NAME = 64 };
int kvw__config_devices(const char *list, char names[][KVW_CONFIG_DEVICE_NAME]);

/* KVW_DEVICES=near: no names, but the device picked by affinity and every
 * other one as near the KV regions' GPU (verbs/topo.h,
 * kvw__topo_pick_near); kvw__config_devices gives 0 names for it and
 * refuses "near" inside a list. */
#define KVW_CONFIG_DEVICES_NEAR "near"
bool kvw__config_devices_near(const char *list);

/* KVW_LOG_LEVEL's names: error, warn (warning), info, debug (trace,
 * verbose), any case. The kvw_log_level_t, or -1 for any other text. */
int kvw__config_log_level(const char *name);

/* Warns once per variable about each KVW_* name in envp that is neither the
 * library's nor the tests' (docs/configuration.md), naming the nearest
 * known one; the count warned. The _once form does it for the process's
 * environment the first time it is called (kvw_config_init, engine and
 * bootstrap creation). */
int kvw__config_warn_unknown_env(char *const *envp);
void kvw__config_warn_unknown_env_once(void);

/* "KVW_SQ_DEPTH=1024 KVW_LOG_LEVEL=info" for the library's variables set
 * in the environment (the cluster key not shown), "none" if none. */
void kvw__config_env_summary(char *buf, size_t size);

#endif
