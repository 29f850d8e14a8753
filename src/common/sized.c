/* SPDX-License-Identifier: Apache-2.0 */
/* Size-prefixed public structs: what an older or newer caller's struct
 * means to this library. */
#include "common/sized.h"
#include "common/config.h"
#include "common/log.h"

#include <string.h>

kvw_status_t kvw__sized_read(const char *what, void *dst, size_t known, size_t min_size,
                             const void *src)
{
    size_t size;
    memcpy(&size, src, sizeof(size));
    if (size < min_size) {
        KVW_ERROR("%s: struct_size %zu is below %zu, the smallest kvwire %s accepts: set it "
                  "with the struct's init function or to its sizeof",
                  what, size, min_size, kvw_version_string());
        return KVW_ERR_INVALID;
    }
    const unsigned char *tail = (const unsigned char *)src;
    for (size_t i = known; i < size; i++) {
        if (tail[i]) {
            KVW_ERROR("%s: struct_size %zu is larger than the %zu bytes kvwire %s knows, and a "
                      "field past them (byte %zu) is set: the caller was built against a newer "
                      "kvwire.h than this library",
                      what, size, known, kvw_version_string(), i);
            return KVW_ERR_INVALID;
        }
    }
    memcpy(dst, src, size < known ? size : known);
    memcpy(dst, &known, sizeof(known));
    return KVW_OK;
}

kvw_status_t kvw__config_read(const kvw_config_t *cfg, kvw_config_t *out)
{
    kvw__config_warn_unknown_env_once();
    if (!cfg)
        return kvw_config_init(out); /* logged */
    size_t size;
    memcpy(&size, cfg, sizeof(size));
    kvw_config_t defaults;
    memset(&defaults, 0, sizeof(defaults));
    /* An older caller's struct: the fields it lacks come from the
     * environment, and a bad variable there is refused (logged), not
     * replaced by its default. */
    if (size < sizeof(defaults) && size >= KVW__CONFIG_MIN_SIZE) {
        kvw_status_t st = kvw_config_init(&defaults);
        if (st)
            return st;
    }
    kvw_status_t st =
        kvw__sized_read("config", &defaults, sizeof(defaults), KVW__CONFIG_MIN_SIZE, cfg);
    if (st == KVW_OK)
        *out = defaults;
    return st;
}
