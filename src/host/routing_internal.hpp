// Layout of routing_metadata's workspace, shared with token rounding, which reads the bit matrix
// the metadata pass leaves behind (bit (e, t) set <=> token t routed to expert e).
#pragma once

#include <cstddef>
#include <cstdint>

#include "host/check.hpp"

namespace machmoe::detail {

inline size_t align256(size_t v) { return (v + 255) / 256 * 256; }

// [bits E x W u32 | done counter u32 | duplicate flag u32 | pad] [word prefix E x W i32]
// [totals E i32] [tile flags W i32]
// General path: the bits and the two flags are zeroed by one memset at the start of the call.
// Tiled top-K path: no memset; the prefix region holds the tile counts [tiles, E] (tiles <= W) and
// the tile flags region one duplicate flag per tile. Either way the bits are all written.
struct MetadataWorkspace {
  size_t bits_bytes, counter_offset, prefix_offset, total_offset, tile_flag_offset, bytes;
  MetadataWorkspace(int64_t T, int64_t E) {
    const size_t W = static_cast<size_t>(ceil_div(T, 32));
    const size_t words = static_cast<size_t>(E) * W;
    bits_bytes = words * 4;
    counter_offset = bits_bytes;
    prefix_offset = align256(counter_offset + 8);
    total_offset = prefix_offset + align256(words * 4);
    tile_flag_offset = total_offset + align256(static_cast<size_t>(E) * 4);
    bytes = tile_flag_offset + align256(W * 4);
  }
};

}  // namespace machmoe::detail
