#ifndef KVW_COMMON_CONFIG_H
#define KVW_COMMON_CONFIG_H

#include "kvwire.h"

/* Range and cross-field checks on a config the caller may have edited. */
kvw_status_t kvw__config_validate(const kvw_config_t *cfg);

#endif
