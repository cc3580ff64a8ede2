// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the data type enum the CUDA
// libraries share, with NVIDIA's values. Only the real types Loom's plugins use.
#pragma once

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_8U = 8,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14,
} cudaDataType;
