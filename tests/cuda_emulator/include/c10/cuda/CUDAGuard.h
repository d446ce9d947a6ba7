// Emulator stand-in for <c10/cuda/CUDAGuard.h>: the emulated "device" is the host.
#pragma once
#include <c10/core/Device.h>

namespace c10 {
namespace cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

}  // namespace cuda
}  // namespace c10
