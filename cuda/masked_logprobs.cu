// Fused masked log-prob kernels: the softmax statistics and the logit gradient of one vocabulary chunk.
//
// Spec: training.algos.losses.masked_lm_head_logprobs. The host side (training/model/csrc/sleuth_kernels.cpp) compacts
// the policy rows, then walks the vocabulary in chunks: it forms the chunk logits z = h W_c^T with cuBLAS
// (through torch, in the input dtype with fp32 accumulation) into an [n, c] buffer and calls
//   * sleuth_lse_chunk: per row, an online log-sum-exp update of the running (max m, sum s = sum e^(z-m),
//     sum sz = sum e^(z-m) z, target logit) in fp32; on the last chunk it writes
//     logprob = z_target - lse, entropy = lse - sz/s and lse = m + log s;
//   * sleuth_logit_grad (backward, on the recomputed chunk, in place):
//     dL/dz = g_lp (onehot(target) - p) - g_ent p (z - E_p[z]),  p = e^(z - lse),  E_p[z] = lse - entropy,
//     since d lp / dz = onehot - p and d H / dz = -p (z - E_p[z]).
// Nothing of size [n, V] is ever formed; the chunk buffer is [n, c] in the input dtype.
#include "common.cuh"
#include <cfloat>

namespace {

using namespace sleuth;

constexpr int kThreads = 256;

struct Stats {
  float m, s, sz;
};

// merge two online-softmax partial states (both may be empty: m = -inf, s = sz = 0)
__device__ __forceinline__ Stats merge(Stats x, Stats y) {
  const float m = fmaxf(x.m, y.m);
  if (m == -INFINITY) return {m, 0.f, 0.f};
  const float ex = expf(x.m - m), ey = expf(y.m - m);  // exp(-inf) = 0 for an empty side
  return {m, x.s * ex + y.s * ey, x.sz * ex + y.sz * ey};
}

__device__ __forceinline__ Stats shfl_stats(Stats v, int o) {
  return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o),
          __shfl_xor_sync(0xffffffffu, v.sz, o)};
}

// the online update of one thread's state by one logit (-inf contributes nothing: -inf - -inf would be NaN)
__device__ __forceinline__ void push(Stats& st, float v) {
  if (v == -INFINITY) return;
  if (v > st.m) {  // rescale the running sums to the new max
    const float r = expf(st.m - v);
    st.s = st.s * r + 1.f;
    st.sz = st.sz * r + v;
    st.m = v;
  } else {
    const float e = expf(v - st.m);
    st.s += e;
    st.sz += e * v;
  }
}

// 16-byte vectors of T (8 bf16/fp16 or 4 fp32): one load or store instruction per vector
template <typename T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
  union {
    uint4 raw;
    T v[N];
  };
};

// z rows can be read as 16-byte vectors: aligned base and a row stride that keeps every row aligned
template <typename T>
bool vectorizable(const void* z, long long ldz) {
  return reinterpret_cast<uintptr_t>(z) % 16 == 0 && ldz % Vec<T>::N == 0;
}

// one block per compacted row: chunk statistics, merged into the running per-row state. With vec, the row
// is read in 16-byte vectors, each folded into the state with one rescale (its own max first); the
// remaining c % N columns are read one by one.
template <typename T>
__global__ void __launch_bounds__(kThreads) lse_chunk_kernel(const T* __restrict__ z, long long ldz, int c,
                                                              long long start, const long long* __restrict__ targets,
                                                              float* __restrict__ run_m, float* __restrict__ run_s,
                                                              float* __restrict__ run_sz, float* __restrict__ run_tgt,
                                                              int finalize, float* __restrict__ out_lp,
                                                              float* __restrict__ out_ent, float* __restrict__ out_lse,
                                                              int vec) {
  constexpr int N = Vec<T>::N;
  __shared__ Stats sm[kThreads / 32];
  const long long row = blockIdx.x;
  const T* zr = z + row * ldz;
  Stats st{-INFINITY, 0.f, 0.f};
  const int nvec = vec ? c / N : 0;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    Vec<T> x;
    x.raw = reinterpret_cast<const uint4*>(zr)[i];
    float f[N];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      f[k] = to_f32(x.v[k]);
      mx = fmaxf(mx, f[k]);
    }
    if (mx == -INFINITY) continue;
    if (mx > st.m) {
      const float r = expf(st.m - mx);  // 0 while the state is empty
      st.s *= r;
      st.sz *= r;
      st.m = mx;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const bool fin = f[k] != -INFINITY;
      const float e = fin ? expf(f[k] - st.m) : 0.f;
      st.s += e;
      st.sz += fin ? e * f[k] : 0.f;
    }
  }
  for (int j = nvec * N + threadIdx.x; j < c; j += kThreads) push(st, to_f32(zr[j]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) st = merge(st, shfl_stats(st, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sm[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stats acc{run_m[row], run_s[row], run_sz[row]};
    for (int w = 0; w < kThreads / 32; ++w) acc = merge(acc, sm[w]);
    float tgt = run_tgt[row];
    const long long t = targets[row] - start;
    if (t >= 0 && t < c) tgt = to_f32(zr[t]);
    if (finalize) {
      const float lse = acc.m + logf(acc.s);
      out_lp[row] = tgt - lse;
      out_ent[row] = lse - acc.sz / acc.s;
      out_lse[row] = lse;
    } else {
      run_m[row] = acc.m;
      run_s[row] = acc.s;
      run_sz[row] = acc.sz;
      run_tgt[row] = tgt;
    }
  }
}

__device__ __forceinline__ float logit_grad(float v, bool is_target, float l, float ez, float gl, float ge) {
  const float p = expf(v - l);
  float g = -gl * p - ge * p * (v - ez);
  if (is_target) g += gl;
  return g;
}

// one block per row; in place on the chunk buffer (16-byte vectors when vec, then the c % N tail)
template <typename T>
__global__ void __launch_bounds__(kThreads) logit_grad_kernel(T* __restrict__ z, long long ldz, int c, long long start,
                                                               const long long* __restrict__ targets,
                                                               const float* __restrict__ lse,
                                                               const float* __restrict__ ent,
                                                               const float* __restrict__ g_lp,
                                                               const float* __restrict__ g_ent, int vec) {
  constexpr int N = Vec<T>::N;
  const long long row = blockIdx.x;
  T* zr = z + row * ldz;
  const float l = lse[row];
  const float ez = l - ent[row];  // E_p[z]
  const float gl = g_lp ? g_lp[row] : 0.f;
  const float ge = g_ent ? g_ent[row] : 0.f;
  const long long t = targets[row] - start;
  const int nvec = vec ? c / N : 0;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    Vec<T> x;
    x.raw = reinterpret_cast<const uint4*>(zr)[i];
#pragma unroll
    for (int k = 0; k < N; ++k) x.v[k] = from_f32<T>(logit_grad(to_f32(x.v[k]), i * N + k == t, l, ez, gl, ge));
    reinterpret_cast<uint4*>(zr)[i] = x.raw;
  }
  for (int j = nvec * N + threadIdx.x; j < c; j += kThreads) zr[j] = from_f32<T>(logit_grad(to_f32(zr[j]), j == t, l, ez, gl, ge));
}

template <typename T>
int launch_lse(const void* z, long long ldz, long long n, int c, long long start, const long long* targets,
               float* m, float* s, float* sz, float* tgt, int finalize, float* lp, float* ent, float* lse,
               cudaStream_t stream) {
  lse_chunk_kernel<T><<<(unsigned)n, kThreads, 0, stream>>>((const T*)z, ldz, c, start, targets, m, s, sz, tgt,
                                                             finalize, lp, ent, lse, vectorizable<T>(z, ldz) ? 1 : 0);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_grad(void* z, long long ldz, long long n, int c, long long start, const long long* targets,
                const float* lse, const float* ent, const float* g_lp, const float* g_ent, cudaStream_t stream) {
  logit_grad_kernel<T><<<(unsigned)n, kThreads, 0, stream>>>((T*)z, ldz, c, start, targets, lse, ent, g_lp, g_ent,
                                                              vectorizable<T>(z, ldz) ? 1 : 0);
  return (int)cudaGetLastError();
}

bool bad_sizes(long long n, int c, long long ldz) {
  return n < 0 || n > 0x7fffffffLL || c <= 0 || ldz < c;
}

}  // namespace

// z: [n, c] chunk logits (row stride ldz) of dtype `dtype` (sleuth::DType); targets: [n] int64 vocabulary
// ids; m/s/sz/tgt: [n] fp32 running state (initialise m = -inf, the rest 0); start: the chunk's first
// vocabulary id. With finalize != 0 (the last chunk) writes lp/ent/lse [n] fp32 instead of the state.
extern "C" int sleuth_lse_chunk(const void* z, long long ldz, long long n, int c, long long start, int dtype,
                                const long long* targets, float* m, float* s, float* sz, float* tgt, int finalize,
                                float* lp, float* ent, float* lse, void* stream) {
  if (bad_sizes(n, c, ldz)) return (int)cudaErrorInvalidValue;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case sleuth::kFloat32: return launch_lse<float>(z, ldz, n, c, start, targets, m, s, sz, tgt, finalize, lp, ent, lse, st);
    case sleuth::kBFloat16: return launch_lse<__nv_bfloat16>(z, ldz, n, c, start, targets, m, s, sz, tgt, finalize, lp, ent, lse, st);
    case sleuth::kFloat16: return launch_lse<__half>(z, ldz, n, c, start, targets, m, s, sz, tgt, finalize, lp, ent, lse, st);
    default: return (int)cudaErrorInvalidValue;
  }
}

// In place: z [n, c] (row stride ldz) chunk logits -> dL/dz for the chunk. lse/ent: [n] fp32 from the
// forward; g_lp/g_ent: [n] fp32 upstream gradients (either may be null: zero).
extern "C" int sleuth_logit_grad(void* z, long long ldz, long long n, int c, long long start, int dtype,
                                 const long long* targets, const float* lse, const float* ent, const float* g_lp,
                                 const float* g_ent, void* stream) {
  if (bad_sizes(n, c, ldz)) return (int)cudaErrorInvalidValue;
  if (n == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  switch (dtype) {
    case sleuth::kFloat32: return launch_grad<float>(z, ldz, n, c, start, targets, lse, ent, g_lp, g_ent, st);
    case sleuth::kBFloat16: return launch_grad<__nv_bfloat16>(z, ldz, n, c, start, targets, lse, ent, g_lp, g_ent, st);
    case sleuth::kFloat16: return launch_grad<__half>(z, ldz, n, c, start, targets, lse, ent, g_lp, g_ent, st);
    default: return (int)cudaErrorInvalidValue;
  }
}
