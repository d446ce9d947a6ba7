// The dropout words of [s, b, h] rows on the CPU, for the hidden-dropout op (dropout_add.cpp): row r of the
// slab is token r / b, sample r % b.
#pragma once

#include <cstdint>

#include "philox.h"
#include "philox_cpu.h"

namespace msp {

struct RowIndex {
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t b;
};

// Words of local features 0..h-1 of one row; buf holds h + 8 words. Returns the row's first word.
inline const uint32_t* draw_row_words(const DropoutParams& d, int64_t pos, int64_t sample, int64_t h, uint32_t* buf) {
  const int64_t first = d.feature_offset / 4, groups = (d.feature_offset + h + 3) / 4 - first;
  const uint64_t s = static_cast<uint64_t>(sample);
  philox_groups(d, static_cast<uint32_t>(first), groups, static_cast<uint32_t>(pos), static_cast<uint32_t>(s),
                static_cast<uint32_t>(s >> 32), buf);
  return buf + d.feature_offset % 4;
}

// The words of row `row`, or nullptr when p == 0 (keep everything, skip Philox).
inline const uint32_t* row_words(const DropoutParams& d, const RowIndex& idx, int64_t row, int64_t h, uint32_t* buf) {
  if (d.threshold == 0) return nullptr;
  int64_t pos = idx.positions[row / idx.b], sample = idx.samples[row % idx.b];
  return draw_row_words(d, pos, sample, h, buf);
}

}  // namespace msp
