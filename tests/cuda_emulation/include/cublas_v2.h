// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the cuBLAS subset Loom's
// plugins use, run on the CPU by plain reference loops over the emulated device memory
// (libloom_cuda_emulation_cublas.so, cublas.cpp; the build aliases it as CUDA::cublas). A
// verification tool, not NVIDIA's header. Semantics are cuBLAS's: column-major matrices,
// op(A) m x k, op(B) k x n, C m x n, C = alpha op(A) op(B) + beta C (C not read when beta is
// 0), work enqueued on the handle's stream, host-pointer alpha and beta.
//   cublasSgemm, cublasSgemmStridedBatched: fp32.
//   cublasGemmEx, cublasGemmStridedBatchedEx, cublasGemmGroupedBatchedEx: A and B of one type,
//     float32, bfloat16 or float16 with CUBLAS_COMPUTE_32F* (fp32 accumulation in k order;
//     the FAST_* types compute in full fp32 here), C of that type or float32, float alpha and
//     beta; int8 A and B with CUBLAS_COMPUTE_32I, int32 C and alpha and beta, exact int32
//     accumulation (not grouped), and only in the layout every GPU runs: A transposed, B not
//     ("TN"), m, k, lda, ldb and ldc multiples of 4, pointers 4-byte aligned.
// Anything else is CUBLAS_STATUS_NOT_SUPPORTED (or INVALID_VALUE where cuBLAS says so), never a
// silently different result. A matrix outside device memory of the handle's device is an
// emulator problem ("EMU-CUDA:" line, INVALID_VALUE).
#pragma once
#include <cstdint>

#include "cuda_runtime_api.h"
#include "library_types.h"

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

typedef enum {
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
  CUBLAS_OP_C = 2,
  CUBLAS_OP_HERMITAN = 2,
  CUBLAS_OP_CONJG = 3
} cublasOperation_t;

typedef enum { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 } cublasPointerMode_t;

typedef enum {
  CUBLAS_DEFAULT_MATH = 0,
  CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_PEDANTIC_MATH = 2,
  CUBLAS_TF32_TENSOR_OP_MATH = 3,
  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
} cublasMath_t;

typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77
} cublasComputeType_t;

typedef enum { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;

struct cublasContext;
typedef cublasContext* cublasHandle_t;

extern "C" {
EMU_API cublasStatus_t cublasCreate_v2(cublasHandle_t* handle);
EMU_API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle);
EMU_API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream);
EMU_API cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream);
// Only CUBLAS_POINTER_MODE_HOST; DEVICE is NOT_SUPPORTED.
EMU_API cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode);
EMU_API cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode);
// Recorded; the emulation always computes in full fp32.
EMU_API cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
EMU_API cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode);
// Accepted (the emulation needs no workspace).
EMU_API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes);
EMU_API const char* cublasGetStatusName(cublasStatus_t status);
EMU_API const char* cublasGetStatusString(cublasStatus_t status);

EMU_API cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                                      cublasOperation_t transb, int m, int n, int k,
                                      const float* alpha, const float* A, int lda, const float* B,
                                      int ldb, const float* beta, float* C, int ldc);
EMU_API cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                                 cublasOperation_t transb, int m, int n, int k,
                                                 const float* alpha, const float* A, int lda,
                                                 long long int strideA, const float* B, int ldb,
                                                 long long int strideB, const float* beta, float* C,
                                                 int ldc, long long int strideC, int batchCount);
EMU_API cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                                    cublasOperation_t transb, int m, int n, int k,
                                    const void* alpha, const void* A, cudaDataType Atype, int lda,
                                    const void* B, cudaDataType Btype, int ldb, const void* beta,
                                    void* C, cudaDataType Ctype, int ldc,
                                    cublasComputeType_t computeType, cublasGemmAlgo_t algo);
EMU_API cublasStatus_t cublasGemmStridedBatchedEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
    const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA,
    const void* B, cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C,
    cudaDataType Ctype, int ldc, long long int strideC, int batchCount,
    cublasComputeType_t computeType, cublasGemmAlgo_t algo);
// Groups of GEMMs, each group its own shape and scalars (alpha_array[g], beta_array[g], host);
// Aarray, Barray and Carray are device arrays of sum(group_size) pointers, read when the work
// runs on the stream. Floating types only (as cuBLAS).
EMU_API cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType);
}

#define cublasCreate cublasCreate_v2
#define cublasDestroy cublasDestroy_v2
#define cublasSetStream cublasSetStream_v2
#define cublasGetStream cublasGetStream_v2
#define cublasSetPointerMode cublasSetPointerMode_v2
#define cublasGetPointerMode cublasGetPointerMode_v2
#define cublasSetWorkspace cublasSetWorkspace_v2
#define cublasSgemm cublasSgemm_v2
