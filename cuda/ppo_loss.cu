// Masked PPO-clip loss: per-token clipped surrogate (DAPO clip-higher, optional dual-clip), KL-to-reference
// (k1/k3) and entropy terms, reduced by the three aggregation modes, and the per-token backward.
//
// Spec: training.algos.losses.policy_loss / aggregate / kl_estimate (PyTorch references). Three launches:
//   1. row kernel (one block per sequence): weighted row sums over the mask of pg, clipped, -log_ratio,
//      ratio, kl, entropy, dual-clipped and the token count n_b;
//   2. finalize kernel (one block): loss and stats under the aggregation mode, and per-row gradient
//      weights w_b (token-mean: 1/max(N,1); seq-mean-token-sum: [n_b>0]/max(#rows with tokens,1);
//      seq-mean-token-mean: [n_b>0]/max(n_b,1)/max(#rows with tokens,1)), so that
//      agg(x) = sum_b w_b sum_t m_bt x_bt;
//   3. backward kernel (elementwise): dL/dlp and dL/dentropy, with torch's subgradient conventions
//      (clamp passes gradient on its closed interval; maximum splits a tie in half).
// Masked positions use select, not multiply, so NaN/inf at masked positions never leak into the loss.
#include "common.cuh"

namespace {

using namespace sleuth;

constexpr int kThreads = 256;
constexpr int kRowStats = 8;  // n, pg, clipped, -log_ratio, ratio, kl, entropy, dual-clipped

struct Params {
  float clip_low, clip_high, clip_c, kl_coef, entropy_coef;  // clip_c: dual-clip bound (> 1), 0 = off
  int kl_type;  // 1 = k1, 3 = k3
  int use_kl;   // ref given and kl_coef > 0
  int has_ent;  // entropy given
  int mode;     // 0 token-mean, 1 seq-mean-token-sum, 2 seq-mean-token-mean
};

struct Token {
  float pg, clipped, neg_lr, ratio, dpg, lower;
};

__device__ __forceinline__ Token surrogate(float lp, float old, float adv, const Params& P) {
  const float raw = lp - old;
  const float dclamp = (raw >= -20.f && raw <= 20.f) ? 1.f : 0.f;
  const float lr = fminf(fmaxf(raw, -20.f), 20.f);
  const float r = expf(lr);
  const float lo = 1.f - P.clip_low, hi = 1.f + P.clip_high;
  const float rc = fminf(fmaxf(r, lo), hi);
  const float pg1 = -adv * r, pg2 = -adv * rc;
  const float d1 = -adv * r;                                    // d pg1 / d log_ratio
  const float d2 = (r >= lo && r <= hi) ? -adv * r : 0.f;       // d pg2 / d log_ratio
  float d = pg1 > pg2 ? d1 : (pg1 < pg2 ? d2 : 0.5f * (d1 + d2));
  float pg = fmaxf(pg1, pg2), lower = 0.f;
  // dual-clip (Ye et al. 2020; verl's clip_ratio_c): A < 0 caps the loss at the constant -A c, no gradient
  if (P.clip_c > 0.f && adv < 0.f && -adv * P.clip_c < pg) {
    pg = -adv * P.clip_c;
    d = 0.f;
    lower = 1.f;
  }
  return {pg, pg2 > pg1 ? 1.f : 0.f, -lr, r, d * dclamp, lower};
}

// k3 as verl's low_var_kl: the log-ratio clamped to +-20, the estimate to at most kK3Max
// (training.algos.losses.K3_MAX); no gradient where either clamp is active (torch.clamp passes it on the closed range)
constexpr float kK3Max = 10.f;

__device__ __forceinline__ float kl_value(float lp, float ref, int kind) {
  if (kind == 1) return lp - ref;
  const float d = fminf(fmaxf(ref - lp, -20.f), 20.f);
  return fminf(expf(d) - d - 1.f, kK3Max);
}

__device__ __forceinline__ float kl_grad(float lp, float ref, int kind) {  // d kl / d lp
  if (kind == 1) return 1.f;
  const float raw = ref - lp;
  if (raw < -20.f || raw > 20.f) return 0.f;
  const float e = expf(raw);
  if (e - raw - 1.f > kK3Max) return 0.f;
  return 1.f - e;
}

__global__ void __launch_bounds__(kThreads) row_kernel(const float* __restrict__ lp, const float* __restrict__ old,
                                                        const float* __restrict__ adv, const float* __restrict__ mask,
                                                        const float* __restrict__ ref, const float* __restrict__ ent,
                                                        int T, Params P, float* __restrict__ rows) {
  __shared__ float smem[32];
  const long long off = (long long)blockIdx.x * T;
  float acc[kRowStats] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int t = threadIdx.x; t < T; t += kThreads) {
    const long long i = off + t;
    const float m = mask[i];
    if (m == 0.f) continue;
    const Token k = surrogate(lp[i], old[i], adv[i], P);
    acc[0] += m;
    acc[1] += m * k.pg;
    acc[2] += m * k.clipped;
    acc[3] += m * k.neg_lr;
    acc[4] += m * k.ratio;
    if (P.use_kl) acc[5] += m * kl_value(lp[i], ref[i], P.kl_type);
    if (P.has_ent) acc[6] += m * ent[i];
    acc[7] += m * k.lower;
  }
#pragma unroll
  for (int q = 0; q < kRowStats; ++q) {
    const float v = block_sum(acc[q], smem);
    if (threadIdx.x == 0) rows[(long long)blockIdx.x * kRowStats + q] = v;
  }
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(const float* __restrict__ rows, int B, Params P,
                                                             float* __restrict__ out, float* __restrict__ row_w) {
  __shared__ float smem[32];
  __shared__ float s_total, s_seqs;
  // pass 1: token count and number of rows that have tokens
  float n = 0.f, seqs = 0.f;
  for (int b = threadIdx.x; b < B; b += kThreads) {
    const float nb = rows[(long long)b * kRowStats];
    n += nb;
    seqs += nb > 0.f ? 1.f : 0.f;
  }
  n = block_sum(n, smem);
  seqs = block_sum(seqs, smem);
  if (threadIdx.x == 0) {
    s_total = n;
    s_seqs = seqs;
  }
  __syncthreads();
  const float total = s_total, nseq = s_seqs;
  // pass 2: row weights and weighted sums
  float agg[3] = {0.f, 0.f, 0.f};   // pg, kl, entropy under the mode
  float tok[4] = {0.f, 0.f, 0.f, 0.f};  // clipped, -log_ratio, ratio, dual-clipped summed over tokens
  for (int b = threadIdx.x; b < B; b += kThreads) {
    const float* r = rows + (long long)b * kRowStats;
    float w;
    if (P.mode == 0) w = 1.f / fmaxf(total, 1.f);
    else if (P.mode == 1) w = r[0] > 0.f ? 1.f / fmaxf(nseq, 1.f) : 0.f;  // rows that hold tokens, as mode 2
    else w = r[0] > 0.f ? 1.f / fmaxf(r[0], 1.f) / fmaxf(nseq, 1.f) : 0.f;
    row_w[b] = w;
    agg[0] += w * r[1];
    agg[1] += w * r[5];
    agg[2] += w * r[6];
    tok[0] += r[2];
    tok[1] += r[3];
    tok[2] += r[4];
    tok[3] += r[7];
  }
  float v[7];
  for (int q = 0; q < 3; ++q) v[q] = block_sum(agg[q], smem);
  for (int q = 0; q < 4; ++q) v[3 + q] = block_sum(tok[q], smem);
  if (threadIdx.x == 0) {
    const float nt = fmaxf(total, 1.f);
    float loss = v[0];
    if (P.use_kl) loss += P.kl_coef * v[1];
    if (P.has_ent) loss -= P.entropy_coef * v[2];
    out[0] = loss;
    out[1] = v[0];
    out[2] = v[3] / nt;
    out[3] = v[4] / nt;
    out[4] = v[5] / nt;
    out[5] = v[1];
    out[6] = v[2];
    out[7] = total;
    out[8] = v[6] / nt;
  }
}

__global__ void __launch_bounds__(kThreads) backward_kernel(const float* __restrict__ g, const float* __restrict__ lp,
                                                             const float* __restrict__ old, const float* __restrict__ adv,
                                                             const float* __restrict__ mask, const float* __restrict__ ref,
                                                             const float* __restrict__ row_w, long long total, int T,
                                                             Params P, float* __restrict__ g_lp, float* __restrict__ g_ent) {
  const float gs = g[0];
  for (long long i = (long long)blockIdx.x * kThreads + threadIdx.x; i < total; i += (long long)gridDim.x * kThreads) {
    const float m = mask[i];
    float gl = 0.f, ge = 0.f;
    if (m != 0.f) {
      const float w = gs * m * row_w[i / T];
      const Token k = surrogate(lp[i], old[i], adv[i], P);
      float d = k.dpg;
      if (P.use_kl) d += P.kl_coef * kl_grad(lp[i], ref[i], P.kl_type);
      gl = w * d;
      ge = -P.entropy_coef * w;
    }
    g_lp[i] = gl;
    if (g_ent) g_ent[i] = ge;
  }
}

bool bad(int B, int T, int kl_type, int mode, float clip_c) {
  return B < 0 || T < 0 || (kl_type != 1 && kl_type != 3) || mode < 0 || mode > 2 ||
         !(clip_c == 0.f || clip_c > 1.f);
}

}  // namespace

// All tensors fp32, contiguous [B, T] (ref/ent may be null). Writes out[9] = (loss, pg_loss, clip_frac,
// approx_kl, ratio_mean, kl, entropy, n_tokens, clip_frac_lower), row_w[B] (gradient weight of each row) and
// uses rows[B * 8] as scratch. mode: 0 token-mean, 1 seq-mean-token-sum, 2 seq-mean-token-mean; kl_type 1 or
// 3; clip_c: the dual-clip bound (> 1), or 0 for none.
extern "C" int sleuth_ppo_loss_forward(const float* lp, const float* old, const float* adv, const float* mask,
                                       const float* ref, const float* ent, int B, int T, float clip_low,
                                       float clip_high, float clip_c, float kl_coef, int kl_type,
                                       float entropy_coef, int mode, float* rows, float* out, float* row_w,
                                       void* stream) {
  if (bad(B, T, kl_type, mode, clip_c) || B == 0) return (int)cudaErrorInvalidValue;
  Params P{clip_low, clip_high, clip_c, kl_coef, entropy_coef, kl_type,
           (ref != nullptr && kl_coef > 0.f) ? 1 : 0, ent != nullptr ? 1 : 0, mode};
  cudaStream_t st = (cudaStream_t)stream;
  row_kernel<<<B, kThreads, 0, st>>>(lp, old, adv, mask, ref, ent, T, P, rows);
  int err = (int)cudaGetLastError();
  if (err) return err;
  finalize_kernel<<<1, kThreads, 0, st>>>(rows, B, P, out, row_w);
  return (int)cudaGetLastError();
}

// g: device pointer to the scalar upstream gradient. Writes g_lp [B, T] and, when g_ent is not null,
// g_ent [B, T] (has_ent says whether the forward had an entropy term).
extern "C" int sleuth_ppo_loss_backward(const float* g, const float* lp, const float* old, const float* adv,
                                        const float* mask, const float* ref, const float* row_w, int B, int T,
                                        float clip_low, float clip_high, float clip_c, float kl_coef,
                                        int kl_type, float entropy_coef, int has_ent, int mode, float* g_lp,
                                        float* g_ent, void* stream) {
  if (bad(B, T, kl_type, mode, clip_c)) return (int)cudaErrorInvalidValue;
  const long long total = (long long)B * T;
  if (total == 0) return 0;
  Params P{clip_low, clip_high, clip_c, kl_coef, entropy_coef, kl_type,
           (ref != nullptr && kl_coef > 0.f) ? 1 : 0, has_ent, mode};
  long long blocks = (total + kThreads - 1) / kThreads;
  if (blocks > 65535LL * 16) blocks = 65535LL * 16;
  backward_kernel<<<(unsigned)blocks, kThreads, 0, (cudaStream_t)stream>>>(g, lp, old, adv, mask, ref, row_w, total,
                                                                           T, P, g_lp, g_ent);
  return (int)cudaGetLastError();
}
