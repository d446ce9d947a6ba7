// The SIMT flash_attention kernels: fp32 math from shared memory, no tensor cores. They run fp32
// inputs (exact to the reference's tolerances: no tf32), and bf16/fp16 on GPUs before sm_80; the
// tensor-core kernels are flash_attention_fwd_mma.cu / _bwd_mma.cu (flash_attention.cu picks).
//
// Design (correctness first; fp32 math, inputs of any strides, d <= kMaxD):
//   Forward: one block of 4 warps per (query tile of kFwdRows, query head, batch). The tile's Q
//   rows are staged in shared memory as fp32; key/value tiles of kKeyTile keys follow one another
//   through shared memory (K rows padded to kMaxD + 1 floats, so lane j reading key j's row is free
//   of bank conflicts). Each warp owns kFwdRows / 4 query rows; for a row, lane j scores key j
//   (a dot product over d against the broadcast Q row), masks it (position, segment), and the
//   warp updates the online softmax (max and sum by xor shuffles; running m, l per row in
//   registers). The dropout word of element (sample, head, query, key) is drawn by the lane itself
//   (one Philox call per element, philox.h), applied to the normalised probability; the
//   probabilities go through shared memory to the P V product, where lane c accumulates output
//   columns c, c + 32, ... in registers. A key tile whose smallest position exceeds every query
//   position of the block is skipped (the causal upper triangle). out is written [s, b, n, d].
//   Backward (three launches, no atomics, deterministic):
//     1. D = rowsum(dO * O), one warp per row, into the fp32 scratch;
//     2. dK, dV: one block per (key tile of kBwdKeys, key/value head, batch), each warp owns
//        kBwdKeys / 4 keys and sweeps every query head of the GQA group and every query tile of
//        32 (staged in shared memory with dO, lse, D): lane i recomputes P = exp(S - lse) for query
//        i, dP = dO . V, the same dropout word, dS = P * (dP_d - D); dV += P_d^T dO and
//        dK += dS^T Q accumulate in registers (the sum over the group's query heads included);
//     3. dQ: like the forward (query tiles of kDqRows), lane j for key j, dQ += dS K in registers.
//   The shared-memory tiles stay under the 48 KiB of static shared memory at d = kMaxD; smaller
//   tiles in the backward (8 keys, 8 query rows per block) are the price of that.
#include <math.h>

#include "flash_attention.cuh"

namespace msp {
namespace cuda {
namespace flash {
namespace {

constexpr int kWarps = 4, kThreads = 32 * kWarps;
constexpr int kMaxD = static_cast<int>(kFlashMaxHeadDim), kLd = kMaxD + 1;
constexpr int kKeyTile = 32, kQueryTile = 32;
constexpr int kFwdRows = 16, kFwdRowsPerWarp = kFwdRows / kWarps;
constexpr int kBwdKeys = 8, kBwdKeysPerWarp = kBwdKeys / kWarps;
constexpr int kDqRows = 8, kDqRowsPerWarp = kDqRows / kWarps;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// dst[r][c] (row pitch ld) = src row r, column c as fp32 for r < valid, 0 for valid <= r < rows.
template <typename T>
__device__ __forceinline__ void stage_rows(float* dst, int ld, const T* src, int64_t row_stride, int64_t col_stride,
                                           int valid, int rows, int d) {
  for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x) {
    const int r = idx / d, c = idx - r * d;
    dst[r * ld + c] = r < valid ? to_f32(src[r * row_stride + c * col_stride]) : 0.0f;
  }
}

// Key positions and segments of one tile into shared memory (threads < n), kNoPosition past sk.
__device__ __forceinline__ void stage_keys(const Attn& a, int64_t bi, int64_t k0, int n, int64_t* pos, int64_t* seg) {
  if (static_cast<int>(threadIdx.x) < n) {
    const int64_t kj = k0 + threadIdx.x;
    pos[threadIdx.x] = kj < a.sk ? a.k_pos[kj] : kNoPosition;
    seg[threadIdx.x] = kj < a.sk && a.k_seg ? a.k_seg[bi * a.sk + kj] : 0;
  }
}

__device__ __forceinline__ int64_t min_of(const int64_t* v, int n) {
  int64_t m = v[0];
  for (int i = 1; i < n; ++i) m = v[i] < m ? v[i] : m;
  return m;
}

__device__ __forceinline__ int64_t max_of(const int64_t* v, int n) {
  int64_t m = v[0];
  for (int i = 1; i < n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Largest position of queries q0 .. q0 + n - 1 (clipped to sq); -1 - INT64_MAX when none.
__device__ __forceinline__ int64_t max_query_position(const Attn& a, int64_t q0, int n) {
  int64_t m = -kNoPosition - 1;
  for (int i = 0; i < n && q0 + i < a.sq; ++i) m = a.q_pos[q0 + i] > m ? a.q_pos[q0 + i] : m;
  return m;
}

__device__ __forceinline__ float dot(const float* x, const float* y, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s += x[c] * y[c];
  return s;
}

// ---- forward --------------------------------------------------------------------------------

template <typename T>
struct FwdTensors {
  const T *q, *k, *v;
  FlashStrides qs, ks, vs;
  T* out;      // [sq, b, nq, d]
  float* lse;  // [b, nq, sq]
};

template <typename T, int NV>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(Attn a, FwdTensors<T> t) {
  __shared__ float q_sh[kFwdRows][kMaxD];
  __shared__ float k_sh[kKeyTile][kLd];
  __shared__ float v_sh[kKeyTile][kMaxD];
  __shared__ float p_sh[kWarps][kFwdRowsPerWarp][kKeyTile];
  __shared__ int64_t kpos_sh[kKeyTile], kseg_sh[kKeyTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = a.d;
  const int64_t bi = blockIdx.z, h = blockIdx.y, g = h / a.rep, q0 = int64_t(blockIdx.x) * kFwdRows;
  const int rows = static_cast<int>(a.sq - q0 < kFwdRows ? a.sq - q0 : kFwdRows);
  stage_rows(&q_sh[0][0], kMaxD, t.q + bi * t.qs.b + h * t.qs.n + q0 * t.qs.s, t.qs.s, t.qs.d, rows, kFwdRows, d);
  const int64_t q_max = max_query_position(a, q0, kFwdRows);
  int64_t qpos[kFwdRowsPerWarp], qseg[kFwdRowsPerWarp];
  float m[kFwdRowsPerWarp], l[kFwdRowsPerWarp], acc[kFwdRowsPerWarp][NV];
#pragma unroll
  for (int rr = 0; rr < kFwdRowsPerWarp; ++rr) {
    const int r = warp * kFwdRowsPerWarp + rr;
    qpos[rr] = r < rows ? a.q_pos[q0 + r] : -kNoPosition - 1;  // padding rows see nothing
    qseg[rr] = r < rows && a.q_seg ? a.q_seg[bi * a.sq + q0 + r] : 0;
    m[rr] = -INFINITY, l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < NV; ++c) acc[rr][c] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < a.sk; k0 += kKeyTile) {
    __syncthreads();  // the previous tile's readers are done
    const int n = static_cast<int>(a.sk - k0 < kKeyTile ? a.sk - k0 : kKeyTile);
    stage_rows(&k_sh[0][0], kLd, t.k + bi * t.ks.b + g * t.ks.n + k0 * t.ks.s, t.ks.s, t.ks.d, n, kKeyTile, d);
    stage_rows(&v_sh[0][0], kMaxD, t.v + bi * t.vs.b + g * t.vs.n + k0 * t.vs.s, t.vs.s, t.vs.d, n, kKeyTile, d);
    stage_keys(a, bi, k0, kKeyTile, kpos_sh, kseg_sh);
    __syncthreads();
    if (min_of(kpos_sh, kKeyTile) > q_max) continue;  // block-uniform: nothing visible
    float corr[kFwdRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kFwdRowsPerWarp; ++rr) {
      const int r = warp * kFwdRowsPerWarp + rr;
      const bool vis = a.sees(kpos_sh[lane], qpos[rr]) && (a.q_seg == nullptr || kseg_sh[lane] == qseg[rr]);
      const float s = vis ? dot(q_sh[r], k_sh[lane], d) * a.scale : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row that has seen nothing yet
      float p = expf(s - base);
      corr[rr] = expf(m[rr] - base);
      l[rr] = l[rr] * corr[rr] + warp_sum(p);
      m[rr] = m_new;
      if (vis) p *= a.keep(bi, h, qpos[rr], kpos_sh[lane]);  // after the sum: l is un-dropped
      p_sh[warp][rr][lane] = p;
    }
    __syncwarp();
#pragma unroll
    for (int rr = 0; rr < kFwdRowsPerWarp; ++rr)
#pragma unroll
      for (int c = 0; c < NV; ++c) {
        const int col = lane + 32 * c;
        float sum = acc[rr][c] * corr[rr];
        if (col < d)
          for (int j = 0; j < kKeyTile; ++j) sum += p_sh[warp][rr][j] * v_sh[j][col];
        acc[rr][c] = sum;
      }
  }
#pragma unroll
  for (int rr = 0; rr < kFwdRowsPerWarp; ++rr) {
    const int r = warp * kFwdRowsPerWarp + rr;
    if (r >= rows) continue;
    const int64_t qi = q0 + r;
    const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
    T* o = t.out + ((qi * a.b + bi) * a.nq + h) * d;
#pragma unroll
    for (int c = 0; c < NV; ++c)
      if (lane + 32 * c < d) o[lane + 32 * c] = from_f32<T>(acc[rr][c] * inv);
    if (lane == 0) t.lse[(bi * a.nq + h) * a.sq + qi] = l[rr] > 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
  }
}

// ---- backward -------------------------------------------------------------------------------

template <typename T>
struct BwdTensors {
  const T *dout, *q, *k, *v, *out;
  FlashStrides dos, qs, ks, vs, os;
  const float* lse;
  FlashStrides lse_st;  // b, n, s (d unused)
  float* delta;         // [b, nq, sq]
  T *dq, *dk, *dv;      // [s, b, n, d]
};

// delta[row] = sum_c dout[row, c] * out[row, c]; one warp per row of [b * nq * sq].
template <typename T>
__global__ void __launch_bounds__(kThreads) flash_delta_kernel(Attn a, BwdTensors<T> t) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.b * a.nq * a.sq) return;  // whole warps: the shuffles below see full warps
  const int64_t i = row % a.sq, h = (row / a.sq) % a.nq, bi = row / (a.sq * a.nq);
  const T* g = t.dout + bi * t.dos.b + h * t.dos.n + i * t.dos.s;
  const T* o = t.out + bi * t.os.b + h * t.os.n + i * t.os.s;
  float sum = 0.0f;
  for (int c = lane; c < a.d; c += 32) sum += to_f32(g[c * t.dos.d]) * to_f32(o[c * t.os.d]);
  sum = warp_sum(sum);
  if (lane == 0) t.delta[row] = sum;
}

// Query tile q0 of head h in shared memory: Q, dO rows, positions, segments, lse, D.
struct QueryTile {
  float q[kQueryTile][kLd], dout[kQueryTile][kLd];
  float lse[kQueryTile], delta[kQueryTile];
  int64_t pos[kQueryTile], seg[kQueryTile];
};

template <typename T>
__device__ __forceinline__ void stage_queries(const Attn& a, const BwdTensors<T>& t, int64_t bi, int64_t h, int64_t q0,
                                              QueryTile& tile) {
  const int n = static_cast<int>(a.sq - q0 < kQueryTile ? a.sq - q0 : kQueryTile);
  stage_rows(&tile.q[0][0], kLd, t.q + bi * t.qs.b + h * t.qs.n + q0 * t.qs.s, t.qs.s, t.qs.d, n, kQueryTile, a.d);
  stage_rows(&tile.dout[0][0], kLd, t.dout + bi * t.dos.b + h * t.dos.n + q0 * t.dos.s, t.dos.s, t.dos.d, n, kQueryTile,
             a.d);
  if (threadIdx.x < kQueryTile) {
    const int i = threadIdx.x;
    const int64_t qi = q0 + i;
    tile.pos[i] = i < n ? a.q_pos[qi] : -kNoPosition - 1;
    tile.seg[i] = i < n && a.q_seg ? a.q_seg[bi * a.sq + qi] : 0;
    tile.lse[i] = i < n ? t.lse[bi * t.lse_st.b + h * t.lse_st.n + qi * t.lse_st.s] : -INFINITY;
    tile.delta[i] = i < n ? t.delta[(bi * a.nq + h) * a.sq + qi] : 0.0f;
  }
}

template <typename T, int NV>
__global__ void __launch_bounds__(kThreads) flash_dkdv_kernel(Attn a, BwdTensors<T> t) {
  __shared__ QueryTile qt;
  __shared__ float k_sh[kBwdKeys][kMaxD], v_sh[kBwdKeys][kMaxD];
  __shared__ float pd_sh[kWarps][kBwdKeysPerWarp][kQueryTile];
  __shared__ float ds_sh[kWarps][kBwdKeysPerWarp][kQueryTile];
  __shared__ int64_t kpos_sh[kBwdKeys], kseg_sh[kBwdKeys];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = a.d;
  const int64_t bi = blockIdx.z, g = blockIdx.y, k0 = int64_t(blockIdx.x) * kBwdKeys;
  const int n = static_cast<int>(a.sk - k0 < kBwdKeys ? a.sk - k0 : kBwdKeys);
  stage_rows(&k_sh[0][0], kMaxD, t.k + bi * t.ks.b + g * t.ks.n + k0 * t.ks.s, t.ks.s, t.ks.d, n, kBwdKeys, d);
  stage_rows(&v_sh[0][0], kMaxD, t.v + bi * t.vs.b + g * t.vs.n + k0 * t.vs.s, t.vs.s, t.vs.d, n, kBwdKeys, d);
  stage_keys(a, bi, k0, kBwdKeys, kpos_sh, kseg_sh);
  float dk[kBwdKeysPerWarp][NV], dv[kBwdKeysPerWarp][NV];
#pragma unroll
  for (int kk = 0; kk < kBwdKeysPerWarp; ++kk)
#pragma unroll
    for (int c = 0; c < NV; ++c) dk[kk][c] = dv[kk][c] = 0.0f;
  for (int64_t h = g * a.rep; h < (g + 1) * a.rep; ++h)
    for (int64_t q0 = 0; q0 < a.sq; q0 += kQueryTile) {
      __syncthreads();  // the key rows are staged; the previous tile's readers are done
      stage_queries(a, t, bi, h, q0, qt);
      __syncthreads();
      if (max_of(qt.pos, kQueryTile) < min_of(kpos_sh, kBwdKeys)) continue;  // block-uniform
#pragma unroll
      for (int kk = 0; kk < kBwdKeysPerWarp; ++kk) {
        const int key = warp * kBwdKeysPerWarp + kk;
        const bool vis = a.sees(kpos_sh[key], qt.pos[lane]) && qt.lse[lane] != -INFINITY &&
                         (a.q_seg == nullptr || kseg_sh[key] == qt.seg[lane]);
        float pd = 0.0f, ds = 0.0f;
        if (vis) {
          const float p = expf(dot(qt.q[lane], k_sh[key], d) * a.scale - qt.lse[lane]);
          const float kf = a.keep(bi, h, qt.pos[lane], kpos_sh[key]);
          pd = p * kf;
          ds = p * (dot(qt.dout[lane], v_sh[key], d) * kf - qt.delta[lane]);
        }
        pd_sh[warp][kk][lane] = pd;
        ds_sh[warp][kk][lane] = ds;
      }
      __syncwarp();
#pragma unroll
      for (int kk = 0; kk < kBwdKeysPerWarp; ++kk)
#pragma unroll
        for (int c = 0; c < NV; ++c) {
          const int col = lane + 32 * c;
          if (col >= d) continue;
          float sv = dv[kk][c], sk = dk[kk][c];
          for (int i = 0; i < kQueryTile; ++i) {
            sv += pd_sh[warp][kk][i] * qt.dout[i][col];
            sk += ds_sh[warp][kk][i] * qt.q[i][col];
          }
          dv[kk][c] = sv, dk[kk][c] = sk;
        }
    }
#pragma unroll
  for (int kk = 0; kk < kBwdKeysPerWarp; ++kk) {
    const int key = warp * kBwdKeysPerWarp + kk;
    if (key >= n) continue;
    const int64_t at = (((k0 + key) * a.b + bi) * a.nkv + g) * d;
#pragma unroll
    for (int c = 0; c < NV; ++c)
      if (lane + 32 * c < d) {
        t.dk[at + lane + 32 * c] = from_f32<T>(dk[kk][c] * a.scale);
        t.dv[at + lane + 32 * c] = from_f32<T>(dv[kk][c]);
      }
  }
}

template <typename T, int NV>
__global__ void __launch_bounds__(kThreads) flash_dq_kernel(Attn a, BwdTensors<T> t) {
  __shared__ float q_sh[kDqRows][kMaxD], do_sh[kDqRows][kMaxD];
  __shared__ float k_sh[kKeyTile][kLd], v_sh[kKeyTile][kLd];
  __shared__ float ds_sh[kWarps][kDqRowsPerWarp][kKeyTile];
  __shared__ int64_t kpos_sh[kKeyTile], kseg_sh[kKeyTile];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = a.d;
  const int64_t bi = blockIdx.z, h = blockIdx.y, g = h / a.rep, q0 = int64_t(blockIdx.x) * kDqRows;
  const int rows = static_cast<int>(a.sq - q0 < kDqRows ? a.sq - q0 : kDqRows);
  stage_rows(&q_sh[0][0], kMaxD, t.q + bi * t.qs.b + h * t.qs.n + q0 * t.qs.s, t.qs.s, t.qs.d, rows, kDqRows, d);
  stage_rows(&do_sh[0][0], kMaxD, t.dout + bi * t.dos.b + h * t.dos.n + q0 * t.dos.s, t.dos.s, t.dos.d, rows, kDqRows,
             d);
  const int64_t q_max = max_query_position(a, q0, kDqRows);
  int64_t qpos[kDqRowsPerWarp], qseg[kDqRowsPerWarp];
  float lse[kDqRowsPerWarp], delta[kDqRowsPerWarp], dq[kDqRowsPerWarp][NV];
#pragma unroll
  for (int rr = 0; rr < kDqRowsPerWarp; ++rr) {
    const int r = warp * kDqRowsPerWarp + rr;
    const int64_t qi = q0 + r;
    qpos[rr] = r < rows ? a.q_pos[qi] : -kNoPosition - 1;
    qseg[rr] = r < rows && a.q_seg ? a.q_seg[bi * a.sq + qi] : 0;
    lse[rr] = r < rows ? t.lse[bi * t.lse_st.b + h * t.lse_st.n + qi * t.lse_st.s] : -INFINITY;
    delta[rr] = r < rows ? t.delta[(bi * a.nq + h) * a.sq + qi] : 0.0f;
#pragma unroll
    for (int c = 0; c < NV; ++c) dq[rr][c] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < a.sk; k0 += kKeyTile) {
    __syncthreads();
    const int n = static_cast<int>(a.sk - k0 < kKeyTile ? a.sk - k0 : kKeyTile);
    stage_rows(&k_sh[0][0], kLd, t.k + bi * t.ks.b + g * t.ks.n + k0 * t.ks.s, t.ks.s, t.ks.d, n, kKeyTile, d);
    stage_rows(&v_sh[0][0], kLd, t.v + bi * t.vs.b + g * t.vs.n + k0 * t.vs.s, t.vs.s, t.vs.d, n, kKeyTile, d);
    stage_keys(a, bi, k0, kKeyTile, kpos_sh, kseg_sh);
    __syncthreads();
    if (min_of(kpos_sh, kKeyTile) > q_max) continue;
#pragma unroll
    for (int rr = 0; rr < kDqRowsPerWarp; ++rr) {
      const int r = warp * kDqRowsPerWarp + rr;
      const bool vis =
          a.sees(kpos_sh[lane], qpos[rr]) && lse[rr] != -INFINITY && (a.q_seg == nullptr || kseg_sh[lane] == qseg[rr]);
      float ds = 0.0f;
      if (vis) {
        const float p = expf(dot(q_sh[r], k_sh[lane], d) * a.scale - lse[rr]);
        const float kf = a.keep(bi, h, qpos[rr], kpos_sh[lane]);
        ds = p * (dot(do_sh[r], v_sh[lane], d) * kf - delta[rr]);
      }
      ds_sh[warp][rr][lane] = ds;
    }
    __syncwarp();
#pragma unroll
    for (int rr = 0; rr < kDqRowsPerWarp; ++rr)
#pragma unroll
      for (int c = 0; c < NV; ++c) {
        const int col = lane + 32 * c;
        if (col >= d) continue;
        float sum = dq[rr][c];
        for (int j = 0; j < kKeyTile; ++j) sum += ds_sh[warp][rr][j] * k_sh[j][col];
        dq[rr][c] = sum;
      }
  }
#pragma unroll
  for (int rr = 0; rr < kDqRowsPerWarp; ++rr) {
    const int r = warp * kDqRowsPerWarp + rr;
    if (r >= rows) continue;
    T* o = t.dq + (((q0 + r) * a.b + bi) * a.nq + h) * d;
#pragma unroll
    for (int c = 0; c < NV; ++c)
      if (lane + 32 * c < d) o[lane + 32 * c] = from_f32<T>(dq[rr][c] * a.scale);
  }
}

// ---- launchers ------------------------------------------------------------------------------

// Runs body with NV = 2 (d <= 64) or 4 (d <= 128): the output columns per lane (two variants
// only, to keep the instantiations few; lanes past d idle).
#define MSP_DISPATCH_COLUMNS(d, NV, ...) \
  if ((d) <= 64) {                       \
    constexpr int NV = 2;                \
    __VA_ARGS__;                         \
  } else {                               \
    constexpr int NV = 4;                \
    __VA_ARGS__;                         \
  }

template <typename T>
cudaError_t launch_fwd(const FlashAttentionFwd& x, cudaStream_t stream) {
  const Attn a = attn_of(x);
  const FwdTensors<T> t{static_cast<const T*>(x.q),
                        static_cast<const T*>(x.k),
                        static_cast<const T*>(x.v),
                        x.q_strides,
                        x.k_strides,
                        x.v_strides,
                        static_cast<T*>(x.out),
                        x.lse};
  const dim3 grid(tiles(x.sq, kFwdRows), static_cast<unsigned>(x.nq), static_cast<unsigned>(x.b));
  MSP_DISPATCH_COLUMNS(x.d, NV, flash_fwd_kernel<T, NV><<<grid, kThreads, 0, stream>>>(a, t));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const FlashAttentionBwd& x, float* delta, cudaStream_t stream) {
  const Attn a = attn_of(x);
  const BwdTensors<T> t{static_cast<const T*>(x.dout),
                        static_cast<const T*>(x.q),
                        static_cast<const T*>(x.k),
                        static_cast<const T*>(x.v),
                        static_cast<const T*>(x.out),
                        x.dout_strides,
                        x.q_strides,
                        x.k_strides,
                        x.v_strides,
                        x.out_strides,
                        x.lse,
                        x.lse_strides,
                        delta,
                        static_cast<T*>(x.dq),
                        static_cast<T*>(x.dk),
                        static_cast<T*>(x.dv)};
  const int64_t rows = x.b * x.nq * x.sq;
  if (rows > 0) {
    flash_delta_kernel<T><<<tiles(rows, kWarps), kThreads, 0, stream>>>(a, t);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const unsigned nq = static_cast<unsigned>(x.nq), nkv = static_cast<unsigned>(x.nkv);
  const unsigned b = static_cast<unsigned>(x.b);
  if (x.sk > 0) {
    MSP_DISPATCH_COLUMNS(x.d, NV,
                         flash_dkdv_kernel<T, NV><<<dim3(tiles(x.sk, kBwdKeys), nkv, b), kThreads, 0, stream>>>(a, t));
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (rows > 0) {
    MSP_DISPATCH_COLUMNS(x.d, NV,
                         flash_dq_kernel<T, NV><<<dim3(tiles(x.sq, kDqRows), nq, b), kThreads, 0, stream>>>(a, t));
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t simt_fwd(const FlashAttentionFwd& x, cudaStream_t stream) {
  MSP_DISPATCH_DTYPE(x.dtype, T, return launch_fwd<T>(x, stream));
  return cudaErrorInvalidValue;
}

cudaError_t simt_bwd(const FlashAttentionBwd& x, float* delta, cudaStream_t stream) {
  MSP_DISPATCH_DTYPE(x.dtype, T, return launch_bwd<T>(x, delta, stream));
  return cudaErrorInvalidValue;
}

}  // namespace flash
}  // namespace cuda
}  // namespace msp
