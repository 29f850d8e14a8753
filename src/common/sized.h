#ifndef KVW_COMMON_SIZED_H
#define KVW_COMMON_SIZED_H

/* Size-prefixed public structs (include/kvwire.h "sized structs"): the
 * library reads the fields a caller's struct_size covers and keeps its
 * defaults for the rest. */

#include <stddef.h>

#include "kvwire.h"

/* The smallest struct_size accepted for each struct: up to its last field
 * without a default. Every config field has one; an engine needs its whole
 * first layout (a layout: classic regions or groups); a bootstrap service
 * its address. */
#define KVW__CONFIG_MIN_SIZE (offsetof(kvw_config_t, struct_size) + sizeof(size_t))
#define KVW__ENGINE_PARAMS_MIN_SIZE                                                                \
    (offsetof(kvw_engine_params_t, groups) + sizeof(const kvw_group_t *))
#define KVW__BOOTSTRAP_PARAMS_MIN_SIZE                                                             \
    (offsetof(kvw_bootstrap_params_t, bind_addr) + sizeof(const char *))

/* Read the caller's struct at src (struct_size first) into dst, which holds
 * the library's defaults and is known bytes long: the first
 * min(struct_size, known) bytes are copied, and dst's struct_size is set to
 * known. KVW_ERR_INVALID, logged with what (e.g. "engine params") and
 * dst untouched, when struct_size is below min_size, or above known with a
 * non-zero byte past known. */
kvw_status_t kvw__sized_read(const char *what, void *dst, size_t known, size_t min_size,
                             const void *src);

/* The caller's config (NULL: kvw_config_init()'s defaults and environment)
 * as this library's full kvw_config_t; fields the caller's struct_size does
 * not cover take kvw_config_init()'s values. KVW_ERR_INVALID (logged) for a
 * bad struct_size or, with cfg NULL, a bad KVW_* variable. */
kvw_status_t kvw__config_read(const kvw_config_t *cfg, kvw_config_t *out);

#endif
