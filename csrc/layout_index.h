// Index maps of the layout ops, torch-free so the CPU (int64) and CUDA (uint32) kernels share them.
#pragma once

#include <stdint.h>

#include "philox.h"  // MSP_HD

namespace msp {

// Zigzag: the sequence is cut into 2p chunks and rank r holds chunks r and 2p-1-r, so that every
// rank gets the same amount of causal-attention work. Output chunk `slot` is input chunk
// zigzag_source(slot): forward slot 2r <- r, slot 2r+1 <- 2p-1-r; inverse undoes it.
template <typename I>
MSP_HD I zigzag_source(I slot, I p, bool inverse) {
  if (!inverse) return (slot % 2 == 0) ? slot / 2 : 2 * p - 1 - slot / 2;
  return slot < p ? 2 * slot : 2 * (2 * p - 1 - slot) + 1;
}

// Block transpose [a, b, run] -> [b, a, run]: output run o = (j, i) reads input run i * b + j.
template <typename I>
MSP_HD I transpose_source(I out_run, I a, I b) {
  I j = out_run / a, i = out_run - j * a;
  return i * b + j;
}

}  // namespace msp
