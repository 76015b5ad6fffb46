// The tensor-level CPU kernels the Python module exposes, for other translation units that
// compose them (decode_layer.cpp). Definitions: cpu_kernels.cpp, cpu_gemv.cpp,
// cpu_gemv_bf16.cpp, prefill_attention.cpp.
#pragma once
#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, torch::Tensor kv_index, int64_t num_splits);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_write_kv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq,
                      int64_t Hkv, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight,
                             c10::optional<torch::Tensor> bias);
// The *_into forms write a preallocated output (a fused decode step's workspace): between
// layers, with its code gone cold after the GEMVs, each tensor allocation was a visible cost.
void small_m_linear_into(const torch::Tensor& x, const torch::Tensor& weight,
                         const c10::optional<torch::Tensor>& bias, torch::Tensor& y);
// small_m_linear_into from a weight's exact 4-bit or 8-bit block copy (cpu_gemv_blocks.cpp):
// the same bits
void small_m_linear_q4_into(const torch::Tensor& x, const torch::Tensor& q,
                            const torch::Tensor& dm, const c10::optional<torch::Tensor>& bias,
                            torch::Tensor& y);
int64_t block_copy_max_rows();  // beyond them the weight itself is read
void small_m_linear_q8_into(const torch::Tensor& x, const torch::Tensor& q,
                            const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                            torch::Tensor& y);
void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out);
void paged_decode_attention_into(torch::Tensor q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                 const torch::Tensor& context_lens, double scale,
                                 const torch::Tensor& kv_index, int64_t num_splits,
                                 torch::Tensor& out);
bool bf16_gemv_supported();
// inputs greedy_argmax_screened_q8 takes per pass over the head (8 AVX-512, 4 AVX2)
int64_t q8_screen_inputs();
torch::Tensor small_m_linear_bf16(torch::Tensor x, torch::Tensor weight,
                                  c10::optional<torch::Tensor> bias);
void small_m_linear_bf16_into(const torch::Tensor& x, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias, torch::Tensor& y);
// every row's argmax of x @ weight^T and its logit, mostly from weight's bf16 copy (cpu_gemv_bf16.cpp)
std::vector<torch::Tensor> greedy_argmax_screened(torch::Tensor x, torch::Tensor weight,
                                                  torch::Tensor low, torch::Tensor coef);
std::vector<torch::Tensor> greedy_argmax_screened_q8(torch::Tensor x, torch::Tensor weight,
                                                     torch::Tensor q, torch::Tensor scales,
                                                     torch::Tensor coef);
// shm_all_reduce with the sum written to `out` (x itself allowed: a fused kernel's own partial,
// no allocation); returns whether every rank arrived within the spins (else out is untouched)
bool shm_all_reduce_into(const torch::Tensor& x, torch::Tensor& out, const torch::Tensor& slots,
                         const torch::Tensor& flags, int64_t rank, int64_t seq, int64_t max_spins);
c10::optional<torch::Tensor> shm_all_reduce(torch::Tensor x, torch::Tensor slots,
                                            torch::Tensor flags, int64_t rank, int64_t seq,
                                            int64_t max_spins);
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
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_table,
                                      int64_t context_len, double scale, torch::Tensor kv_index);
void bind_decode_layer(pybind11::module& m);  // DecodeLayer and decode_stack
void bind_thread_team(pybind11::module& m);   // the worker team's switches (thread_team.cpp)
