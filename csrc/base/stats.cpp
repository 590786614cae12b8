#include "base/stats.h"

namespace torchshm {

std::atomic<int64_t> counters[kCounterCount];

const char* const kCounterNames[kCounterCount] = {
    "arrays_shared",           "bytes_copied",       "arrays_resent",
    "arrays_inline",           "arrays_received",    "segments_created",
    "segments_attached",       "segments_reused",    "mappings_reused",
    "tickets_unavailable",     "allocations_shared", "allocations_fallback",
    "fork_waits_timed_out",    "snapshots_resent",   "arrays_copied_on_receive",
    "private_mappings_walked", "storages_moved",     "storages_sent",
    "pool_gave_way",           "storages_copied",    "segments_pinned_at_fork",
    "bytes_one_copy",
};

}  // namespace torchshm
