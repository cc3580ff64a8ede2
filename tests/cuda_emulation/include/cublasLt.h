// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): the cuBLASLt subset Loom's
// plugins use, on the CPU (libloom_cuda_emulation_cublas.so, aliased as CUDA::cublasLt). A
// verification tool, not NVIDIA's header. cublasLtMatmul computes D = alpha op(A) op(B) +
// beta C (C not read when beta is 0) over column-major layouts, on the call's stream:
//   CUBLAS_COMPUTE_32F* with scale type CUDA_R_32F: A and B float32, bfloat16 or float16 (one
//     type), C and D that type or float32;
//   CUBLAS_COMPUTE_32I with scale type CUDA_R_32I: int8 A and B, int32 C and D, exact, in the
//     layout every GPU runs: TRANSA T, TRANSB N, m, k and every ld multiples of 4, pointers
//     4-byte aligned.
// Descriptor attributes: compute and scale type, TRANSA, TRANSB (TRANSC N), POINTER_MODE
// host, EPILOGUE DEFAULT; layouts: CUBLASLT_ORDER_COL, BATCH_COUNT and STRIDED_BATCH_OFFSET.
// Anything else is CUBLAS_STATUS_NOT_SUPPORTED where it is set or used.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cublas_v2.h"

struct cublasLtContext;
typedef cublasLtContext* cublasLtHandle_t;
struct cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
struct cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
struct cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_TRANSC = 5,
  CUBLASLT_MATMUL_DESC_FILL_MODE = 6,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8
} cublasLtMatmulDescAttributes_t;

typedef enum {
  CUBLASLT_MATRIX_LAYOUT_TYPE = 0,
  CUBLASLT_MATRIX_LAYOUT_ORDER = 1,
  CUBLASLT_MATRIX_LAYOUT_ROWS = 2,
  CUBLASLT_MATRIX_LAYOUT_COLS = 3,
  CUBLASLT_MATRIX_LAYOUT_LD = 4,
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6
} cublasLtMatrixLayoutAttribute_t;

typedef enum {
  CUBLASLT_ORDER_COL = 0,
  CUBLASLT_ORDER_ROW = 1,
  CUBLASLT_ORDER_COL32 = 2,
  CUBLASLT_ORDER_COL4_4R2_8C = 3,
  CUBLASLT_ORDER_COL32_2R_4R4 = 4
} cublasLtOrder_t;

typedef enum {
  CUBLASLT_POINTER_MODE_HOST = 0,
  CUBLASLT_POINTER_MODE_DEVICE = 1
} cublasLtPointerMode_t;

typedef enum { CUBLASLT_EPILOGUE_DEFAULT = 1 } cublasLtEpilogue_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
} cublasLtMatmulPreferenceAttributes_t;

extern "C" {
EMU_API cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
EMU_API cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);
EMU_API const char* cublasLtGetStatusName(cublasStatus_t status);
EMU_API const char* cublasLtGetStatusString(cublasStatus_t status);

EMU_API cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc,
                                                cublasComputeType_t computeType,
                                                cudaDataType_t scaleType);
EMU_API cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
EMU_API cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                      cublasLtMatmulDescAttributes_t attr,
                                                      const void* buf, size_t sizeInBytes);
EMU_API cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t desc,
                                                      cublasLtMatmulDescAttributes_t attr,
                                                      void* buf, size_t sizeInBytes,
                                                      size_t* sizeWritten);

EMU_API cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                                  uint64_t rows, uint64_t cols, int64_t ld);
EMU_API cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
EMU_API cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                        cublasLtMatrixLayoutAttribute_t attr,
                                                        const void* buf, size_t sizeInBytes);

EMU_API cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
EMU_API cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
EMU_API cublasStatus_t cublasLtMatmulPreferenceSetAttribute(
    cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
    size_t sizeInBytes);
// One result (state SUCCESS, no workspace) when cublasLtMatmul would run the problem, else
// NOT_SUPPORTED with *returnAlgoCount 0.
EMU_API cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount);

EMU_API cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                      const void* alpha, const void* A,
                                      cublasLtMatrixLayout_t Adesc, const void* B,
                                      cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                                      cublasLtMatrixLayout_t Cdesc, void* D,
                                      cublasLtMatrixLayout_t Ddesc,
                                      const cublasLtMatmulAlgo_t* algo, void* workspace,
                                      size_t workspaceSizeInBytes, cudaStream_t stream);
}
