/* SPDX-License-Identifier: Apache-2.0 */
#include "kvwire.h"

const char *kvw_strerror(kvw_status_t status)
{
    switch (status) {
#define KVW_STATUS_TEXT(name, value, msg)                                                          \
    case KVW_##name:                                                                               \
        return msg;
        KVW_STATUS_MAP(KVW_STATUS_TEXT)
#undef KVW_STATUS_TEXT
    }
    return "unknown status";
}

const char *kvw_status_name(kvw_status_t status)
{
    switch (status) {
#define KVW_STATUS_NAME(name, value, msg)                                                          \
    case KVW_##name:                                                                               \
        return "KVW_" #name;
        KVW_STATUS_MAP(KVW_STATUS_NAME)
#undef KVW_STATUS_NAME
    }
    return "KVW_UNKNOWN";
}

const char *kvw_poll_name(kvw_poll_t state)
{
    switch (state) {
    case KVW_POLL_FAILED:
        return "Failed";
    case KVW_POLL_BOOTSTRAPPING:
        return "Bootstrapping";
    case KVW_POLL_WAITING_FOR_INPUT:
        return "WaitingForInput";
    case KVW_POLL_TRANSFERRING:
        return "Transferring";
    case KVW_POLL_SUCCESS:
        return "Success";
    }
    return "Unknown";
}
