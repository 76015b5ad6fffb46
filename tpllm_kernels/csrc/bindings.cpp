// The Python module: every kernel function the extension exposes, defined in the other
// translation units (declared in cpu_kernels.h). The only file that needs pybind11 and torch's
// Python bindings for its own code (decode_layer.cpp and thread_team_bindings.cpp bind their
// classes and switches themselves).
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

void bind_decode_layer(pybind11::module& m);  // DecodeLayer and decode_stack (decode_layer.cpp)
void bind_thread_team(pybind11::module& m);   // the team's switches (thread_team_bindings.cpp)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear);
  m.def("small_m_linear_into", [](at::Tensor x, at::Tensor weight, at::Tensor y) {
    small_m_linear_into(x, weight, c10::nullopt, y);
  });
  m.def("small_m_linear_q4_into", [](at::Tensor x, at::Tensor q, at::Tensor dm,
                                     c10::optional<at::Tensor> bias, at::Tensor y) {
    small_m_linear_q4_into(x, q, dm, bias, y);
  });
  m.def("block_copy_max_rows", &block_copy_max_rows);
  m.def("lora_delta_", [](at::Tensor x, at::Tensor y, at::Tensor a, at::Tensor bt,
                          at::Tensor info, at::Tensor ids) {
    lora_delta_into(x, y, a, bt, info, ids);
  });
  m.def("small_m_linear_q8_into", [](at::Tensor x, at::Tensor q, at::Tensor scales,
                                     c10::optional<at::Tensor> bias, at::Tensor y) {
    small_m_linear_q8_into(x, q, scales, bias, y);
  });
  m.def("small_m_linear_bf16", &small_m_linear_bf16);
  m.def("bf16_gemv_supported", &bf16_gemv_supported);
  m.def("q8_screen_inputs", &q8_screen_inputs);
  m.def("greedy_argmax_screened", &greedy_argmax_screened);
  m.def("greedy_argmax_screened_q8", &greedy_argmax_screened_q8);
  bind_decode_layer(m);
  bind_thread_team(m);
  m.def("rotary_write_kv_", &rotary_write_kv_);
  // window (keys per query, 0: all) and softcap (0: none) as keywords, defaults off
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("kv_index"), py::arg("num_splits"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("set_attention_touch_pass", &set_attention_touch_pass);
  m.def("attention_touch_pass", &attention_touch_pass);
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"), py::arg("scale"),
        py::arg("kv_index"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("prefill_attention_supported", &prefill_attention_supported);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("qk_norm_", &qk_norm_);
  m.def("shm_all_reduce", &shm_all_reduce);
  m.def("shm_sum", &shm_sum);
  m.def("shm_gather_first", &shm_gather_first);
}
