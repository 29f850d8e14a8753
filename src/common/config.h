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

#endif
