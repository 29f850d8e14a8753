/* Bootstrap directory: prefill engines publish their control endpoint under
 * their rank; decode engines look it up. No fixed ports anywhere. */
#ifndef KVW_CTRL_BOOTSTRAP_H
#define KVW_CTRL_BOOTSTRAP_H

#include "ctrl/zsock.h"

/* Register rank -> endpoint at bootstrap_addr ("host:port"); blocks at most
 * timeout_ms. */
kvw_status_t kvw__bootstrap_register(void *zctx, const char *bootstrap_addr, uint32_t rank,
                                     const char *endpoint, uint32_t timeout_ms);

#endif
