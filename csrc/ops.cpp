// Schemas of the megatron_sp custom ops, and the Python module stub that loads them.
//
// Design: one TORCH_LIBRARY block declares every op; each device file (csrc/*_cpu.cpp,
// csrc/cuda/*_binding.cpp) adds its TORCH_LIBRARY_IMPL. megatron_sp/ops/ registers the fake
// (meta) functions and the autograd formulas in Python, so torch.compile and opcheck see them.
// Layouts (s = sequence, b = batch, h = hidden, n = heads, d = head dim, p/t = group size):
//   bias_dropout_add_fwd  x, residual [s, b, h]; bias [h] or None; positions [s]; sample ids [b]
//   layer_norm_fwd        x [..., h] -> (out [..., h], mean [rows] fp32, rstd [rows] fp32)
//   rms_norm_fwd          x [..., h] -> (out [..., h], rstd [rows] fp32)
//   ulysses_pack          [s/p, b, n, d] -> [p, s/p, b, n/p, d]   (all_to_all send buffer)
//   ulysses_unpack        [p, s/p, b, n/p, d] -> [s/p, b, n, d]   (its inverse)
//   gather_to_last_dim    [t*s, ..., l] -> [s, ..., t*l]           (dim-0 all-gather -> cat(-1))
//   last_dim_to_gather    [s, ..., t*l] -> [t*s, ..., l]           (its inverse)
//   zigzag_reorder        2p chunks along dim: rank r gets chunks r and 2p-1-r (or the inverse)
//   flash_attention_fwd   q [b, n_q, s_q, d], k, v [b, n_kv, s_k, d] (any strides) -> (out
//                         [b, n_q, s_q, d] laid out [s_q, b, n_q, d], lse [b, n_q, s_q] fp32)
//   flash_attention_bwd   (dout, q, k, v, out, lse, ...) -> (dq, dk, dv), laid out [s, b, n, d]
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(megatron_sp, m) {
  m.def(
      "bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor token_positions, "
      "Tensor sample_ids, float p, int seed, int layer, int site, int feature_offset) -> Tensor");
  m.def(
      "bias_dropout_add_bwd(Tensor grad_out, Tensor token_positions, Tensor sample_ids, "
      "float p, int seed, int layer, int site, int feature_offset, bool bias_grad) "
      "-> (Tensor, Tensor)");
  m.def(
      "layer_norm_fwd(Tensor x, Tensor weight, Tensor bias, float eps) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor x, Tensor weight, Tensor mean, Tensor rstd) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  m.def("ulysses_pack(Tensor x, int p) -> Tensor");
  m.def("ulysses_unpack(Tensor x, int p) -> Tensor");
  m.def("gather_to_last_dim(Tensor x, int t) -> Tensor");
  m.def("last_dim_to_gather(Tensor x, int t) -> Tensor");
  m.def("zigzag_reorder(Tensor x, int p, int dim, bool inverse) -> Tensor");
  m.def(
      "flash_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor q_positions, "
      "Tensor k_positions, Tensor? q_segments, Tensor? k_segments, Tensor sample_ids, float p, "
      "int seed, int layer, int head_offset) -> (Tensor, Tensor)");
  m.def(
      "flash_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor q_positions, Tensor k_positions, Tensor? q_segments, Tensor? k_segments, "
      "Tensor sample_ids, float p, int seed, int layer, int head_offset) "
      "-> (Tensor, Tensor, Tensor)");
}

// `import megatron_sp._C` loads this library (running the registrations above); no Python API.
static PyModuleDef msp_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&msp_module); }
