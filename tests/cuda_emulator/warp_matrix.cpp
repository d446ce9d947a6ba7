// The emulator's model of the warp-level matrix operations of csrc/cuda/warp_mma.cuh, from the PTX
// ISA (the sections named below): mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32,
// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 and cp.async{.ca,.cg}.shared.global with
// commit_group / wait_group. Each lane publishes its registers (or row address) and computes its own
// result from the whole warp's, so a fragment held by the wrong lane or register gives a wrong
// result here as on the GPU. tests/test_cuda_emulated.py checks these against plain matrix products
// built from the PTX ISA's formulas (written again there, in Python).
#include <string.h>

#include <deque>
#include <vector>

#include "emulator_internal.h"
#include "msp_cuda_emulator.h"

namespace msp_emu {

namespace {

float element(int kind, uint16_t bits) {
  return kind == 0 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

uint16_t half_of(uint32_t reg, int high) { return static_cast<uint16_t>(high ? reg >> 16 : reg & 0xFFFFu); }

// PTX ISA 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16 with floating point type" (figures "MMA
// .m16n8k16 fragment layout for matrix A / matrix B / accumulator matrix C/D"), with
// groupID = lane >> 2 and threadID_in_group = lane % 4. Element i of a fragment is half i % 2 of
// register i / 2 (A, B: two 16-bit elements per register, the lower index in the low half).
//   A (16 x 16), a0..a7: row = groupID for 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//                        col = threadID_in_group * 2 + (i & 1), + 8 for i >= 4.
//   B (16 x 8),  b0..b3: row = threadID_in_group * 2 + (i & 1), + 8 for i >= 2; col = groupID.
//   C, D (16 x 8), c0..c3 (fp32): row = groupID for i < 2, groupID + 8 otherwise;
//                        col = threadID_in_group * 2 + (i & 1).
int a_row(int lane, int i) { return (lane >> 2) + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8); }
int a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4 ? 8 : 0); }
int b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2 ? 8 : 0); }
int b_col(int lane, int) { return lane >> 2; }
int c_row(int lane, int i) { return (lane >> 2) + (i < 2 ? 0 : 8); }
int c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

bool in_dynamic_shared(const void* p, size_t bytes) {
  const unsigned char* begin = dynamic_shared_begin();
  const unsigned char* q = static_cast<const unsigned char*>(p);
  return begin != nullptr && q >= begin && q + bytes <= begin + dynamic_shared_bytes();
}

}  // namespace

void mma_m16n8k16(int kind, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if (kind != 0 && kind != 1) fail("mma: unknown element type");
  LaneSlot mine{kind == 0 ? kMmaBf16 : kMmaF16, {a[0], a[1], a[2], a[3], b[0], b[1]}, nullptr};
  const LaneSlot* warp = exchange(mine, "mma.sync: only full warps are emulated");
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i)
      A[a_row(lane, i)][a_col(lane, i)] = element(kind, half_of(warp[lane].words[i / 2], i % 2));
    for (int i = 0; i < 4; ++i)
      B[b_row(lane, i)][b_col(lane, i)] = element(kind, half_of(warp[lane].words[4 + i / 2], i % 2));
  }
  const int lane = static_cast<int>(context.lane);
  for (int i = 0; i < 4; ++i) {
    // The products of 16-bit values are exact in fp32; their sum is rounded once (the PTX ISA leaves
    // the order and intermediate precision of the accumulation open: results are compared with tolerances).
    double sum = d[i];
    for (int k = 0; k < 16; ++k) sum += double(A[c_row(lane, i)][k]) * double(B[k][c_col(lane, i)]);
    d[i] = static_cast<float>(sum);
  }
}

// PTX ISA, "Warp-level matrix load instruction: ldmatrix": lanes 8j..8j+7 hold the row addresses of matrix j (each row
// 16 bytes, 16-byte aligned, in shared memory; lanes past 8 * count give none). Register j of lane l gets elements (row
// l / 4, columns 2 (l % 4), 2 (l % 4) + 1) of matrix j; with .trans the matrix is read column-major: elements (rows 2
// (l % 4), 2 (l % 4) + 1, column l / 4).
void ldmatrix(int count, bool trans, uint32_t* regs, const void* row) {
  if (count != 1 && count != 2 && count != 4) fail("ldmatrix: .x1, .x2 or .x4");
  const unsigned lane = context.lane;
  const bool gives_row = lane < 8u * count;
  if (gives_row && (reinterpret_cast<uintptr_t>(row) & 15) != 0) fail("ldmatrix: a row address not 16-byte aligned");
  if (gives_row && !in_dynamic_shared(row, 16))
    fail("ldmatrix: a row outside the block's dynamic shared memory (the kernels use only it)");
  LaneSlot mine{kLdmatrix + 8 * count + (trans ? 1 : 0), {}, row};
  const LaneSlot* warp = exchange(mine, "ldmatrix: only full warps are emulated");
  for (int j = 0; j < count; ++j) {
    const int r0 = trans ? 2 * (lane % 4) : lane / 4, c0 = trans ? lane / 4 : 2 * (lane % 4);
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int r = trans ? r0 + h : r0, c = trans ? c0 : c0 + h;
      memcpy(&e[h], static_cast<const unsigned char*>(warp[8 * j + r].address) + 2 * c, 2);
    }
    regs[j] = uint32_t(e[0]) | (uint32_t(e[1]) << 16);
  }
}

// ---- cp.async (PTX ISA, "Data Movement and Conversion Instructions: cp.async", cp.async.commit_group,
// cp.async.wait_group): copies are performed when a wait_group no longer leaves their
// group pending, so a read of the destination before the wait sees what was there before. The source
// is read (bounds-checked, and counted in traffic builds) at issue.

namespace {

struct AsyncCopy {
  unsigned char* dst;
  unsigned char data[16];
  int bytes;
};

struct AsyncCopies {
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> groups;  // committed, oldest first
};

thread_local AsyncCopies copies;

void perform(const std::vector<AsyncCopy>& group) {
  for (const AsyncCopy& c : group) memcpy(c.dst, c.data, c.bytes);
}

}  // namespace

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  if (bytes != 4 && bytes != 8 && bytes != 16) fail("cp.async: 4, 8 or 16 bytes");
  if (src_bytes < 0 || src_bytes > bytes) fail("cp.async: src-size over cp-size");
  if ((reinterpret_cast<uintptr_t>(dst) % bytes) != 0 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % bytes))
    fail("cp.async: an address not aligned to the copy size");
  if (!in_dynamic_shared(dst, bytes)) fail("cp.async: a destination outside the block's dynamic shared memory");
  AsyncCopy c{static_cast<unsigned char*>(dst), {}, bytes};
  if (src_bytes > 0) {
    memcpy(c.data, src, src_bytes);
    count(reinterpret_cast<uintptr_t>(src), src_bytes, false);
  }
  copies.uncommitted.push_back(c);
}

void cp_async_commit() {
  copies.groups.push_back(std::move(copies.uncommitted));
  copies.uncommitted.clear();
}

void cp_async_wait(int pending) {
  while (copies.groups.size() > static_cast<size_t>(pending)) {
    perform(copies.groups.front());
    copies.groups.pop_front();
  }
}

void async_copies_reset() {
  copies.uncommitted.clear();
  copies.groups.clear();
}

void async_copies_check_drained() {  // (an empty group, committed with nothing issued, completes at once)
  bool pending = !copies.uncommitted.empty();
  for (const std::vector<AsyncCopy>& group : copies.groups) pending = pending || !group.empty();
  if (pending) fail("cp.async copies still pending when the thread left the kernel (a missing cp.async.wait_group)");
}

}  // namespace msp_emu
