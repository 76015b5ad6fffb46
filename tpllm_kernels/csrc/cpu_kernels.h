// The tensor-level CPU kernels the Python module exposes (bindings.cpp), for other translation
// units that compose them (decode_layer.cpp). Definitions: decode_attention.cpp,
// elementwise.cpp, shm_collectives.cpp, cpu_gemv.cpp, cpu_gemv_bf16.cpp, cpu_gemv_blocks.cpp,
// q8_head_screen.cpp, lora_delta.cpp, prefill_attention.cpp. Only ATen's Tensor here, not <torch/extension.h>: each translation unit
// that includes the latter costs ~15-30 s of the kernel build, so only those that bind Python
// types (bindings.cpp, decode_layer.cpp, thread_team_bindings.cpp) do.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

// window: a sliding window of that many keys (0: none); softcap: Gemma 2's attention logit
// soft-cap (0: none), in every attention kernel here
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  double scale, at::Tensor kv_index, int64_t num_splits,
                                  int64_t window = 0, double softcap = 0.0);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void rotary_write_kv_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t Hq,
                      int64_t Hkv, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor slot_mapping);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor small_m_linear(at::Tensor x, at::Tensor weight,
                             c10::optional<at::Tensor> bias);
// The *_into forms write a preallocated output (a fused decode step's workspace): between
// layers, with its code gone cold after the GEMVs, each tensor allocation was a visible cost.
void small_m_linear_into(const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, at::Tensor& y);
// small_m_linear_into from a weight's exact 4-bit or 8-bit block copy (cpu_gemv_blocks.cpp):
// the same bits
void small_m_linear_q4_into(const at::Tensor& x, const at::Tensor& q,
                            const at::Tensor& dm, const c10::optional<at::Tensor>& bias,
                            at::Tensor& y);
int64_t block_copy_max_rows();  // beyond them the weight itself is read
void small_m_linear_q8_into(const at::Tensor& x, const at::Tensor& q,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& bias,
                            at::Tensor& y);
// y[m] += B[a] @ (A[a] @ x[m]) for each row m with adapter a = ids[m] (1-based, 0: none), from
// a linear's stacked adapter weights (lora_delta.cpp says how they are laid out)
void lora_delta_into(const at::Tensor& x, at::Tensor& y, const at::Tensor& a,
                     const at::Tensor& bt, const at::Tensor& info, const at::Tensor& ids);
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);
void gelu_tanh_mul_into(const at::Tensor& gate_up, at::Tensor& out);
// per-head RMSNorm of the q and k heads of a fused qkv projection, in place (elementwise.cpp)
void qk_norm_(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight, int64_t Hq,
              int64_t Hkv, double eps);
void paged_decode_attention_into(at::Tensor q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, double scale,
                                 const at::Tensor& kv_index, int64_t num_splits,
                                 at::Tensor& out, int64_t window = 0, double softcap = 0.0);
bool bf16_gemv_supported();
// whether head_dim-64 decode attention touches each K/V block in address order first
// (attn_simd.h says why it is a switch; decode_attention.cpp)
void set_attention_touch_pass(bool on);
bool attention_touch_pass();
// inputs greedy_argmax_screened_q8 takes per pass over the head (8 AVX-512, 4 AVX2)
int64_t q8_screen_inputs();
at::Tensor small_m_linear_bf16(at::Tensor x, at::Tensor weight,
                                  c10::optional<at::Tensor> bias);
void small_m_linear_bf16_into(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, at::Tensor& y);
// every row's argmax of x @ weight^T and its logit, mostly from weight's bf16 copy (cpu_gemv_bf16.cpp)
std::vector<at::Tensor> greedy_argmax_screened(at::Tensor x, at::Tensor weight,
                                                  at::Tensor low, at::Tensor coef);
// the same from an int8 copy, x quantized per group for integer dot products (q8_head_screen.cpp)
std::vector<at::Tensor> greedy_argmax_screened_q8(at::Tensor x, at::Tensor weight,
                                                     at::Tensor q, at::Tensor scales,
                                                     at::Tensor coef, at::Tensor wq_norm);
// shm_all_reduce with the sum written to `out` (x itself allowed: a fused kernel's own partial,
// no allocation); returns whether every rank arrived within the spins (else out is untouched)
bool shm_all_reduce_into(const at::Tensor& x, at::Tensor& out, const at::Tensor& slots,
                         const at::Tensor& flags, int64_t rank, int64_t seq, int64_t max_spins);
c10::optional<at::Tensor> shm_all_reduce(at::Tensor x, at::Tensor slots,
                                            at::Tensor flags, int64_t rank, int64_t seq,
                                            int64_t max_spins);
// the slots' sum once every rank has published; rank 0's side of gather_first
at::Tensor shm_sum(at::Tensor x, at::Tensor slots);
c10::optional<at::Tensor> shm_gather_first(const at::Tensor& x, const at::Tensor& slots,
                                           const at::Tensor& flags, int64_t seq,
                                           int64_t max_spins, std::vector<int64_t> sizes);
// Query heads grouped by the KV head they read (kv_index[h], any map: uneven TP splits
// included): group kh is heads_by_kv[group_start[kh], group_start[kh + 1]).
inline void group_heads_by_kv(const int64_t* kv_index, int64_t Hq, int64_t Hkv,
                              std::vector<int64_t>& heads_by_kv,
                              std::vector<int64_t>& group_start) {
  heads_by_kv.clear();
  group_start.assign(Hkv + 1, 0);
  for (int64_t kh = 0; kh < Hkv; ++kh) {
    group_start[kh] = static_cast<int64_t>(heads_by_kv.size());
    for (int64_t h = 0; h < Hq; ++h)
      if (kv_index[h] == kh) heads_by_kv.push_back(h);
  }
  group_start[Hkv] = static_cast<int64_t>(heads_by_kv.size());
}

bool prefill_attention_supported(int64_t head_dim);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                   at::Tensor v_cache, at::Tensor block_table,
                                   int64_t context_len, double scale, at::Tensor kv_index,
                                   int64_t window = 0, double softcap = 0.0);
