// Torch bindings of Sleuth's CUDA kernels (cuda/*.cu).
//
// Includes only torch/extension.h (the CPU torch wheel lacks torch's CUDA headers); the kernels are reached
// through extern "C" launchers that take raw device pointers and the cudaStream_t as an opaque pointer,
// which Python passes as an integer (torch.cuda.current_stream().cuda_stream). The matmuls of the fused
// masked log-prob run through torch (cuBLAS) on torch's current stream, which is the stream passed in, so
// torch ops and kernels stay ordered. Built by training/model/kernels.py (torch.utils.cpp_extension.load).
#include <torch/extension.h>

#include <optional>
#include <vector>

extern "C" {
int sleuth_span_mask(const long long* token_ids, const long long* lengths, const long long* prompt_lengths, int B,
                     int T, const long long* open_ids, int n_open, const long long* close_ids, int n_close,
                     unsigned char* mask, int* turn, void* stream);
int sleuth_lse_chunk(const void* z, long long ldz, long long n, int c, long long start, int dtype,
                     const long long* targets, float* m, float* s, float* sz, float* tgt, int finalize, float* lp,
                     float* ent, float* lse, void* stream);
int sleuth_logit_grad(void* z, long long ldz, long long n, int c, long long start, int dtype,
                      const long long* targets, const float* lse, const float* ent, const float* g_lp,
                      const float* g_ent, void* stream);
int sleuth_ppo_loss_forward(const float* lp, const float* old, const float* adv, const float* mask, const float* ref,
                            const float* ent, int B, int T, float clip_low, float clip_high, float clip_c,
                            float kl_coef, int kl_type, float entropy_coef, int mode, float* rows, float* out,
                            float* row_w, void* stream);
int sleuth_ppo_loss_backward(const float* g, const float* lp, const float* old, const float* adv,
                             const float* mask, const float* ref, const float* row_w, int B, int T, float clip_low,
                             float clip_high, float clip_c, float kl_coef, int kl_type, float entropy_coef,
                             int has_ent, int mode, float* g_lp, float* g_ent, void* stream);
const char* sleuth_cuda_error_string(int err);
}

namespace {

void check_cuda(int err, const char* what) {
  TORCH_CHECK(err == 0, "sleuth CUDA kernel ", what, " failed: ", sleuth_cuda_error_string(err), " (", err, ")");
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

void check_cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "unsupported dtype ", t, " (float32, bfloat16 or float16)");
  }
  return -1;
}

const float* opt_ptr(const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_cuda_tensor(*t, name);
  TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32");
  return t->data_ptr<float>();
}

// ---- span mask ---------------------------------------------------------------------------------------
std::vector<at::Tensor> span_mask(const at::Tensor& token_ids, const at::Tensor& lengths,
                                  const at::Tensor& prompt_lengths, std::vector<int64_t> open_ids,
                                  std::vector<int64_t> close_ids, int64_t stream) {
  check_cuda_tensor(token_ids, "token_ids");
  check_cuda_tensor(lengths, "lengths");
  check_cuda_tensor(prompt_lengths, "prompt_lengths");
  TORCH_CHECK(token_ids.dim() == 2, "token_ids must be [B, T]");
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  prompt_lengths.scalar_type() == at::kLong,
              "token_ids, lengths and prompt_lengths must be int64");
  const int64_t B = token_ids.size(0), T = token_ids.size(1);
  TORCH_CHECK(lengths.numel() == B && prompt_lengths.numel() == B, "lengths/prompt_lengths must be [B]");
  TORCH_CHECK(B < (1LL << 31) && T < (1LL << 31), "too many rows or tokens");
  auto mask = at::empty({B, T}, token_ids.options().dtype(at::kBool));
  auto turn = at::empty({B, T}, token_ids.options().dtype(at::kInt));
  std::vector<long long> o(open_ids.begin(), open_ids.end()), c(close_ids.begin(), close_ids.end());
  check_cuda(sleuth_span_mask(reinterpret_cast<const long long*>(token_ids.data_ptr<int64_t>()),
                              reinterpret_cast<const long long*>(lengths.data_ptr<int64_t>()),
                              reinterpret_cast<const long long*>(prompt_lengths.data_ptr<int64_t>()), (int)B, (int)T,
                              o.data(), (int)o.size(), c.data(), (int)c.size(),
                              reinterpret_cast<unsigned char*>(mask.data_ptr<bool>()), turn.data_ptr<int>(),
                              as_stream(stream)),
             "span_mask");
  return {mask, turn};
}

// ---- fused masked log-prob -----------------------------------------------------------------------------
// Work is tiled as row blocks (of the compacted policy rows) x vocabulary chunks, so the working set is one
// [row_block, chunk] logits buffer plus [row_block, H] rows, whatever the number of tokens: the memory
// above the outputs no longer grows with N (as in Liger-Kernel's fused linear cross-entropy, which blocks
// rows too). Each row block gathers its rows of `hidden` by index (no compacted [n, H] copy).
void check_lm_inputs(const at::Tensor& hidden, const at::Tensor& idx, const at::Tensor& w, const at::Tensor& tgt,
                     int64_t chunk, int64_t row_block) {
  check_cuda_tensor(hidden, "hidden");
  check_cuda_tensor(idx, "index");
  check_cuda_tensor(w, "weight");
  check_cuda_tensor(tgt, "targets");
  TORCH_CHECK(hidden.dim() == 2 && w.dim() == 2 && hidden.size(1) == w.size(1),
              "hidden [N, H] and weight [V, H] expected");
  TORCH_CHECK(hidden.scalar_type() == w.scalar_type(), "hidden and weight must have the same dtype");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1, "index must be int64 [n]");
  TORCH_CHECK(tgt.scalar_type() == at::kLong && tgt.numel() == idx.numel(), "targets must be int64 [n]");
  TORCH_CHECK(chunk > 0 && chunk < (1LL << 31), "chunk_size must be positive");
  TORCH_CHECK(row_block > 0 && row_block < (1LL << 31), "row_block must be positive");
  dtype_code(hidden.scalar_type());
}

// hidden: [N, H]; idx: [n] rows of hidden at policy positions; w: [V, H]; tgt: [n] targets of those rows.
// Returns (logprob [n], entropy [n], lse [n]) fp32.
std::vector<at::Tensor> masked_logprobs_fwd(const at::Tensor& hidden, const at::Tensor& idx, const at::Tensor& w,
                                            const at::Tensor& tgt, int64_t chunk, int64_t row_block,
                                            int64_t stream) {
  check_lm_inputs(hidden, idx, w, tgt, chunk, row_block);
  const int64_t n = idx.numel(), V = w.size(0);
  auto f32 = hidden.options().dtype(at::kFloat);
  auto lp = at::empty({n}, f32), ent = at::empty({n}, f32), lse = at::empty({n}, f32);
  if (n == 0) return {lp, ent, lse};
  auto m = at::full({n}, -std::numeric_limits<float>::infinity(), f32);
  auto s = at::zeros({n}, f32), sz = at::zeros({n}, f32), tl = at::zeros({n}, f32);
  const int64_t cmax = std::min(chunk, V), rmax = std::min(row_block, n);
  auto buf = at::empty({rmax * cmax}, hidden.options());
  const int code = dtype_code(hidden.scalar_type());
  const auto* tp = reinterpret_cast<const long long*>(tgt.data_ptr<int64_t>());
  for (int64_t r0 = 0; r0 < n; r0 += rmax) {
    const int64_t r = std::min(rmax, n - r0);
    auto h = hidden.index_select(0, idx.narrow(0, r0, r));
    for (int64_t start = 0; start < V; start += cmax) {
      const int64_t c = std::min(cmax, V - start);
      auto z = buf.narrow(0, 0, r * c).view({r, c});
      at::mm_out(z, h, w.narrow(0, start, c).t());
      check_cuda(sleuth_lse_chunk(z.data_ptr(), c, r, (int)c, start, code, tp + r0, m.data_ptr<float>() + r0,
                                  s.data_ptr<float>() + r0, sz.data_ptr<float>() + r0, tl.data_ptr<float>() + r0,
                                  start + c >= V, lp.data_ptr<float>() + r0, ent.data_ptr<float>() + r0,
                                  lse.data_ptr<float>() + r0, as_stream(stream)),
                 "lse_chunk");
    }
  }
  return {lp, ent, lse};
}

// dh += g @ w_c in fp32: for bf16/fp16 inputs cuBLAS accumulates into the fp32 dh in place (addmm.dtype_out,
// torch >= 2.8), so no [rows, H] fp32 temporary is written and read back per chunk
void accumulate_dh(at::Tensor& dh, const at::Tensor& g, const at::Tensor& wc) {
  if (g.scalar_type() == at::kFloat) {
    dh.addmm_(g, wc);
    return;
  }
  try {
    at::addmm_out(dh, dh, g, wc, at::kFloat);  // in place: cuBLAS beta = 1 with an fp32 output (addmm.dtype_out)
  } catch (const c10::Error&) {
    dh.add_(at::mm(g, wc));  // fallback: the chunk product rounded to the input dtype, summed in fp32
  }
}

// Returns (dhidden [N, H] in hidden's dtype, zero outside idx, or undefined; dw [V, H] in w's dtype or
// undefined). dh of a row block is accumulated over the vocabulary chunks in fp32 and rounded once; dw is
// accumulated over row blocks in w's dtype (cuBLAS beta = 1: fp32 arithmetic, one rounding per row block, as
// Liger-Kernel's default).
std::vector<at::Tensor> masked_logprobs_bwd(const at::Tensor& hidden, const at::Tensor& idx, const at::Tensor& w,
                                            const at::Tensor& tgt, const at::Tensor& lse, const at::Tensor& ent,
                                            const std::optional<at::Tensor>& g_lp,
                                            const std::optional<at::Tensor>& g_ent, int64_t chunk,
                                            int64_t row_block, bool need_dh, bool need_dw, int64_t stream) {
  check_lm_inputs(hidden, idx, w, tgt, chunk, row_block);
  check_cuda_tensor(lse, "lse");
  check_cuda_tensor(ent, "entropy");
  const int64_t n = idx.numel(), V = w.size(0), H = hidden.size(1);
  const float* glp = opt_ptr(g_lp, "grad_logprobs");
  const float* gent = opt_ptr(g_ent, "grad_entropy");
  at::Tensor dhid, dw;
  const bool work = n > 0 && (glp != nullptr || gent != nullptr) && (need_dh || need_dw);
  if (need_dh) dhid = at::zeros_like(hidden);  // rows outside idx stay zero
  // the first row block writes every chunk of dw (beta = 0), so it needs no zero fill (a V x H write)
  if (need_dw) dw = work ? at::empty({V, H}, w.options()) : at::zeros({V, H}, w.options());
  if (!work) return {dhid, dw};
  const int64_t cmax = std::min(chunk, V), rmax = std::min(row_block, n);
  auto buf = at::empty({rmax * cmax}, hidden.options());
  at::Tensor dh_buf;
  if (need_dh) dh_buf = at::empty({rmax, H}, hidden.options().dtype(at::kFloat));
  const int code = dtype_code(hidden.scalar_type());
  const auto* tp = reinterpret_cast<const long long*>(tgt.data_ptr<int64_t>());
  for (int64_t r0 = 0; r0 < n; r0 += rmax) {
    const int64_t r = std::min(rmax, n - r0);
    auto rows = idx.narrow(0, r0, r);
    auto h = hidden.index_select(0, rows);
    at::Tensor dh;
    if (need_dh) dh = dh_buf.narrow(0, 0, r).zero_();
    for (int64_t start = 0; start < V; start += cmax) {
      const int64_t c = std::min(cmax, V - start);
      auto wc = w.narrow(0, start, c);
      auto z = buf.narrow(0, 0, r * c).view({r, c});
      at::mm_out(z, h, wc.t());
      check_cuda(sleuth_logit_grad(z.data_ptr(), c, r, (int)c, start, code, tp + r0, lse.data_ptr<float>() + r0,
                                   ent.data_ptr<float>() + r0, glp ? glp + r0 : nullptr,
                                   gent ? gent + r0 : nullptr, as_stream(stream)),
                 "logit_grad");
      if (need_dh) accumulate_dh(dh, z, wc);
      if (need_dw) {
        auto dwc = dw.narrow(0, start, c);
        if (r0 == 0) at::mm_out(dwc, z.t(), h);
        else dwc.addmm_(z.t(), h);
      }
    }
    if (need_dh) dhid.index_copy_(0, rows, dh.to(hidden.scalar_type()));
  }
  return {dhid, dw};
}

// ---- fused masked log-prob + loss gradient, one row block at a time (opt-in: training/model/fused_loss.py) ----
// The block's whole [r, V] logits stay in `buf` (row stride V): the forward fills it chunk by chunk and reads
// each chunk's statistics right after its matmul (while it is in L2); Python then computes the loss's
// per-token gradients from the block's log-probs, and the backward turns the buffer into dL/dz in place and
// forms dH and dW from it: three LM-head matmuls per row instead of four (no recompute).

// hidden: [N, H]; rows: [r] rows of hidden; w: [V, H]; tgt: [r]; buf: >= r * V elements of hidden's dtype.
// Returns (logprob [r], entropy [r], lse [r]) fp32 and the gathered rows h [r, H] (for the backward).
std::vector<at::Tensor> fused_block_fwd(const at::Tensor& hidden, const at::Tensor& rows, const at::Tensor& w,
                                        const at::Tensor& tgt, at::Tensor& buf, int64_t chunk, int64_t stream) {
  check_lm_inputs(hidden, rows, w, tgt, chunk, 1);
  check_cuda_tensor(buf, "buffer");
  const int64_t r = rows.numel(), V = w.size(0);
  TORCH_CHECK(buf.scalar_type() == hidden.scalar_type() && buf.numel() >= r * V, "buffer must hold r * V of hidden's dtype");
  auto f32 = hidden.options().dtype(at::kFloat);
  auto lp = at::empty({r}, f32), ent = at::empty({r}, f32), lse = at::empty({r}, f32);
  auto h = hidden.index_select(0, rows);
  if (r == 0) return {lp, ent, lse, h};
  auto m = at::full({r}, -std::numeric_limits<float>::infinity(), f32);
  auto s = at::zeros({r}, f32), sz = at::zeros({r}, f32), tl = at::zeros({r}, f32);
  auto z = buf.narrow(0, 0, r * V).view({r, V});
  const int64_t cmax = std::min(chunk, V);
  const int code = dtype_code(hidden.scalar_type());
  const auto* tp = reinterpret_cast<const long long*>(tgt.data_ptr<int64_t>());
  for (int64_t start = 0; start < V; start += cmax) {
    const int64_t c = std::min(cmax, V - start);
    auto zc = z.narrow(1, start, c);  // [r, c] with row stride V: cuBLAS writes it in place (ldc = V)
    at::mm_out(zc, h, w.narrow(0, start, c).t());
    check_cuda(sleuth_lse_chunk(zc.data_ptr(), V, r, (int)c, start, code, tp, m.data_ptr<float>(), s.data_ptr<float>(),
                                sz.data_ptr<float>(), tl.data_ptr<float>(), start + c >= V, lp.data_ptr<float>(),
                                ent.data_ptr<float>(), lse.data_ptr<float>(), as_stream(stream)),
               "lse_chunk");
  }
  return {lp, ent, lse, h};
}

// In place: buf's [r, V] logits -> dL/dz (g_lp / g_ent: [r] fp32, either may be undefined: zero). Then
// dhid[rows] = dz W (one matmul over the whole vocabulary, fp32 accumulation, rounded once) and dw = dz^T h
// (first block: beta = 0, so dw needs no zero fill) or dw += dz^T h. Either output may be undefined.
void fused_block_bwd(at::Tensor& buf, const at::Tensor& h, const at::Tensor& rows, const at::Tensor& w,
                     const at::Tensor& tgt, const at::Tensor& lse, const at::Tensor& ent,
                     const std::optional<at::Tensor>& g_lp, const std::optional<at::Tensor>& g_ent,
                     std::optional<at::Tensor> dhid, std::optional<at::Tensor> dw, bool first, int64_t stream) {
  check_cuda_tensor(buf, "buffer");
  check_cuda_tensor(h, "rows of hidden");
  check_cuda_tensor(rows, "index");
  check_cuda_tensor(w, "weight");
  check_cuda_tensor(tgt, "targets");
  check_cuda_tensor(lse, "lse");
  check_cuda_tensor(ent, "entropy");
  const int64_t r = rows.numel(), V = w.size(0);
  TORCH_CHECK(h.dim() == 2 && h.size(0) == r && h.size(1) == w.size(1), "h must be [r, H]");
  TORCH_CHECK(tgt.scalar_type() == at::kLong && tgt.numel() == r && lse.numel() == r && ent.numel() == r,
              "targets, lse and entropy must have r entries");
  TORCH_CHECK(buf.scalar_type() == h.scalar_type() && w.scalar_type() == h.scalar_type() && buf.numel() >= r * V,
              "buffer, rows and weight must share a dtype; the buffer must hold r * V");
  if (r == 0) return;
  const float* glp = opt_ptr(g_lp, "grad_logprobs");
  const float* gent = opt_ptr(g_ent, "grad_entropy");
  auto z = buf.narrow(0, 0, r * V).view({r, V});
  check_cuda(sleuth_logit_grad(z.data_ptr(), V, r, (int)V, 0, dtype_code(h.scalar_type()),
                               reinterpret_cast<const long long*>(tgt.data_ptr<int64_t>()), lse.data_ptr<float>(),
                               ent.data_ptr<float>(), glp, gent, as_stream(stream)),
             "logit_grad");
  if (dhid.has_value() && dhid->defined()) {
    check_cuda_tensor(*dhid, "dhidden");
    dhid->index_copy_(0, rows, at::mm(z, w));
  }
  if (dw.has_value() && dw->defined()) {
    check_cuda_tensor(*dw, "dweight");
    if (first) at::mm_out(*dw, z.t(), h);
    else dw->addmm_(z.t(), h);
  }
}

// ---- masked PPO-clip loss ------------------------------------------------------------------------------
void check_loss_inputs(const at::Tensor& lp, const at::Tensor& old, const at::Tensor& adv, const at::Tensor& mask) {
  for (auto [t, name] : {std::pair{&lp, "logprobs"}, {&old, "old_logprobs"}, {&adv, "advantages"}, {&mask, "mask"}}) {
    check_cuda_tensor(*t, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat, name, " must be float32");
    TORCH_CHECK(t->sizes() == lp.sizes(), name, " must have the shape of logprobs");
  }
  TORCH_CHECK(lp.dim() == 2, "logprobs must be [B, T]");
  TORCH_CHECK(lp.size(0) > 0 && lp.size(0) < (1LL << 31) && lp.size(1) < (1LL << 31), "bad [B, T]");
}

// Returns (out [9]: loss, pg_loss, clip_frac, approx_kl, ratio_mean, kl, entropy, n_tokens, clip_frac_lower;
// row_w [B]). clip_c: the dual-clip bound (> 1), or 0 for none.
std::vector<at::Tensor> ppo_loss_fwd(const at::Tensor& lp, const at::Tensor& old, const at::Tensor& adv,
                                     const at::Tensor& mask, const std::optional<at::Tensor>& ref,
                                     const std::optional<at::Tensor>& ent, double clip_low, double clip_high,
                                     double clip_c, double kl_coef, int64_t kl_type, double entropy_coef,
                                     int64_t mode, int64_t stream) {
  check_loss_inputs(lp, old, adv, mask);
  const float* refp = opt_ptr(ref, "ref_logprobs");
  const float* entp = opt_ptr(ent, "entropy");
  if (refp) TORCH_CHECK(ref->sizes() == lp.sizes(), "ref_logprobs must have the shape of logprobs");
  if (entp) TORCH_CHECK(ent->sizes() == lp.sizes(), "entropy must have the shape of logprobs");
  const int64_t B = lp.size(0), T = lp.size(1);
  auto f32 = lp.options();
  TORCH_CHECK(clip_c == 0.0 || clip_c > 1.0, "dual-clip needs clip_ratio_c > 1, got ", clip_c);
  auto rows = at::empty({B, 8}, f32), out = at::empty({9}, f32), row_w = at::empty({B}, f32);  // rows: kRowStats
  check_cuda(sleuth_ppo_loss_forward(lp.data_ptr<float>(), old.data_ptr<float>(), adv.data_ptr<float>(),
                                     mask.data_ptr<float>(), refp, entp, (int)B, (int)T, (float)clip_low,
                                     (float)clip_high, (float)clip_c, (float)kl_coef, (int)kl_type,
                                     (float)entropy_coef, (int)mode, rows.data_ptr<float>(), out.data_ptr<float>(),
                                     row_w.data_ptr<float>(), as_stream(stream)),
             "ppo_loss_forward");
  return {out, row_w};
}

// g: [1] fp32 upstream gradient of the loss. Returns (grad_logprobs [B, T], grad_entropy [B, T] or undefined).
std::vector<at::Tensor> ppo_loss_bwd(const at::Tensor& g, const at::Tensor& lp, const at::Tensor& old,
                                     const at::Tensor& adv, const at::Tensor& mask,
                                     const std::optional<at::Tensor>& ref, const at::Tensor& row_w, double clip_low,
                                     double clip_high, double clip_c, double kl_coef, int64_t kl_type,
                                     double entropy_coef, bool has_ent, bool need_g_ent, int64_t mode, int64_t stream) {
  check_loss_inputs(lp, old, adv, mask);
  check_cuda_tensor(g, "grad");
  check_cuda_tensor(row_w, "row_w");
  const float* refp = opt_ptr(ref, "ref_logprobs");
  const int64_t B = lp.size(0), T = lp.size(1);
  auto g_lp = at::empty_like(lp);
  at::Tensor g_ent;
  if (need_g_ent) g_ent = at::empty_like(lp);
  check_cuda(sleuth_ppo_loss_backward(g.data_ptr<float>(), lp.data_ptr<float>(), old.data_ptr<float>(),
                                      adv.data_ptr<float>(), mask.data_ptr<float>(), refp, row_w.data_ptr<float>(),
                                      (int)B, (int)T, (float)clip_low, (float)clip_high, (float)clip_c,
                                      (float)kl_coef, (int)kl_type, (float)entropy_coef, has_ent ? 1 : 0, (int)mode,
                                      g_lp.data_ptr<float>(), need_g_ent ? g_ent.data_ptr<float>() : nullptr,
                                      as_stream(stream)),
             "ppo_loss_backward");
  return {g_lp, g_ent};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sleuth CUDA kernels: span mask, fused masked LM-head log-probs, masked PPO-clip loss";
  m.def("span_mask", &span_mask, "loss mask and turn index from tool-span markers");
  m.def("masked_logprobs_fwd", &masked_logprobs_fwd, "chunked online log-sum-exp over the vocabulary");
  m.def("masked_logprobs_bwd", &masked_logprobs_bwd, "grads of hidden and LM-head weight, chunk by chunk");
  m.def("fused_block_fwd", &fused_block_fwd, "one row block's logits and statistics, kept for its gradient");
  m.def("fused_block_bwd", &fused_block_bwd, "one row block's dL/dz in place, then its dH rows and dW");
  m.def("ppo_loss_fwd", &ppo_loss_fwd, "masked PPO-clip loss and stats");
  m.def("ppo_loss_bwd", &ppo_loss_bwd, "per-token gradients of the masked PPO-clip loss");
}
