// One decoder layer of a decode-only step (float32, a few rows), as two calls that end where the
// layer's two collectives are (tensor parallelism all-reduces in between, in Python).
//
// Why: the same kernels called one by one from Python cost ~10 Python-level calls per layer,
// and each one, with the caches just flushed by the weight stream, took 5-30 us beyond its own
// work (rotary + KV write of one token: ~30 us). The arithmetic is exactly the modular path's:
// the same kernels in the same order, so results are bit-identical to it.
#include "cpu_kernels.h"

// [residual += x; x = rms_norm(residual)] (or x already normed: add_residual false), qkv
// projection, rotary + KV-cache write, paged attention, o projection (this rank's partial sum,
// without o's bias). Returns {partial o output, residual}.
std::vector<torch::Tensor> decode_attention_half(
    torch::Tensor x, torch::Tensor residual, bool add_residual, torch::Tensor norm_weight,
    double eps, torch::Tensor qkv_weight, c10::optional<torch::Tensor> qkv_bias,
    torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, double scale, torch::Tensor kv_index, torch::Tensor o_weight) {
  if (add_residual) add_rms_norm_(x, residual, norm_weight, eps);
  auto qkv = small_m_linear(x, qkv_weight, qkv_bias);
  rotary_write_kv_(qkv, cos, sin, Hq, Hkv, k_cache, v_cache, slot_mapping);
  const int64_t B = qkv.size(0), D = cos.size(1);
  auto q = qkv.view({B, Hq + 2 * Hkv, D}).narrow(1, 0, Hq);
  auto attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                     kv_index, 0);
  return {small_m_linear(attn.view({B, Hq * D}), o_weight, c10::nullopt), residual};
}

// [residual += x; x = rms_norm(residual)], gate/up projection, silu * up, down projection (this
// rank's partial sum, without down's bias). Returns {partial down output, residual}.
std::vector<torch::Tensor> decode_mlp_half(torch::Tensor x, torch::Tensor residual,
                                           torch::Tensor norm_weight, double eps,
                                           torch::Tensor gate_up_weight,
                                           c10::optional<torch::Tensor> gate_up_bias,
                                           torch::Tensor down_weight) {
  add_rms_norm_(x, residual, norm_weight, eps);
  auto h = silu_mul(small_m_linear(x, gate_up_weight, gate_up_bias));
  return {small_m_linear(h, down_weight, c10::nullopt), residual};
}
