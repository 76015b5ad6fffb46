// The decoder layers of a decode-only step (float32, or bf16 at one rank; a few rows) in C++:
// every layer in one call (decode_stack: one rank; decode_stack_tp: a tensor-parallel rank, each
// layer half ending in its shared-memory all-reduce), or a layer as two calls split at its two collectives (the halves:
// when the all-reduces go through Python, e.g. over gloo).
//
// Why: the same kernels called one by one from Python cost ~10 Python-level calls per layer,
// and each one, with the caches just flushed by the weight stream, cost about as much again as
// its own work for one token. The arithmetic is exactly the modular path's:
// the same kernels in the same order, so results are bit-identical to it. That includes LoRA
// adapters: a step with adapter rows passes each row's adapter id, and every projection an
// adapter targets adds its rows' deltas (lora_delta.cpp, as the modular LoraSlot does) before
// its bias-free partial sum goes to the collective.
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "cpu_kernels.h"

#include <array>
#include <atomic>
#include <chrono>
#include <tuple>

namespace {

// Where a decode step's layer time goes, measured in place for `python -m client bench
// step-parts`: wall seconds of each part of the halves, summed while switched on. Timed apart
// from the step, a part streams its bytes without the others' traffic around it and misses what
// the step does between them; in place it is what the step spends. Off by default: one relaxed
// load per part.
namespace part_timing {
enum Part { kNorm, kQkv, kRotaryKv, kAttention, kO, kGateUp, kSilu, kDown, kBias, kCount };
constexpr std::array<const char*, kCount> kNames = {
    "norm", "qkv", "rotary_kv", "attention", "o", "gate_up", "silu", "down", "bias"};
std::atomic<bool> enabled{false};
std::array<double, kCount> seconds{};
int64_t layers = 0;  // attention halves timed

template <class F>
inline void timed(Part part, F&& f) {
  if (!enabled.load(std::memory_order_relaxed)) {
    f();
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  f();
  seconds[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace part_timing

// A linear's weight as the decode step reads it: the float32 / bf16 tensor, or (float32 only)
// its exact block copy where there is one (cpu_gemv_blocks.cpp; same bits, a sixth (bits 4)
// or a quarter (bits 8) of the bytes)
struct Weight {
  at::Tensor w;
  int64_t bits = 0;  // 0: no copy
  c10::optional<at::Tensor> codes, scales;
  int64_t rows() const { return w.size(0); }
};

// x @ weight^T (+ bias) into y: float32, or bfloat16 (a few rows; sums in float32, y rounded
// once), as cpu_ops.linear computes them for the modular path
void linear_into(const at::Tensor& x, const Weight& weight,
                 const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const bool copy = x.scalar_type() == at::kFloat && x.size(0) <= block_copy_max_rows();
  if (copy && weight.bits == 4)
    small_m_linear_q4_into(x, *weight.codes, *weight.scales, bias, y);
  else if (copy && weight.bits == 8)
    small_m_linear_q8_into(x, *weight.codes, *weight.scales, bias, y);
  else if (weight.w.scalar_type() == at::kBFloat16)
    small_m_linear_bf16_into(x, weight.w, bias, y);
  else
    small_m_linear_into(x, weight.w, bias, y);
}

// A linear's LoRA adapters, all stacked (lora_delta.cpp): A, B transposed, the layout
struct Lora {
  at::Tensor a, bt, info;
};

// linear_into, then (a step with adapter rows: ids) each such row's adapter delta
void project(const at::Tensor& x, const Weight& weight,
             const c10::optional<at::Tensor>& bias, const c10::optional<Lora>& lora,
             const c10::optional<at::Tensor>& ids, at::Tensor& y) {
  linear_into(x, weight, bias, y);
  if (lora.has_value() && ids.has_value()) lora_delta_into(x, y, lora->a, lora->bt, lora->info, *ids);
}

// A decode step's intermediates for B rows, allocated once per call of a whole stack instead of
// in every layer (an allocation there is slow: its code gone cold after the GEMVs). q and
// attn2d are views made once too. Layers of one model share the shapes.
struct Workspace {
  at::Tensor qkv, q, attn, attn2d, o, gate_up, h, down;

  // the attention half's buffers, the MLP half's, or both
  Workspace(const at::Tensor& x, int64_t Hq, int64_t Hkv, int64_t D, int64_t qkv_n,
            int64_t o_n, int64_t gate_up_n, int64_t down_n, bool attention, bool mlp) {
    const int64_t B = x.size(0);
    if (attention) {
      qkv = at::empty({B, qkv_n}, x.options());
      q = qkv.view({B, Hq + 2 * Hkv, D}).narrow(1, 0, Hq);
      attn = at::empty({B, Hq, D}, x.options());
      attn2d = attn.view({B, Hq * D});
      o = at::empty({B, o_n}, x.options());
    }
    if (mlp) {
      gate_up = at::empty({B, gate_up_n}, x.options());
      h = at::empty({B, gate_up_n / 2}, x.options());
      down = at::empty({B, down_n}, x.options());
    }
  }
};

// What a family adds to a Llama layer (backend/model/family.py), each part absent or off for
// Llama's: per-head q/k RMSNorm before rotary (Qwen3, Gemma 3), norms of the attention's and the
// MLP's outputs after their all-reduce (Gemma's sandwich), GeGLU instead of SwiGLU, a sliding
// window and an attention logit cap, and the local rotary tables (Gemma 3's windowed layers).
struct FamilyParts {
  c10::optional<at::Tensor> q_norm, k_norm, attn_out_norm, mlp_out_norm;
  bool gelu = false, local_rope = false;
  int64_t window = 0;
  double softcap = 0.0;
};

// A step's rotary tables: the global pair and, where windowed layers have their own, the local
struct Rope {
  const at::Tensor& cos;
  const at::Tensor& sin;
  const c10::optional<at::Tensor>& local_cos;
  const c10::optional<at::Tensor>& local_sin;
};

// A decoder layer's weights, caches and constants, bound once so a decode step passes only its
// per-step tensors (pybind's conversion of ~18 arguments per call was itself a visible cost).
struct DecodeLayer {
  at::Tensor norm1, norm2, k_cache, v_cache, kv_index;
  Weight qkv_w, o_w, gate_up_w, down_w;
  c10::optional<at::Tensor> qkv_b, o_b, gate_up_b, down_b;
  double eps1, eps2, scale;
  int64_t Hq, Hkv;
  c10::optional<Lora> qkv_l, o_l, gate_up_l, down_l;  // where an adapter targets the projection
  FamilyParts family;

  Workspace workspace(const at::Tensor& x, bool attention = true, bool mlp = true) const {
    return Workspace(x, Hq, Hkv, k_cache.size(3), qkv_w.rows(), o_w.rows(), gate_up_w.rows(),
                     down_w.rows(), attention, mlp);
  }
};

// [residual += x; x = rms_norm(residual)] (or x already normed: add_residual false), qkv
// projection, rotary + KV-cache write, paged attention, o projection (this rank's partial sum,
// without o's bias) into the workspace, each projection with its rows' LoRA deltas (lora_ids:
// each row's adapter, 0 none; absent: no row has one). Returns {partial o output, residual}.
std::vector<at::Tensor> decode_attention_half(
    const DecodeLayer& l, at::Tensor x, at::Tensor residual, bool add_residual,
    const Rope& rope, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens,
    const c10::optional<at::Tensor>& lora_ids, Workspace& ws) {
  using namespace part_timing;
  const FamilyParts& f = l.family;
  if (enabled.load(std::memory_order_relaxed)) ++part_timing::layers;
  if (add_residual) timed(kNorm, [&] { add_rms_norm_(x, residual, l.norm1, l.eps1); });
  timed(kQkv, [&] { project(x, l.qkv_w, l.qkv_b, l.qkv_l, lora_ids, ws.qkv); });
  timed(kRotaryKv, [&] {
    if (f.q_norm.has_value()) qk_norm_(ws.qkv, *f.q_norm, *f.k_norm, l.Hq, l.Hkv, l.eps1);
    const bool local = f.local_rope && rope.local_cos.has_value();
    rotary_write_kv_(ws.qkv, local ? *rope.local_cos : rope.cos,
                     local ? *rope.local_sin : rope.sin, l.Hq, l.Hkv, l.k_cache, l.v_cache,
                     slot_mapping);
  });
  timed(kAttention, [&] {
    paged_decode_attention_into(ws.q, l.k_cache, l.v_cache, block_tables, context_lens,
                                l.scale, l.kv_index, 0, ws.attn, f.window, f.softcap);
  });
  timed(kO, [&] { project(ws.attn2d, l.o_w, c10::nullopt, l.o_l, lora_ids, ws.o); });
  return {ws.o, residual};
}

// [residual += x; x = rms_norm(residual)], gate/up projection, silu * up, down projection (this
// rank's partial sum, without down's bias) into the workspace, with LoRA deltas as the attention
// half's. Returns {partial down output, residual}.
std::vector<at::Tensor> decode_mlp_half(const DecodeLayer& l, at::Tensor x,
                                        at::Tensor residual,
                                        const c10::optional<at::Tensor>& lora_ids,
                                        Workspace& ws) {
  using namespace part_timing;
  timed(kNorm, [&] { add_rms_norm_(x, residual, l.norm2, l.eps2); });
  timed(kGateUp, [&] { project(x, l.gate_up_w, l.gate_up_b, l.gate_up_l, lora_ids, ws.gate_up); });
  timed(kSilu, [&] {
    if (l.family.gelu)
      gelu_tanh_mul_into(ws.gate_up, ws.h);
    else
      silu_mul_into(ws.gate_up, ws.h);
  });
  timed(kDown, [&] { project(ws.h, l.down_w, c10::nullopt, l.down_l, lora_ids, ws.down); });
  return {ws.down, residual};
}

// After a half's all-reduce (or at one rank, its output): its bias, then its out norm
// (Gemma's sandwich), in place in `out` where the norm allows it.
void finish_half(const DecodeLayer& l, bool attention, at::Tensor& out) {
  const auto& bias = attention ? l.o_b : l.down_b;
  if (bias.has_value()) part_timing::timed(part_timing::kBias, [&] { out.add_(*bias); });
  const auto& norm = attention ? l.family.attn_out_norm : l.family.mlp_out_norm;
  if (norm.has_value())
    part_timing::timed(part_timing::kNorm, [&] { out = rms_norm(out, *norm, l.eps1); });
}

}  // namespace

// Every layer of a one-rank model for a decode-only step, without returning to Python between
// layers (there is no collective to wait for). x is the first layer's input, already normed
// when `add_residual` is false (residual then holds the un-normed input). Returns {x, residual}
// after the last layer, bit-identical to calling the halves with the biases added in between.
// lora_ids: each row's LoRA adapter (0: none), absent when no row has one.
std::vector<at::Tensor> decode_stack(const std::vector<DecodeLayer>& layers, at::Tensor x,
                                     at::Tensor residual, bool add_residual,
                                     at::Tensor cos, at::Tensor sin,
                                     at::Tensor slot_mapping, at::Tensor block_tables,
                                     at::Tensor context_lens,
                                     c10::optional<at::Tensor> lora_ids,
                                     c10::optional<at::Tensor> local_cos,
                                     c10::optional<at::Tensor> local_sin) {
  if (layers.empty()) return {x, residual};
  Workspace ws = layers[0].workspace(x);
  const Rope rope{cos, sin, local_cos, local_sin};
  for (const auto& l : layers) {
    auto a = decode_attention_half(l, x, residual, add_residual, rope, slot_mapping,
                                   block_tables, context_lens, lora_ids, ws);
    finish_half(l, true, a[0]);
    auto m = decode_mlp_half(l, a[0], a[1], lora_ids, ws);
    finish_half(l, false, m[0]);
    x = m[0], residual = m[1], add_residual = true;
  }
  return {x, residual};
}

// The next shared-memory all-reduce: this collective's buffer, the flags, and what
// shm_all_reduce needs besides the tensor.
using ShmCollective = std::tuple<at::Tensor, at::Tensor, int64_t, int64_t, int64_t>;

std::tuple<at::Tensor, at::Tensor, bool, double> collect(
    const std::vector<at::Tensor>& half, const c10::optional<ShmCollective>& coll) {
  if (!coll.has_value()) return {half[0], half[1], true, 0.0};
  const auto& [slots, flags, rank, seq, spins] = *coll;
  const auto t0 = std::chrono::steady_clock::now();
  // summed in place: an allocation here is slow (its code gone cold after the layer's GEMVs)
  at::Tensor out = half[0];
  const bool arrived = shm_all_reduce_into(half[0], out, slots, flags, rank, seq, spins);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {out, half[1], arrived, dt};
}

// Every layer of a tensor-parallel rank's decode step, halves [start, 2 * layers) (half 2i is
// layer i's attention, 2i + 1 its MLP), each ending in its shared-memory all-reduce: the k-th
// half run uses collective seq0 + k in buffers[(seq0 + k) % 2]. As decode_stack, without a
// return to Python between layers (TP2 made 60 of them per step; docs/decisions.md,
// "The whole TP decoder stack is one C++ call per rank"). Returns
// {x, residual, halves run, arrived, seconds in collectives}. If a peer was late past the spins
// (arrived false), x is the last half's posted partial: the caller waits its liveness-checking
// way, sums, adds that half's bias and calls again from the next half.
std::tuple<at::Tensor, at::Tensor, int64_t, bool, double> decode_stack_tp(
    const std::vector<DecodeLayer>& layers, at::Tensor x, at::Tensor residual,
    bool add_residual, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
    at::Tensor block_tables, at::Tensor context_lens, int64_t start,
    const std::vector<at::Tensor>& buffers, at::Tensor flags, int64_t rank, int64_t seq0,
    int64_t spins, c10::optional<at::Tensor> lora_ids, c10::optional<at::Tensor> local_cos,
    c10::optional<at::Tensor> local_sin) {
  TORCH_CHECK(buffers.size() == 2, "decode_stack_tp: two collective buffers");
  const int64_t halves = 2 * static_cast<int64_t>(layers.size());
  double seconds = 0.0;
  if (start >= halves) return {x, residual, 0, true, seconds};
  Workspace ws = layers[0].workspace(x);
  const Rope rope{cos, sin, local_cos, local_sin};
  for (int64_t i = start; i < halves; ++i) {
    const DecodeLayer& l = layers[i / 2];
    const bool attention = i % 2 == 0;
    auto half = attention ? decode_attention_half(l, x, residual, add_residual, rope,
                                                  slot_mapping, block_tables, context_lens,
                                                  lora_ids, ws)
                          : decode_mlp_half(l, x, residual, lora_ids, ws);
    const int64_t seq = seq0 + (i - start);
    auto [out, res, arrived, dt] =
        collect(half, ShmCollective{buffers[seq & 1], flags, rank, seq, spins});
    seconds += dt;
    if (!arrived) return {out, res, i - start + 1, false, seconds};
    finish_half(l, attention, out);
    x = out, residual = res, add_residual = true;
  }
  return {x, residual, halves - start, true, seconds};
}

void bind_decode_layer(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLayer>(m, "DecodeLayer")
      .def(py::init([](at::Tensor norm1, double eps1, at::Tensor qkv_w,
                       c10::optional<at::Tensor> qkv_b, int64_t Hq, int64_t Hkv,
                       at::Tensor k_cache, at::Tensor v_cache, double scale,
                       at::Tensor kv_index, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                       at::Tensor norm2, double eps2, at::Tensor gate_up_w,
                       c10::optional<at::Tensor> gate_up_b, at::Tensor down_w,
                       c10::optional<at::Tensor> down_b,
                       std::vector<int64_t> bits,
                       std::vector<c10::optional<at::Tensor>> copies,
                       std::vector<c10::optional<at::Tensor>> lora) {
        // the block copies of qkv, o, gate_up and down: bits 4, 8 or 0 (none) and their
        // (codes, scales) pairs
        TORCH_CHECK(bits.size() == 4 && copies.size() == 8,
                    "DecodeLayer: 4 copy kinds and 8 tensors");
        // their LoRA adapters, stacked: (a, bt, info) each, or none (an empty list: no adapters)
        TORCH_CHECK(lora.empty() || lora.size() == 12, "DecodeLayer: 4 LoRA triples or none");
        auto weight = [&](at::Tensor w, int i) {
          const bool both = copies[2 * i].has_value() && copies[2 * i + 1].has_value();
          TORCH_CHECK(bits[i] == 0 || both, "DecodeLayer: a block copy without its tensors");
          return Weight{w, bits[i], copies[2 * i], copies[2 * i + 1]};
        };
        auto adapters = [&](int i) -> c10::optional<Lora> {
          if (lora.empty() || !lora[3 * i].has_value()) return c10::nullopt;
          TORCH_CHECK(lora[3 * i + 1].has_value() && lora[3 * i + 2].has_value(),
                      "DecodeLayer: LoRA a without its bt and info");
          return Lora{*lora[3 * i], *lora[3 * i + 1], *lora[3 * i + 2]};
        };
        return DecodeLayer{norm1, norm2, k_cache, v_cache, kv_index, weight(qkv_w, 0),
                           weight(o_w, 1), weight(gate_up_w, 2), weight(down_w, 3), qkv_b, o_b,
                           gate_up_b, down_b, eps1, eps2, scale, Hq, Hkv, adapters(0),
                           adapters(1), adapters(2), adapters(3)};
      }))
      // the family's parts (FamilyParts), bound after construction; a Llama layer has none
      .def("set_family_parts",
           [](DecodeLayer& l, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
              c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm,
              bool gelu, int64_t window, double softcap, bool local_rope) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
                         "DecodeLayer: q and k norms come together");
             TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(),
                         "DecodeLayer: the sandwich's two out norms come together");
             l.family = FamilyParts{q_norm, k_norm, attn_out_norm, mlp_out_norm, gelu,
                                    local_rope, window, softcap};
           });
  // Without the GIL: a decode step spends nearly all its time in here, and the serving process
  // has other Python threads (the Triton adapter's response thread) that need not wait for it.
  m.def("decode_stack", &decode_stack, pybind11::call_guard<pybind11::gil_scoped_release>());
  // part_timing: switch on or off (either clears the sums); the sums, and how many attention
  // halves (layers) they cover
  m.def("set_decode_part_timing", [](bool on) {
    part_timing::seconds.fill(0.0);
    part_timing::layers = 0;
    part_timing::enabled.store(on);
  });
  m.def("decode_part_seconds", [] {
    py::dict d;
    for (int i = 0; i < part_timing::kCount; ++i) d[part_timing::kNames[i]] = part_timing::seconds[i];
    d["layers"] = part_timing::layers;
    return d;
  });
  m.def("decode_stack_tp", &decode_stack_tp,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // The halves for several ranks, collectives in between (o's and down's biases: after them).
  // Given a shared-memory collective (slots, flags, rank, seq, spins), a half also posts its
  // partial sum and sums every rank's (shm_all_reduce) before returning to Python; the result
  // is {out, residual, arrived, seconds}: out is the sum if every rank arrived within the spins,
  // else this rank's posted partial (the caller then waits its slow, liveness-checking way and
  // sums); seconds is the time spent in the collective.
  m.def("decode_attention_half",
        [](const DecodeLayer& l, at::Tensor x, at::Tensor residual, bool add_residual,
           at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
           at::Tensor block_tables, at::Tensor context_lens,
           c10::optional<ShmCollective> coll, c10::optional<at::Tensor> lora_ids,
           c10::optional<at::Tensor> local_cos, c10::optional<at::Tensor> local_sin) {
          Workspace ws = l.workspace(x, true, false);
          const Rope rope{cos, sin, local_cos, local_sin};
          auto r = decode_attention_half(l, x, residual, add_residual, rope, slot_mapping,
                                         block_tables, context_lens, lora_ids, ws);
          return collect(r, coll);
        });
  m.def("decode_mlp_half", [](const DecodeLayer& l, at::Tensor x, at::Tensor residual,
                              c10::optional<ShmCollective> coll,
                              c10::optional<at::Tensor> lora_ids) {
    Workspace ws = l.workspace(x, false, true);
    auto r = decode_mlp_half(l, x, residual, lora_ids, ws);
    return collect(r, coll);
  });
}
