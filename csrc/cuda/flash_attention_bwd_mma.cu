// Tensor-core backward of flash_attention (bf16/fp16 inputs, sm_80+): the gradients of the
// reference's function, from the (possibly merged) out and lse, with the forward's dropout mask
// redrawn bit for bit.
//
// Design (FlashAttention-2's backward order, mma.sync m16n8k16 with fp32 accumulators):
//   1. D = rowsum(dO * O) per query row (fp32, one warp per row), which also zeroes that row of the
//      fp32 dQ accumulator;
//   2. one block of 4 warps per (64-key tile, key/value head, batch), each warp owning 16 keys:
//      K and V stay in shared memory while the query tiles of every query head of the GQA group
//      pass (64 queries: Q, dO, positions, lse, D by cp.async, tiles no key of the block sees
//      skipped). Per query tile, transposed so that a warp's accumulators are its own keys:
//      S^T = K Q^T and dP^T = V dO^T; P^T = exp2(S^T scale log2(e) - lse log2(e)) (masked where the
//      summary says so); the dropout words (below); dS^T = P^T (dP^T keep / (1 - p) - D);
//      dV += (P^T keep / (1 - p)) dO and dK += dS^T Q, with P^T, dS^T packed to 16 bits as A
//      operands (as FlashAttention) and dO, Q by ldmatrix.trans; dS^T goes to shared memory, and
//      after a barrier each warp adds dQ += dS K for 16 of the queries into the fp32 accumulator
//      with atomicAdd (while the next query tile loads), so dQ's summation order, and its last bits,
//      can differ between runs on a GPU; dK and dV are summed in a fixed order in registers;
//   3. dQ = accumulator * scale, rounded to the input dtype.
//   Dropout: one Philox call per 4 keys, as in the forward. In the transposed layout the 4 keys of a
//   group sit in 4 lanes (lane bits 2-3: rows g = 4u..4u+3), which between them hold two key groups x
//   two queries per n8 tile: each lane draws one of those 4 calls and a 4 x 4 transpose by shuffles
//   (xor 4, xor 8; 4 shuffles) gives every lane its own word of each.
#include "flash_attention_mma.cuh"

namespace msp {
namespace cuda {
namespace flash {
namespace {

template <int kD>
struct BwdShape {
  static constexpr int kKeys = 64, kRows = 64, kPitch = Pitch<kD>::value, kDsPitch = 64 + 8;
  // dynamic shared memory (byte offsets): K, V, Q, dO tiles, dS^T [keys][queries]; key positions and
  // segments; query positions, segments, lse, D
  static constexpr int kK = 0, kV = kK + 2 * kKeys * kPitch, kQ = kV + 2 * kKeys * kPitch,
                       kDo = kQ + 2 * kRows * kPitch;
  static constexpr int kDs = kDo + 2 * kRows * kPitch, kKPos = kDs + 2 * kKeys * kDsPitch, kKSeg = kKPos + 8 * kKeys;
  static constexpr int kQPos = kKSeg + 8 * kKeys, kQSeg = kQPos + 8 * kRows, kLse = kQSeg + 8 * kRows;
  static constexpr int kDelta = kLse + 4 * kRows, kBytes = kDelta + 4 * kRows;
};

template <typename T>
struct BwdTensors {
  const T *dout, *q, *k, *v;
  FlashStrides dos, qs, ks, vs;
  bool do_vec, q_vec, k_vec, v_vec;  // rows_vectorizable
  const float* lse;
  FlashStrides lse_st;  // b, n, s (d unused)
  const float* delta;   // [b, nq, sq]
  float* dq_accum;      // [sq, b, nq, d]
  T *dk, *dv;           // [sk, b, nkv, d]
  FlashIndexSummaries sums;
};

template <typename T>
struct DeltaTensors {
  const T *dout, *out;
  FlashStrides dos, os;
  float *delta, *dq_accum;
};

// delta[row] = sum_c dout[row, c] * out[row, c] and dq_accum's row zeroed; one warp per row of
// [b * nq * sq].
template <typename T>
__global__ void __launch_bounds__(kMmaThreads) flash_delta_mma_kernel(Attn a, DeltaTensors<T> t) {
  const int64_t row = int64_t(blockIdx.x) * kMmaWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.b * a.nq * a.sq) return;  // whole warps: the shuffles below see full warps
  const int64_t i = row % a.sq, h = (row / a.sq) % a.nq, bi = row / (a.sq * a.nq);
  const T* g = t.dout + bi * t.dos.b + h * t.dos.n + i * t.dos.s;
  const T* o = t.out + bi * t.os.b + h * t.os.n + i * t.os.s;
  float* acc = t.dq_accum + ((i * a.b + bi) * a.nq + h) * a.d;
  float sum = 0.0f;
  for (int c = lane; c < a.d; c += 32) {
    sum += to_f32(g[c * t.dos.d]) * to_f32(o[c * t.os.d]);
    acc[c] = 0.0f;
  }
  sum = warp_sum(sum);
  if (lane == 0) t.delta[row] = sum;
}

// dq = dq_accum * scale in the input dtype (same [sq, b, nq, d] layout).
template <typename T>
__global__ void __launch_bounds__(kMmaThreads)
    flash_dq_convert_kernel(const float* acc, T* dq, int64_t n, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * kMmaThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kMmaThreads)
    dq[i] = from_f32<T>(acc[i] * scale);
}

template <typename T, int kD>
struct BwdBlock {
  using S = BwdShape<kD>;
  static constexpr int kN = kD / 8;  // n8 tiles of the head dim
  const Attn& a;
  const BwdTensors<T>& t;
  T *k_sh, *v_sh, *q_sh, *do_sh, *ds_sh;
  int64_t *kpos_sh, *kseg_sh, *qpos_sh, *qseg_sh;
  float *lse_sh, *delta_sh;
  int64_t bi, g, kt, k0;
  int warp, lane;

  __device__ BwdBlock(const Attn& a_, const BwdTensors<T>& t_, unsigned char* smem) : a(a_), t(t_) {
    k_sh = reinterpret_cast<T*>(smem + S::kK), v_sh = reinterpret_cast<T*>(smem + S::kV);
    q_sh = reinterpret_cast<T*>(smem + S::kQ), do_sh = reinterpret_cast<T*>(smem + S::kDo);
    ds_sh = reinterpret_cast<T*>(smem + S::kDs);
    kpos_sh = reinterpret_cast<int64_t*>(smem + S::kKPos), kseg_sh = reinterpret_cast<int64_t*>(smem + S::kKSeg);
    qpos_sh = reinterpret_cast<int64_t*>(smem + S::kQPos), qseg_sh = reinterpret_cast<int64_t*>(smem + S::kQSeg);
    lse_sh = reinterpret_cast<float*>(smem + S::kLse), delta_sh = reinterpret_cast<float*>(smem + S::kDelta);
    kt = blockIdx.x, g = blockIdx.y, bi = blockIdx.z, k0 = kt * S::kKeys;
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  }

  // The (query head, query tile) after `at` (h * tiles + qt over the group's heads) that some key of
  // the block sees; `end` when none.
  __device__ int64_t next_pair(int64_t at) const {
    const int64_t n = t.sums.q.tiles, end = int64_t(a.rep) * n;
    for (++at; at < end && visibility(t.sums.q, at % n, 1, t.sums.k, kt, bi, a.window) == Visibility::kNone;) ++at;
    return at;
  }

  __device__ void load_keys() {
    load_tile<T, S::kKeys, kD>(k_sh, t.k + bi * t.ks.b + g * t.ks.n, t.ks.s, t.ks.d, k0, a.sk, a.d, t.k_vec);
    load_tile<T, S::kKeys, kD>(v_sh, t.v + bi * t.vs.b + g * t.vs.n, t.vs.s, t.vs.d, k0, a.sk, a.d, t.v_vec);
    load_vector<8, S::kKeys>(kpos_sh, a.k_pos, k0, a.sk);
    if (a.k_seg) load_vector<8, S::kKeys>(kseg_sh, a.k_seg + bi * a.sk, k0, a.sk);
  }

  __device__ void load_queries(int64_t h, int64_t q0) {
    load_tile<T, S::kRows, kD>(q_sh, t.q + bi * t.qs.b + h * t.qs.n, t.qs.s, t.qs.d, q0, a.sq, a.d, t.q_vec);
    load_tile<T, S::kRows, kD>(do_sh, t.dout + bi * t.dos.b + h * t.dos.n, t.dos.s, t.dos.d, q0, a.sq, a.d, t.do_vec);
    load_vector<8, S::kRows>(qpos_sh, a.q_pos, q0, a.sq);
    if (a.q_seg) load_vector<8, S::kRows>(qseg_sh, a.q_seg + bi * a.sq, q0, a.sq);
    load_vector<4, S::kRows>(delta_sh, t.delta + (bi * a.nq + h) * a.sq, q0, a.sq);
    const float* lse = t.lse + bi * t.lse_st.b + h * t.lse_st.n;  // any stride along s
    for (int j = threadIdx.x; j < S::kRows; j += kMmaThreads) {
      const bool valid = q0 + j < a.sq;
      cp_async_small<4>(lse_sh + j, valid ? lse + (q0 + j) * t.lse_st.s : lse, valid);
    }
  }

  // st = K Q^T and dpt = V dO^T for the warp's 16 keys (rows) x the tile's 64 queries (8 n8 tiles).
  __device__ void products(float (&st)[8][4], float (&dpt)[8][4]) const {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) st[n][i] = dpt[n][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, a_rows(k_sh, S::kPitch, warp * 16, kk * 16, lane));
      ldmatrix_x4(va, a_rows(v_sh, S::kPitch, warp * 16, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t qb[4], ob[4];
        ldmatrix_x4(qb, b_rows_nk(q_sh, S::kPitch, np * 16, kk * 16, lane));
        ldmatrix_x4(ob, b_rows_nk(do_sh, S::kPitch, np * 16, kk * 16, lane));
        mma_16816<T>(st[2 * np], ka, qb[0], qb[1]);
        mma_16816<T>(st[2 * np + 1], ka, qb[2], qb[3]);
        mma_16816<T>(dpt[2 * np], va, ob[0], ob[1]);
        mma_16816<T>(dpt[2 * np + 1], va, ob[2], ob[3]);
      }
    }
  }

  __device__ int key_of(int i) const { return warp * 16 + lane / 4 + 8 * (i / 2); }  // element i's key (local)
  __device__ int query_of(int n, int i) const { return 8 * n + 2 * (lane % 4) + (i % 2); }

  // st becomes P^T (0 where hidden).
  __device__ void probabilities(float (&st)[8][4], int64_t q0, bool some) const {
    const float sl2 = a.scale * kLog2e;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kl = key_of(i), qc = query_of(n, i);
        const float p = exp2f(st[n][i] * sl2 - lse_sh[qc] * kLog2e);
        bool vis = true;
        if (some)
          vis = q0 + qc < a.sq && k0 + kl < a.sk && a.sees(kpos_sh[kl], qpos_sh[qc]) &&
                (a.q_seg == nullptr || kseg_sh[kl] == qseg_sh[qc]);
        st[n][i] = vis ? p : 0.0f;
      }
  }

  // w = the Philox words of the 4 elements of n-tile n.
  __device__ void words(uint32_t (&w)[4], int n, int64_t h) const {
    const int64_t head = a.head_offset + h, sample = a.samples[bi];
    if (t.sums.k.has(kt, kAligned)) {
      // call jj = (key group hb: rows +8 hb, query +b); lane jj keeps word jj of each call
      const int jj = (lane / 4) % 4, b = jj & 1, hb = jj >> 1;  // this lane's key within its group of 4
      const int64_t kpos = kpos_sh[warp * 16 + 4 * (lane / 16) + 8 * hb];
      const Words4 x = dropout_words(a.drop, static_cast<uint64_t>(((head << 20) + kpos) >> 2),
                                     static_cast<uint32_t>(qpos_sh[8 * n + 2 * (lane % 4) + b]), sample);
      const uint32_t k0w = b ? x.w[1] : x.w[0], k1w = b ? x.w[3] : x.w[2];  // words b, b + 2 of my call
      const uint32_t r0 = shfl_xor_u32(b ? x.w[0] : x.w[1], 4), r1 = shfl_xor_u32(b ? x.w[2] : x.w[3], 4);
      const uint32_t u0 = shfl_xor_u32(hb ? k0w : k1w, 8), u1 = shfl_xor_u32(hb ? r0 : r1, 8);
      const uint32_t own = hb ? k1w : k0w, pair = hb ? r1 : r0;  // calls jj, jj ^ 1; u0, u1: jj ^ 2, jj ^ 3
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int c = i ^ jj;
        w[i] = c == 0 ? own : c == 1 ? pair : c == 2 ? u0 : u1;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = a.word(head, qpos_sh[query_of(n, i)], kpos_sh[key_of(i)], sample);
    }
  }

  // st: P^T -> P^T keep / (1 - p); dpt: dP^T -> dS^T = P^T (dP^T keep / (1 - p) - D). One n-tile's
  // multipliers at a time (a [8][4] array of them spills at d = 128).
  __device__ void combine(float (&st)[8][4], float (&dpt)[8][4], int64_t h) const {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      float kf[4] = {1.0f, 1.0f, 1.0f, 1.0f};
      if (a.dropout) {
        uint32_t w[4];
        words(w, n, h);
#pragma unroll
        for (int i = 0; i < 4; ++i) kf[i] = keep_scale(a.drop, w[i]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = st[n][i];
        dpt[n][i] = p * (dpt[n][i] * kf[i] - delta_sh[query_of(n, i)]);
        st[n][i] = p * kf[i];
      }
    }
  }

  // dv += pd dO, dk += ds Q (pd, ds: [warp's 16 keys][64 queries] in the C layout).
  __device__ void accumulate(const float (&pd)[8][4], const float (&ds)[8][4], float (&dk)[kN][4],
                             float (&dv)[kN][4]) const {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t pa[4], sa[4];
      to_a_fragment<T>(pa, pd[2 * kk], pd[2 * kk + 1]);
      to_a_fragment<T>(sa, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        uint32_t ob[4], qb[4];
        ldmatrix_x4_trans(ob, b_rows_kn(do_sh, S::kPitch, kk * 16, np * 16, lane));
        ldmatrix_x4_trans(qb, b_rows_kn(q_sh, S::kPitch, kk * 16, np * 16, lane));
        mma_16816<T>(dv[2 * np], pa, ob[0], ob[1]);
        mma_16816<T>(dv[2 * np + 1], pa, ob[2], ob[3]);
        mma_16816<T>(dk[2 * np], sa, qb[0], qb[1]);
        mma_16816<T>(dk[2 * np + 1], sa, qb[2], qb[3]);
      }
    }
  }

  __device__ void store_ds(const float (&ds)[8][4]) const {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<uint32_t*>(ds_sh + key_of(2 * hr) * S::kDsPitch + query_of(n, 0)) =
            pack2<T>(ds[n][2 * hr], ds[n][2 * hr + 1]);
  }

  // dq_accum += dS K for queries 16 warp .. + 15 of the tile (dS^T from shared memory).
  __device__ void add_dq(int64_t h, int64_t q0) const {
    uint32_t sa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldmatrix_x4_trans(sa[kk], a_rows_km(ds_sh, S::kDsPitch, warp * 16, kk * 16, lane));
#pragma unroll
    for (int np = 0; np < kD / 16; ++np) {
      float acc[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4_trans(kb, b_rows_kn(k_sh, S::kPitch, kk * 16, np * 16, lane));
        mma_16816<T>(acc[0], sa[kk], kb[0], kb[1]);
        mma_16816<T>(acc[1], sa[kk], kb[2], kb[3]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t qi = q0 + warp * 16 + lane / 4 + 8 * (i / 2);
        float* row = t.dq_accum + ((qi * a.b + bi) * a.nq + h) * a.d;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c = np * 16 + 8 * j + 2 * (lane % 4) + (i % 2);
          if (qi < a.sq && c < a.d) atomicAdd(row + c, acc[j][i]);
        }
      }
    }
  }

  __device__ void store(const float (&dk)[kN][4], const float (&dv)[kN][4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t key = k0 + key_of(i);
      if (key >= a.sk) continue;
      const int64_t at = ((key * a.b + bi) * a.nkv + g) * a.d;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        const int c = 8 * n + 2 * (lane % 4) + (i % 2);
        if (c < a.d) t.dk[at + c] = from_f32<T>(dk[n][i] * a.scale), t.dv[at + c] = from_f32<T>(dv[n][i]);
      }
    }
  }
};

template <typename T, int kD>
__global__ void __launch_bounds__(kMmaThreads) flash_dkdv_mma_kernel(Attn a, BwdTensors<T> t) {
#if defined(MSP_HAS_MMA)
  BwdBlock<T, kD> blk(a, t, dynamic_shared_memory());
  const int64_t n = t.sums.q.tiles, end = int64_t(a.rep) * n;
  int64_t at = blk.next_pair(-1);  // (query head g rep + at / n, query tile at % n)
  blk.load_keys();
  if (at < end) blk.load_queries(blk.g * a.rep + at / n, (at % n) * kTile);
  cp_async_commit();
  float dk[BwdBlock<T, kD>::kN][4] = {}, dv[BwdBlock<T, kD>::kN][4] = {};
  while (at < end) {
    const int64_t h = blk.g * a.rep + at / n, q0 = (at % n) * kTile;
    cp_async_wait<0>();
    __syncthreads();  // the query tile is in; every warp is done with the previous dS^T
    float st[8][4], dpt[8][4];
    blk.products(st, dpt);
    blk.probabilities(st, q0, visibility(t.sums.q, at % n, 1, t.sums.k, blk.kt, blk.bi, a.window) == Visibility::kSome);
    blk.combine(st, dpt, h);
    blk.accumulate(st, dpt, dk, dv);
    blk.store_ds(dpt);
    __syncthreads();  // dS^T is in; every warp is done with this Q and dO
    const int64_t next = blk.next_pair(at);
    if (next < end) blk.load_queries(blk.g * a.rep + next / n, (next % n) * kTile);
    cp_async_commit();
    blk.add_dq(h, q0);
    at = next;
  }
  cp_async_wait<0>();
  blk.store(dk, dv);
#elif defined(__CUDA_ARCH__)
  __trap();  // compiled for a GPU before sm_80: flash_attention.cu runs the SIMT kernels there
#endif
}

template <typename T, int kD>
cudaError_t launch_dkdv(const Attn& a, const BwdTensors<T>& t, cudaStream_t stream) {
  using S = BwdShape<kD>;
  cudaError_t err =
      cudaFuncSetAttribute(flash_dkdv_mma_kernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(tiles(a.sk, S::kKeys), static_cast<unsigned>(a.nkv), static_cast<unsigned>(a.b));
  flash_dkdv_mma_kernel<T, kD><<<grid, kMmaThreads, S::kBytes, stream>>>(a, t);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const FlashAttentionBwd& x, const FlashIndexSummaries& sums, float* delta, float* dq_accum,
                       cudaStream_t stream) {
  const Attn a = attn_of(x);
  const int64_t rows = x.b * x.nq * x.sq;
  if (rows > 0) {
    const DeltaTensors<T> dt{
        static_cast<const T*>(x.dout), static_cast<const T*>(x.out), x.dout_strides, x.out_strides, delta, dq_accum};
    flash_delta_mma_kernel<T><<<tiles(rows, kMmaWarps), kMmaThreads, 0, stream>>>(a, dt);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (x.sk > 0) {
    const BwdTensors<T> t{static_cast<const T*>(x.dout),
                          static_cast<const T*>(x.q),
                          static_cast<const T*>(x.k),
                          static_cast<const T*>(x.v),
                          x.dout_strides,
                          x.q_strides,
                          x.k_strides,
                          x.v_strides,
                          rows_vectorizable(x.dout, x.dout_strides, x.d),
                          rows_vectorizable(x.q, x.q_strides, x.d),
                          rows_vectorizable(x.k, x.k_strides, x.d),
                          rows_vectorizable(x.v, x.v_strides, x.d),
                          x.lse,
                          x.lse_strides,
                          delta,
                          dq_accum,
                          static_cast<T*>(x.dk),
                          static_cast<T*>(x.dv),
                          sums};
    cudaError_t err = x.d <= 64 ? launch_dkdv<T, 64>(a, t, stream) : launch_dkdv<T, 128>(a, t, stream);
    if (err != cudaSuccess) return err;
  }
  const int64_t n = rows * x.d;
  if (n > 0) {
    const unsigned blocks =
        static_cast<unsigned>(n / kMmaThreads + 1 < 8 * sm_count() ? n / kMmaThreads + 1 : 8 * sm_count());
    flash_dq_convert_kernel<T><<<blocks, kMmaThreads, 0, stream>>>(dq_accum, static_cast<T*>(x.dq), n, a.scale);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t mma_bwd(const FlashAttentionBwd& x, const FlashIndexSummaries& sums, float* delta, float* dq_accum,
                    cudaStream_t stream) {
  if (x.dtype == DType::kBF16) return launch_bwd<__nv_bfloat16>(x, sums, delta, dq_accum, stream);
  if (x.dtype == DType::kF16) return launch_bwd<__half>(x, sums, delta, dq_accum, stream);
  return cudaErrorInvalidValue;
}

}  // namespace flash
}  // namespace cuda
}  // namespace msp
