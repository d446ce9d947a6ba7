// Emulator stand-in for <cuda_fp16.h> (see msp_cuda_emulator.h).
#pragma once
#include "msp_cuda_emulator.h"
