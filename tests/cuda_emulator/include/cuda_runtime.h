// Emulator stand-in for <cuda_runtime.h> (see msp_cuda_emulator.h).
#pragma once
#include "msp_cuda_emulator.h"
