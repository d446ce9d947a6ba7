// Tensor-core forward of flash_attention (bf16/fp16 inputs, sm_80+): the function of
// megatron_sp/ops/flash_attention.py's reference, with its dropout mask bit for bit.
//
// Design (FlashAttention-2's forward, mma.sync m16n8k16 with fp32 accumulators):
//   One block of 4 warps per (query tile of 16 kM x 4 rows, query head, batch); each warp owns 16 kM
//   query rows (kM = 2: 128-row tiles for d <= 64; kM = 1: 64-row tiles for d = 128, and for d <= 64
//   when 128-row tiles would leave SMs idle).
//   The Q tile and one 64-key K and V tile live in dynamic shared memory (flash_attention_mma.cuh);
//   per key tile: S = Q K^T (A: Q by ldmatrix, B: K by ldmatrix), scaled to base 2, masked where the
//   tile pair's summary says some keys are hidden (position, document, past the end), online
//   softmax per row (running max m and sum l of the un-dropped probabilities in registers, the max
//   over the 4 lanes of a row by shuffles, the sum per lane until the end), dropout on the
//   probabilities, then O += P V with P's fp32 accumulators packed to 16 bits as the A operand and V
//   by ldmatrix.trans. Tiles whose keys no query of the block sees are never loaded.
//   Loads overlap math: V(t) is fetched (cp.async) while S(t) is computed, K(t+1) while P V(t is).
//   Dropout: one Philox call per 4 keys. The words of keys 4m..4m+3 for one query are one call
//   (attention_keep_mask: feature = head * 2^20 + key position); in the accumulator layout lanes
//   2u and 2u+1 of a row quad hold keys 4m..4m+1 and 4m+2..4m+3 of rows g and g+8, so lane 2u draws
//   row g's call, lane 2u+1 row g+8's, and they swap the two words the other needs (2 shuffles).
//   That needs key positions 4-aligned and consecutive per group (the summary's kAligned: causal,
//   zigzag and ring chunks of 4-multiples); other tiles draw one call per element.
//   Numerics: products exact, sums in fp32 (the mma's accumulation order), exp2 of S * scale *
//   log2(e); P rounded to the input dtype for P V (as FlashAttention); out = O / l in fp32, rounded
//   once; lse = m ln 2 + ln l in fp32.
#include "flash_attention_mma.cuh"

namespace msp {
namespace cuda {
namespace flash {
namespace {

template <int kD, int kM>
struct FwdShape {
  static constexpr int kRows = 16 * kM * kMmaWarps, kKeys = 64, kPitch = Pitch<kD>::value;
  // dynamic shared memory (byte offsets): Q, K, V tiles; key positions and segments; query ones
  static constexpr int kQ = 0, kK = kQ + 2 * kRows * kPitch, kV = kK + 2 * kKeys * kPitch;
  static constexpr int kKPos = kV + 2 * kKeys * kPitch, kKSeg = kKPos + 8 * kKeys, kQPos = kKSeg + 8 * kKeys;
  static constexpr int kQSeg = kQPos + 8 * kRows, kBytes = kQSeg + 8 * kRows;
};

template <typename T>
struct FwdTensors {
  const T *q, *k, *v;
  FlashStrides qs, ks, vs;
  bool q_vec, k_vec, v_vec;  // rows_vectorizable
  T* out;                    // [sq, b, nq, d]
  float* lse;                // [b, nq, sq]
  FlashIndexSummaries sums;
};

template <typename T, int kD, int kM>
struct FwdBlock {
  using S = FwdShape<kD, kM>;
  const Attn& a;
  const FwdTensors<T>& t;
  T *q_sh, *k_sh, *v_sh;
  int64_t *kpos_sh, *kseg_sh, *qpos_sh, *qseg_sh;
  int64_t bi, h, kvh, q0;
  int warp, lane;

  __device__ FwdBlock(const Attn& a_, const FwdTensors<T>& t_, unsigned char* smem) : a(a_), t(t_) {
    q_sh = reinterpret_cast<T*>(smem + S::kQ), k_sh = reinterpret_cast<T*>(smem + S::kK);
    v_sh = reinterpret_cast<T*>(smem + S::kV);
    kpos_sh = reinterpret_cast<int64_t*>(smem + S::kKPos), kseg_sh = reinterpret_cast<int64_t*>(smem + S::kKSeg);
    qpos_sh = reinterpret_cast<int64_t*>(smem + S::kQPos), qseg_sh = reinterpret_cast<int64_t*>(smem + S::kQSeg);
    bi = blockIdx.z, h = blockIdx.y, kvh = h / a.rep, q0 = int64_t(blockIdx.x) * S::kRows;
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  }

  __device__ Visibility visible(int64_t kt) const {
    return visibility(t.sums.q, q0 / kTile, S::kRows / kTile, t.sums.k, kt, bi, a.window);
  }

  // The first key tile after kt that some query of the block sees (tiles(sk) when none).
  __device__ int64_t next_tile(int64_t kt) const {
    const int64_t n = t.sums.k.tiles;
    for (++kt; kt < n && visible(kt) == Visibility::kNone;) ++kt;
    return kt;
  }

  __device__ void load_queries() {
    load_tile<T, S::kRows, kD>(q_sh, t.q + bi * t.qs.b + h * t.qs.n, t.qs.s, t.qs.d, q0, a.sq, a.d, t.q_vec);
    load_vector<8, S::kRows>(qpos_sh, a.q_pos, q0, a.sq);
    if (a.q_seg) load_vector<8, S::kRows>(qseg_sh, a.q_seg + bi * a.sq, q0, a.sq);
  }

  __device__ void load_keys(int64_t kt) {
    const int64_t k0 = kt * S::kKeys;
    load_tile<T, S::kKeys, kD>(k_sh, t.k + bi * t.ks.b + kvh * t.ks.n, t.ks.s, t.ks.d, k0, a.sk, a.d, t.k_vec);
    load_vector<8, S::kKeys>(kpos_sh, a.k_pos, k0, a.sk);
    if (a.k_seg) load_vector<8, S::kKeys>(kseg_sh, a.k_seg + bi * a.sk, k0, a.sk);
  }

  __device__ void load_values(int64_t kt) {
    load_tile<T, S::kKeys, kD>(v_sh, t.v + bi * t.vs.b + kvh * t.vs.n, t.vs.s, t.vs.d, kt * S::kKeys, a.sk, a.d,
                               t.v_vec);
  }

  // s[mt][n] (m16n8 tile n of the warp's m-tile mt) = Q K^T for the 64 keys of the tile.
  __device__ void scores(float (&s)[kM][8][4]) const {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][n][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t qa[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
        ldmatrix_x4(qa[mt], a_rows(q_sh, S::kPitch, (warp * kM + mt) * 16, kk * 16, lane));
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, b_rows_nk(k_sh, S::kPitch, np * 16, kk * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          mma_16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma_16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
  }

  // s *= scale log2(e); hidden elements (some tiles only) -inf.
  __device__ void mask(float (&s)[kM][8][4], int64_t kt, bool some) const {
    const float sl2 = a.scale * kLog2e;
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float x = s[mt][n][i] * sl2;
          if (some) {
            const int r = (warp * kM + mt) * 16 + lane / 4 + 8 * (i / 2), c = 8 * n + 2 * (lane % 4) + (i % 2);
            const bool vis = q0 + r < a.sq && kt * S::kKeys + c < a.sk && a.sees(kpos_sh[c], qpos_sh[r]) &&
                             (a.q_seg == nullptr || kseg_sh[c] == qseg_sh[r]);
            x = vis ? x : -INFINITY;
          }
          s[mt][n][i] = x;
        }
  }

  // Online softmax: s becomes P = exp2(s - m) (un-dropped, its sum added to l); o rescaled.
  __device__ void softmax(float (&s)[kM][8][4], float (&m)[kM][2], float (&l)[kM][2], float (&o)[kM][kD / 8][4]) const {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {  // rows g, g + 8
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * hr], s[mt][n][2 * hr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[mt][hr], mx);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row that has seen nothing yet
        const float corr = exp2f(m[mt][hr] - base);
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f(s[mt][n][2 * hr + e] - base);
            s[mt][n][2 * hr + e] = p;
            sum += p;
          }
        l[mt][hr] = l[mt][hr] * corr + sum;
        m[mt][hr] = m_new;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) o[mt][n][2 * hr] *= corr, o[mt][n][2 * hr + 1] *= corr;
      }
  }

  // P *= keep * 1 / (1 - p): the words of this lane's 4 elements of n-tile n (c[0..3]).
  __device__ void dropout(float (&s)[kM][8][4], int64_t kt, const uint32_t (&qpos)[kM][2]) const {
    const int64_t head = a.head_offset + h, sample = a.samples[bi];
    const bool aligned = t.sums.k.has(kt, kAligned);
    const int odd = lane & 1;  // lane % 4 = 2u + odd: keys 4u + 2 odd, +1 of the group 4u..4u+3 of the n-tile
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        uint32_t w[4];
        if (aligned) {  // one call for (row g + 8 odd, keys 4u..4u+3); swap the pair's halves
          const Words4 x =
              dropout_words(a.drop, static_cast<uint64_t>(((head << 20) + kpos_sh[8 * n + 4 * ((lane % 4) / 2)]) >> 2),
                            qpos[mt][odd], sample);
          const uint32_t r0 = shfl_xor_u32(odd ? x.w[0] : x.w[2], 1), r1 = shfl_xor_u32(odd ? x.w[1] : x.w[3], 1);
          w[0] = odd ? r0 : x.w[0], w[1] = odd ? r1 : x.w[1];  // row g: keys 2(lane%4), +1
          w[2] = odd ? x.w[2] : r0, w[3] = odd ? x.w[3] : r1;  // row g + 8
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            w[i] = a.word(head, qpos[mt][i / 2], kpos_sh[8 * n + 2 * (lane % 4) + (i % 2)], sample);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][n][i] *= keep_scale(a.drop, w[i]);
      }
  }

  // o += P V for the tile's 64 keys.
  __device__ void accumulate(const float (&s)[kM][8][4], float (&o)[kM][kD / 8][4]) const {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t pa[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) to_a_fragment<T>(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, b_rows_kn(v_sh, S::kPitch, kk * 16, np * 16, lane));
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          mma_16816<T>(o[mt][2 * np], pa[mt], vb[0], vb[1]);
          mma_16816<T>(o[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }

  // out = o / l (rows with l = 0: 0), lse = m ln 2 + ln l (-inf).
  __device__ void store(float (&o)[kM][kD / 8][4], float (&m)[kM][2], float (&l)[kM][2]) const {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float sum = l[mt][hr];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int64_t qi = q0 + (warp * kM + mt) * 16 + lane / 4 + 8 * hr;
        if (qi >= a.sq) continue;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        T* row = t.out + ((qi * a.b + bi) * a.nq + h) * a.d;
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          const int c = 8 * n + 2 * (lane % 4);
          const float x0 = o[mt][n][2 * hr] * inv, x1 = o[mt][n][2 * hr + 1] * inv;
          if (a.d % 2 == 0 && c < a.d) {
            *reinterpret_cast<uint32_t*>(row + c) = pack2<T>(x0, x1);
          } else {
            if (c < a.d) row[c] = from_f32<T>(x0);
            if (c + 1 < a.d) row[c + 1] = from_f32<T>(x1);
          }
        }
        if (lane % 4 == 0) t.lse[(bi * a.nq + h) * a.sq + qi] = sum > 0.0f ? m[mt][hr] * kLn2 + logf(sum) : -INFINITY;
      }
  }
};

template <typename T, int kD, int kM>
__global__ void __launch_bounds__(kMmaThreads) flash_fwd_mma_kernel(Attn a, FwdTensors<T> t) {
#if defined(MSP_HAS_MMA)
  FwdBlock<T, kD, kM> blk(a, t, dynamic_shared_memory());
  int64_t kt = blk.next_tile(-1);
  blk.load_queries();
  if (kt < t.sums.k.tiles) blk.load_keys(kt);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qpos[kM][2];  // Philox counters of this lane's rows
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      qpos[mt][hr] = static_cast<uint32_t>(blk.qpos_sh[(blk.warp * kM + mt) * 16 + blk.lane / 4 + 8 * hr]);
  float o[kM][kD / 8][4], m[kM][2], l[kM][2];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
  }
  while (kt < t.sums.k.tiles) {
    cp_async_wait<0>();
    __syncthreads();  // K(kt) is in; every warp is done with V(kt - 1)
    blk.load_values(kt);
    cp_async_commit();
    float s[kM][8][4];
    blk.scores(s);
    blk.mask(s, kt, blk.visible(kt) == Visibility::kSome);
    blk.softmax(s, m, l, o);
    if (a.dropout) blk.dropout(s, kt, qpos);
    cp_async_wait<0>();
    __syncthreads();  // V(kt) is in; every warp is done with K(kt) and its positions
    const int64_t next = blk.next_tile(kt);
    if (next < t.sums.k.tiles) blk.load_keys(next);
    cp_async_commit();
    blk.accumulate(s, o);
    kt = next;
  }
  blk.store(o, m, l);
#elif defined(__CUDA_ARCH__)
  __trap();  // compiled for a GPU before sm_80: flash_attention.cu runs the SIMT kernels there
#endif
}

template <typename T, int kD, int kM>
cudaError_t launch(const Attn& a, const FwdTensors<T>& t, cudaStream_t stream) {
  using S = FwdShape<kD, kM>;
  cudaError_t err =
      cudaFuncSetAttribute(flash_fwd_mma_kernel<T, kD, kM>, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(tiles(a.sq, S::kRows), static_cast<unsigned>(a.nq), static_cast<unsigned>(a.b));
  flash_fwd_mma_kernel<T, kD, kM><<<grid, kMmaThreads, S::kBytes, stream>>>(a, t);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fwd(const FlashAttentionFwd& x, const FlashIndexSummaries& sums, cudaStream_t stream) {
  const Attn a = attn_of(x);
  const FwdTensors<T> t{static_cast<const T*>(x.q),
                        static_cast<const T*>(x.k),
                        static_cast<const T*>(x.v),
                        x.q_strides,
                        x.k_strides,
                        x.v_strides,
                        rows_vectorizable(x.q, x.q_strides, x.d),
                        rows_vectorizable(x.k, x.k_strides, x.d),
                        rows_vectorizable(x.v, x.v_strides, x.d),
                        static_cast<T*>(x.out),
                        x.lse,
                        sums};
  // d <= 64: 128-row tiles halve the K/V reads per product; 64-row ones when those would not fill
  // the SMs. d = 128 keeps 64-row tiles: 128 rows need more than 255 registers a thread (ptxas spills).
  const bool wide = int64_t(tiles(x.sq, 128)) * x.nq * x.b >= 2 * sm_count();
  if (x.d <= 64) return wide ? launch<T, 64, 2>(a, t, stream) : launch<T, 64, 1>(a, t, stream);
  return launch<T, 128, 1>(a, t, stream);
}

}  // namespace

cudaError_t mma_fwd(const FlashAttentionFwd& x, const FlashIndexSummaries& sums, cudaStream_t stream) {
  if (x.dtype == DType::kBF16) return launch_fwd<__nv_bfloat16>(x, sums, stream);
  if (x.dtype == DType::kF16) return launch_fwd<__half>(x, sums, stream);
  return cudaErrorInvalidValue;
}

}  // namespace flash
}  // namespace cuda
}  // namespace msp
