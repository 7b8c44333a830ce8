// Layout of routing_metadata's workspace, shared with token rounding, which reads the bit matrix
// the metadata pass leaves behind (bit (e, t) set <=> token t routed to expert e).
#pragma once

#include <cstddef>
#include <cstdint>

#include "host/check.hpp"

namespace machmoe::detail {

inline size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// [bits E x W u32 | done counter u32 | duplicate flag u32 | pad] [word prefix E x W i32] [totals E i32]
// The bits and the two flags are zeroed by one memset at the start of every call.
struct MetadataWorkspace {
  size_t bits_bytes, counter_offset, prefix_offset, total_offset, bytes;
  MetadataWorkspace(int64_t T, int64_t E) {
    const size_t words = static_cast<size_t>(E) * static_cast<size_t>(ceil_div(T, 32));
    bits_bytes = words * 4;
    counter_offset = bits_bytes;
    prefix_offset = align256(counter_offset + 8);
    total_offset = prefix_offset + align256(words * 4);
    bytes = total_offset + align256(static_cast<size_t>(E) * 4);
  }
};

}  // namespace machmoe::detail
