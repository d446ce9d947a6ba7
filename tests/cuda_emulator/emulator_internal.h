// What the emulator's execution engine (emulator.cpp) shares with its model of the warp-level
// matrix operations (warp_matrix.cpp): the warp-collective exchange, failure reports, the live
// block's dynamic shared memory, each thread's pending cp.async groups, traffic counting.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "msp_cuda_emulator.h"

namespace msp_emu {

// One lane's part in a warp-collective operation.
struct LaneSlot {
  int op;               // which operation (every lane of the warp must be in the same one)
  uint32_t words[10];   // its registers (a shuffle's value; an mma's A and B fragments)
  const void* address;  // an ldmatrix row address
  unsigned int seq;     // set by exchange: the lane's count of collectives, this one included
};

enum CollectiveOp { kShuffle = 1, kMmaBf16 = 2, kMmaF16 = 3, kLdmatrix = 4 };

[[noreturn]] void fail(const char* what);

// Publishes `mine` as this lane's slot of the warp's next collective operation and returns the
// warp's 32 slots once every lane has published (one warp barrier; the slots are valid until this
// lane's next collective). Fails on a lane that exited before it, a partial warp or lanes in
// different operations.
const LaneSlot* exchange(const LaneSlot& mine, const char* what);

// The live block's dynamic shared memory (begin, bytes).
unsigned char* dynamic_shared_begin();
size_t dynamic_shared_bytes();

// Each thread's cp.async groups: dropped at a block's start; still pending when the thread leaves
// the kernel is an error (the data would land after the thread no longer waits for it).
void async_copies_reset();
void async_copies_check_drained();

// Counts a global-memory access (build mode "traffic"; a no-op while no region is watched).
void count(uintptr_t addr, uintptr_t size, bool store);

}  // namespace msp_emu
