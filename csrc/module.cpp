// The Python module megatron_sp._C: `import megatron_sp._C` loads this library, which runs the op
// registrations of the other files; it has no Python API of its own.
//
// Design (pytorch/extension-cpp's shape): one op (or op family) is
//   csrc/<op>.cpp                  its schema (TORCH_LIBRARY_FRAGMENT(megatron_sp, ...)), CPU kernel, CPU registration
//   csrc/<op>.h                    its argument checks, shared by the CPU kernel and the CUDA binding
//   csrc/cuda/<op>.cu, <op>.h      its CUDA kernels and launcher (torch-free: nvcc compiles them alone)
//   csrc/cuda/<op>_binding.cpp     its CUDA binding (allocation, launch) and CUDA registration
//   megatron_sp/ops/<op>.py        the reference, the dispatch, the fake (meta) and autograd registration
#include <Python.h>
#include <torch/library.h>

// The megatron_sp namespace is declared here, once; each op adds its schemas as a fragment.
TORCH_LIBRARY(megatron_sp, m) {}

static PyModuleDef msp_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&msp_module); }
