/* The runtime version query: what the library was built from, whatever
 * header its caller saw. */
#include "kvwire.h"

#define KVW_STR_(x) #x
#define KVW_STR(x) KVW_STR_(x)

unsigned kvw_version(void)
{
    return KVW_VERSION;
}

const char *kvw_version_string(void)
{
    return KVW_STR(KVW_VERSION_MAJOR) "." KVW_STR(KVW_VERSION_MINOR) "." KVW_STR(KVW_VERSION_PATCH);
}
