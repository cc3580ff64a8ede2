// CUDA emulation (tests/cuda_emulation, LOOM_CUDA_EMULATION=ON): a CPU stand-in for the cuBLAS
// and cuBLASLt subset in include/cublas_v2.h and include/cublasLt.h, built as
// libloom_cuda_emulation_cublas.so (aliased as CUDA::cublas and CUDA::cublasLt). Every product
// is a plain reference loop over the emulated device memory, enqueued on the stream like a
// kernel, so it runs in stream order with the emulated kernels and copies. Arguments are
// checked as cuBLAS checks them (INVALID_VALUE, NOT_SUPPORTED); matrices that do not lie in
// device memory of the current device are emulator problems (reported, INVALID_VALUE).
#include "cublasLt.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "cuda_fp16.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  int device = 0;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
};
struct cublasLtContext {
  int device = 0;
};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  int32_t transa = CUBLAS_OP_N;
  int32_t transb = CUBLAS_OP_N;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;  // elements between batches
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
};

namespace {

// ---- elements

enum class Elem { kF32, kBf16, kF16, kI8, kI32 };

bool elem_of(cudaDataType_t t, Elem* e) {
  switch (t) {
    case CUDA_R_32F:
      *e = Elem::kF32;
      return true;
    case CUDA_R_16BF:
      *e = Elem::kBf16;
      return true;
    case CUDA_R_16F:
      *e = Elem::kF16;
      return true;
    case CUDA_R_8I:
      *e = Elem::kI8;
      return true;
    case CUDA_R_32I:
      *e = Elem::kI32;
      return true;
    default:
      return false;
  }
}

size_t elem_bytes(Elem e) {
  switch (e) {
    case Elem::kF32:
    case Elem::kI32:
      return 4;
    case Elem::kBf16:
    case Elem::kF16:
      return 2;
    case Elem::kI8:
      return 1;
  }
  return 1;
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float load_float(const void* base, Elem e, int64_t i) {
  switch (e) {
    case Elem::kF32:
      return static_cast<const float*>(base)[i];
    case Elem::kBf16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case Elem::kF16:
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(base)[i]));
    default:
      return 0;
  }
}

void store_float(void* base, Elem e, int64_t i, float v) {
  switch (e) {
    case Elem::kF32:
      static_cast<float*>(base)[i] = v;
      break;
    case Elem::kBf16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
      break;
    case Elem::kF16:
      static_cast<uint16_t*>(base)[i] = __half_as_ushort(__float2half_rn(v));
      break;
    default:
      break;
  }
}

// ---- one product: D = alpha op(A) op(B) + beta C, column-major

struct Mat {
  const void* p;
  Elem e;
  int64_t ld;
  bool trans;
};

struct Problem {
  int64_t m, n, k;
  Mat a, b;
  const void* c;  // may equal d
  Elem ce;
  int64_t ldc;
  void* d;
  Elem de;
  int64_t ldd;
  bool integer;  // int8 x int8 -> int32, int32 scalars
  float alpha_f, beta_f;
  int32_t alpha_i, beta_i;
};

void run(const Problem& q) {
  for (int64_t j = 0; j < q.n; ++j) {
    for (int64_t i = 0; i < q.m; ++i) {
      if (q.integer) {
        const auto* a = static_cast<const int8_t*>(q.a.p);
        const auto* b = static_cast<const int8_t*>(q.b.p);
        uint32_t acc = 0;  // int32 arithmetic that wraps as the GPU's does
        for (int64_t l = 0; l < q.k; ++l) {
          const int32_t av = q.a.trans ? a[l + i * q.a.ld] : a[i + l * q.a.ld];
          const int32_t bv = q.b.trans ? b[j + l * q.b.ld] : b[l + j * q.b.ld];
          acc += static_cast<uint32_t>(av * bv);
        }
        uint32_t out = static_cast<uint32_t>(q.alpha_i) * acc;
        if (q.beta_i != 0) {
          out += static_cast<uint32_t>(q.beta_i) *
                 static_cast<uint32_t>(static_cast<const int32_t*>(q.c)[i + j * q.ldc]);
        }
        int32_t v;
        std::memcpy(&v, &out, 4);
        static_cast<int32_t*>(q.d)[i + j * q.ldd] = v;
      } else {
        float acc = 0;
        for (int64_t l = 0; l < q.k; ++l) {
          const float av = load_float(q.a.p, q.a.e, q.a.trans ? l + i * q.a.ld : i + l * q.a.ld);
          const float bv = load_float(q.b.p, q.b.e, q.b.trans ? j + l * q.b.ld : l + j * q.b.ld);
          acc += av * bv;
        }
        float v = q.alpha_f * acc;
        if (q.beta_f != 0) v += q.beta_f * load_float(q.c, q.ce, i + j * q.ldc);
        store_float(q.d, q.de, i + j * q.ldd, v);
      }
    }
  }
}

// ---- checks

bool valid_op(int32_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

bool floating_compute(cublasComputeType_t c) {
  return c == CUBLAS_COMPUTE_32F || c == CUBLAS_COMPUTE_32F_PEDANTIC ||
         c == CUBLAS_COMPUTE_32F_FAST_16F || c == CUBLAS_COMPUTE_32F_FAST_16BF ||
         c == CUBLAS_COMPUTE_32F_FAST_TF32;
}
bool integer_compute(cublasComputeType_t c) {
  return c == CUBLAS_COMPUTE_32I || c == CUBLAS_COMPUTE_32I_PEDANTIC;
}

// The element types of a product, or NOT_SUPPORTED: A and B one floating type with C of it or
// float32 (floating compute), or int8 A and B with int32 C (integer compute).
cublasStatus_t types_of(cudaDataType_t at, cudaDataType_t bt, cudaDataType_t ct,
                        cublasComputeType_t compute, bool allow_integer, Elem* ae, Elem* ce,
                        bool* integer) {
  Elem a{}, b{}, c{};
  if (!elem_of(at, &a) || !elem_of(bt, &b) || !elem_of(ct, &c) || a != b) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (floating_compute(compute)) {
    if (a == Elem::kI8 || a == Elem::kI32 || (c != a && c != Elem::kF32)) {
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    *integer = false;
  } else if (integer_compute(compute) && allow_integer) {
    if (a != Elem::kI8 || c != Elem::kI32) return CUBLAS_STATUS_NOT_SUPPORTED;
    *integer = true;
  } else {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  *ae = a;
  *ce = c;
  return CUBLAS_STATUS_SUCCESS;
}

// The int8 layout every GPU runs (A transposed, B not, dimensions and leading dimensions
// multiples of 4, 4-byte aligned pointers).
bool int8_layout_ok(bool transa, bool transb, int64_t m, int64_t k, int64_t lda, int64_t ldb,
                    int64_t ldc, const void* a, const void* b, const void* c) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; };
  return transa && !transb && m % 4 == 0 && k % 4 == 0 && lda % 4 == 0 && ldb % 4 == 0 &&
         ldc % 4 == 0 && aligned(a) && aligned(b) && aligned(c);
}

// Bytes a column-major rows x cols matrix with leading dimension ld spans, batched.
size_t span_bytes(int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride,
                  size_t es) {
  if (rows == 0 || cols == 0 || batch == 0) return 0;
  const int64_t last = (cols - 1) * ld + rows + (batch - 1) * stride;
  return static_cast<size_t>(last) * es;
}

// Whether [p, p + bytes) lies in one device allocation of `device`; reports it when not.
bool in_device(const char* call, const char* what, const void* p, size_t bytes, int device) {
  if (bytes == 0) return true;
  int d = -1;
  const size_t avail = emu::device_bytes_from(p, &d);
  if (d < 0) {
    emu::report("%s: %s (%p) is not device memory", call, what, p);
    return false;
  }
  if (d != device) {
    emu::report("%s: %s (%p) is memory of device %d, but the handle works on device %d", call, what,
                p, d, device);
    return false;
  }
  if (avail < bytes) {
    emu::report("%s: %s (%p) spans %zu bytes, but its allocation has only %zu from there", call,
                what, p, bytes, avail);
    return false;
  }
  return true;
}

// The shared checks and the enqueue of a (strided batched) classic-API product.
struct Classic {
  const char* call;
  cublasHandle_t h;
  cublasOperation_t ta, tb;
  int m, n, k;
  const void* alpha;
  const void* a;
  cudaDataType_t at;
  int lda;
  long long sa;
  const void* b;
  cudaDataType_t bt;
  int ldb;
  long long sb;
  const void* beta;
  void* c;
  cudaDataType_t ct;
  int ldc;
  long long sc;
  int batch;
  cublasComputeType_t compute;
};

cublasStatus_t classic(const Classic& g) {
  if (g.h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_op(g.ta) || !valid_op(g.tb) || g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool ta = g.ta != CUBLAS_OP_N, tb = g.tb != CUBLAS_OP_N;
  const int64_t a_rows = ta ? g.k : g.m, a_cols = ta ? g.m : g.k;
  const int64_t b_rows = tb ? g.n : g.k, b_cols = tb ? g.k : g.n;
  const auto at_least_one = [](int64_t v) { return v < 1 ? int64_t{1} : v; };
  if (g.lda < at_least_one(a_rows) || g.ldb < at_least_one(b_rows) || g.ldc < at_least_one(g.m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  Elem ae{}, ce{};
  bool integer = false;
  const cublasStatus_t types = types_of(g.at, g.bt, g.ct, g.compute, true, &ae, &ce, &integer);
  if (types != CUBLAS_STATUS_SUCCESS) return types;
  if (g.alpha == nullptr || g.beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (g.sa < 0 || g.sb < 0 || g.sc < 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (integer && !int8_layout_ok(ta, tb, g.m, g.k, g.lda, g.ldb, g.ldc, g.a, g.b, g.c)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  const size_t es = elem_bytes(ae), cs = elem_bytes(ce);
  const int dev = g.h->device;
  if (!in_device(g.call, "A", g.a, span_bytes(a_rows, a_cols, g.lda, g.batch, g.sa, es), dev) ||
      !in_device(g.call, "B", g.b, span_bytes(b_rows, b_cols, g.ldb, g.batch, g.sb, es), dev) ||
      !in_device(g.call, "C", g.c, span_bytes(g.m, g.n, g.ldc, g.batch, g.sc, cs), dev)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  Problem q{};
  q.m = g.m;
  q.n = g.n;
  q.k = g.k;
  q.a = {g.a, ae, g.lda, ta};
  q.b = {g.b, ae, g.ldb, tb};
  q.c = g.c;
  q.ce = ce;
  q.ldc = g.ldc;
  q.d = g.c;
  q.de = ce;
  q.ldd = g.ldc;
  q.integer = integer;
  if (integer) {
    q.alpha_i = *static_cast<const int32_t*>(g.alpha);
    q.beta_i = *static_cast<const int32_t*>(g.beta);
  } else {
    q.alpha_f = *static_cast<const float*>(g.alpha);
    q.beta_f = *static_cast<const float*>(g.beta);
  }
  const long long sa = g.sa, sb = g.sb, sc = g.sc;
  const int batch = g.batch;
  const cudaError_t e = emu::enqueue_kernel(g.h->stream, g.call, [q, sa, sb, sc, batch, es, cs] {
    for (int i = 0; i < batch; ++i) {
      Problem p = q;
      p.a.p = static_cast<const char*>(q.a.p) + static_cast<size_t>(i * sa) * es;
      p.b.p = static_cast<const char*>(q.b.p) + static_cast<size_t>(i * sb) * es;
      p.d = static_cast<char*>(q.d) + static_cast<size_t>(i * sc) * cs;
      p.c = p.d;
      run(p);
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* status_string(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an invalid value was used as an argument";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    default:
      return status_name(s);
  }
}

// ---- cuBLASLt

// op(A) m x k and op(B) k x n from the layouts, checked against C and D; the types and the
// int8 rule. Pointers are checked by the caller (the heuristic has none).
struct LtShape {
  int64_t m, n, k;
  bool ta, tb, integer;
  Elem ae, ce;
  int32_t batch;
};

cublasStatus_t lt_shape(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                        cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                        cublasLtMatrixLayout_t d, LtShape* s) {
  if (desc == nullptr || a == nullptr || b == nullptr || c == nullptr || d == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool floating = floating_compute(desc->compute) && desc->scale == CUDA_R_32F;
  const bool integer = integer_compute(desc->compute) && desc->scale == CUDA_R_32I;
  if (!floating && !integer) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (c->type != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  bool is_int = false;
  const cublasStatus_t types =
      types_of(a->type, b->type, d->type, desc->compute, true, &s->ae, &s->ce, &is_int);
  if (types != CUBLAS_STATUS_SUCCESS) return types;
  s->ta = desc->transa != CUBLAS_OP_N;
  s->tb = desc->transb != CUBLAS_OP_N;
  s->integer = is_int;
  const auto rows = [](cublasLtMatrixLayout_t l, bool t) {
    return static_cast<int64_t>(t ? l->cols : l->rows);
  };
  const auto cols = [](cublasLtMatrixLayout_t l, bool t) {
    return static_cast<int64_t>(t ? l->rows : l->cols);
  };
  s->m = rows(a, s->ta);
  s->k = cols(a, s->ta);
  s->n = cols(b, s->tb);
  if (rows(b, s->tb) != s->k || static_cast<int64_t>(c->rows) != s->m ||
      static_cast<int64_t>(c->cols) != s->n || d->rows != c->rows || d->cols != c->cols) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (cublasLtMatrixLayout_t l : {a, b, c, d}) {
    if (l->ld < static_cast<int64_t>(l->rows < 1 ? 1 : l->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (a->batch != d->batch || b->batch != d->batch || c->batch != d->batch) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  s->batch = d->batch;
  if (is_int &&
      !int8_layout_ok(s->ta, s->tb, s->m, s->k, a->ld, b->ld, d->ld, nullptr, nullptr, nullptr)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (is_int && c->ld % 4 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

template <class T>
cublasStatus_t read_scalar(const void* buf, size_t size, T* out) {
  if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(out, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    *handle = nullptr;
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = new (std::nothrow) cublasContext;
  if (*handle == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  (*handle)->device = emu::current_device();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == CUBLAS_POINTER_MODE_HOST) return CUBLAS_STATUS_SUCCESS;
  return mode == CUBLAS_POINTER_MODE_DEVICE ? CUBLAS_STATUS_NOT_SUPPORTED
                                            : CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = CUBLAS_POINTER_MODE_HOST;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* /*workspace*/, size_t /*bytes*/) {
  return handle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t status) { return status_name(status); }
const char* cublasGetStatusString(cublasStatus_t status) { return status_string(status); }

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const float* alpha,
                              const float* A, int lda, const float* B, int ldb, const float* beta,
                              float* C, int ldc) {
  return classic({"cublasSgemm",
                  handle,
                  transa,
                  transb,
                  m,
                  n,
                  k,
                  alpha,
                  A,
                  CUDA_R_32F,
                  lda,
                  0,
                  B,
                  CUDA_R_32F,
                  ldb,
                  0,
                  beta,
                  C,
                  CUDA_R_32F,
                  ldc,
                  0,
                  1,
                  CUBLAS_COMPUTE_32F});
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda,
                                         long long int strideA, const float* B, int ldb,
                                         long long int strideB, const float* beta, float* C,
                                         int ldc, long long int strideC, int batchCount) {
  return classic({"cublasSgemmStridedBatched",
                  handle,
                  transa,
                  transb,
                  m,
                  n,
                  k,
                  alpha,
                  A,
                  CUDA_R_32F,
                  lda,
                  strideA,
                  B,
                  CUDA_R_32F,
                  ldb,
                  strideB,
                  beta,
                  C,
                  CUDA_R_32F,
                  ldc,
                  strideC,
                  batchCount,
                  CUBLAS_COMPUTE_32F});
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t /*algo*/) {
  return classic({"cublasGemmEx", handle, transa, transb, m,          n,   k, alpha, A,
                  Atype,          lda,    0,      B,      Btype,      ldb, 0, beta,  C,
                  Ctype,          ldc,    0,      1,      computeType});
}

cublasStatus_t cublasGemmStridedBatchedEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
    const void* alpha, const void* A, cudaDataType Atype, int lda, long long int strideA,
    const void* B, cudaDataType Btype, int ldb, long long int strideB, const void* beta, void* C,
    cudaDataType Ctype, int ldc, long long int strideC, int batchCount,
    cublasComputeType_t computeType, cublasGemmAlgo_t /*algo*/) {
  return classic({"cublasGemmStridedBatchedEx",
                  handle,
                  transa,
                  transb,
                  m,
                  n,
                  k,
                  alpha,
                  A,
                  Atype,
                  lda,
                  strideA,
                  B,
                  Btype,
                  ldb,
                  strideB,
                  beta,
                  C,
                  Ctype,
                  ldc,
                  strideC,
                  batchCount,
                  computeType});
}

cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const cublasOperation_t transa_array[],
    const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
    const int k_array[], const void* alpha_array, const void* const Aarray[], cudaDataType_t Atype,
    const int lda_array[], const void* const Barray[], cudaDataType_t Btype, const int ldb_array[],
    const void* beta_array, void* const Carray[], cudaDataType_t Ctype, const int ldc_array[],
    int group_count, const int group_size[], cublasComputeType_t computeType) {
  constexpr const char* kCall = "cublasGemmGroupedBatchedEx";
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (group_count == 0) return CUBLAS_STATUS_SUCCESS;
  if (transa_array == nullptr || transb_array == nullptr || m_array == nullptr ||
      n_array == nullptr || k_array == nullptr || alpha_array == nullptr || beta_array == nullptr ||
      lda_array == nullptr || ldb_array == nullptr || ldc_array == nullptr ||
      group_size == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  Elem ae{}, ce{};
  bool integer = false;
  const cublasStatus_t types =
      types_of(Atype, Btype, Ctype, computeType, false, &ae, &ce, &integer);
  if (types != CUBLAS_STATUS_SUCCESS) return types;
  // The host arrays are read now, the device pointer arrays when the work runs.
  struct Group {
    Problem q;
    int64_t a_rows, a_cols, b_rows, b_cols;
    int count;
  };
  std::vector<Group> groups;
  int64_t total = 0;
  for (int g = 0; g < group_count; ++g) {
    const int m = m_array[g], n = n_array[g], k = k_array[g];
    const bool ta = transa_array[g] != CUBLAS_OP_N, tb = transb_array[g] != CUBLAS_OP_N;
    if (!valid_op(transa_array[g]) || !valid_op(transb_array[g]) || m < 0 || n < 0 || k < 0 ||
        group_size[g] < 0) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    Group gr{};
    gr.a_rows = ta ? k : m;
    gr.a_cols = ta ? m : k;
    gr.b_rows = tb ? n : k;
    gr.b_cols = tb ? k : n;
    const auto at_least_one = [](int64_t v) { return v < 1 ? int64_t{1} : v; };
    if (lda_array[g] < at_least_one(gr.a_rows) || ldb_array[g] < at_least_one(gr.b_rows) ||
        ldc_array[g] < at_least_one(m)) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    gr.q.m = m;
    gr.q.n = n;
    gr.q.k = k;
    gr.q.a = {nullptr, ae, lda_array[g], ta};
    gr.q.b = {nullptr, ae, ldb_array[g], tb};
    gr.q.ce = ce;
    gr.q.de = ce;
    gr.q.ldc = ldc_array[g];
    gr.q.ldd = ldc_array[g];
    gr.q.alpha_f = static_cast<const float*>(alpha_array)[g];
    gr.q.beta_f = static_cast<const float*>(beta_array)[g];
    gr.count = group_size[g];
    total += group_size[g];
    groups.push_back(gr);
  }
  if (total == 0) return CUBLAS_STATUS_SUCCESS;
  const int dev = handle->device;
  const size_t ptrs = static_cast<size_t>(total) * sizeof(void*);
  if (!in_device(kCall, "Aarray", Aarray, ptrs, dev) ||
      !in_device(kCall, "Barray", Barray, ptrs, dev) ||
      !in_device(kCall, "Carray", Carray, ptrs, dev)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const size_t es = elem_bytes(ae), cs = elem_bytes(ce);
  const cudaError_t e = emu::enqueue_kernel(handle->stream, kCall, [=] {
    int64_t idx = 0;
    for (const Group& gr : groups) {
      for (int i = 0; i < gr.count; ++i, ++idx) {
        Problem p = gr.q;
        p.a.p = Aarray[idx];
        p.b.p = Barray[idx];
        p.d = Carray[idx];
        p.c = p.d;
        if (p.m == 0 || p.n == 0) continue;
        const std::string at = "Aarray[" + std::to_string(idx) + "]";
        const std::string bt = "Barray[" + std::to_string(idx) + "]";
        const std::string ct = "Carray[" + std::to_string(idx) + "]";
        if (!in_device(kCall, at.c_str(), p.a.p, span_bytes(gr.a_rows, gr.a_cols, p.a.ld, 1, 0, es),
                       dev) ||
            !in_device(kCall, bt.c_str(), p.b.p, span_bytes(gr.b_rows, gr.b_cols, p.b.ld, 1, 0, es),
                       dev) ||
            !in_device(kCall, ct.c_str(), p.d, span_bytes(p.m, p.n, p.ldc, 1, 0, cs), dev)) {
          continue;  // reported; the product is skipped
        }
        run(p);
      }
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

// ---- cuBLASLt

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    *handle = nullptr;
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  *handle = new (std::nothrow) cublasLtContext;
  if (*handle == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  (*handle)->device = emu::current_device();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasLtGetStatusName(cublasStatus_t status) { return status_name(status); }
const char* cublasLtGetStatusString(cublasStatus_t status) { return status_string(status); }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = new (std::nothrow) cublasLtMatmulDescOpaque_t{computeType, scaleType};
  return *desc == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t sizeInBytes) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t v = 0;
  const cublasStatus_t st = read_scalar(buf, sizeInBytes, &v);
  if (attr != CUBLASLT_MATMUL_DESC_BIAS_POINTER && st != CUBLAS_STATUS_SUCCESS) return st;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      desc->compute = static_cast<cublasComputeType_t>(v);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      desc->scale = static_cast<cudaDataType_t>(v);
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      return v == CUBLASLT_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (!valid_op(v)) return CUBLAS_STATUS_INVALID_VALUE;
      (attr == CUBLASLT_MATMUL_DESC_TRANSA ? desc->transa : desc->transb) = v;
      return CUBLAS_STATUS_SUCCESS;
    case CUBLASLT_MATMUL_DESC_TRANSC:
      return v == CUBLAS_OP_N ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    case CUBLASLT_MATMUL_DESC_EPILOGUE: {
      uint32_t ep = 0;
      std::memcpy(&ep, &v, 4);
      return ep == CUBLASLT_EPILOGUE_DEFAULT ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;  // bias, scales, fill mode, ...: not emulated
  }
}
cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attr, void* buf,
                                              size_t sizeInBytes, size_t* sizeWritten) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int32_t v = 0;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      v = desc->compute;
      break;
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      v = desc->scale;
      break;
    case CUBLASLT_MATMUL_DESC_TRANSA:
      v = desc->transa;
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      v = desc->transb;
      break;
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (sizeWritten != nullptr) *sizeWritten = sizeof v;
  if (sizeInBytes == 0)
    return sizeWritten != nullptr ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
  if (buf == nullptr || sizeInBytes != sizeof v) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(buf, &v, sizeof v);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  if (layout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = nullptr;
  Elem e{};
  if (!elem_of(type, &e)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (rows > INT32_MAX || cols > INT32_MAX || ld < 0) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new (std::nothrow) cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return *layout == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t sizeInBytes) {
  if (layout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_ORDER: {
      int32_t v = 0;
      const cublasStatus_t st = read_scalar(buf, sizeInBytes, &v);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
      return v == CUBLASLT_ORDER_COL ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
    }
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: {
      int32_t v = 0;
      const cublasStatus_t st = read_scalar(buf, sizeInBytes, &v);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
      if (v < 1) return CUBLAS_STATUS_INVALID_VALUE;
      layout->batch = v;
      return CUBLAS_STATUS_SUCCESS;
    }
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: {
      int64_t v = 0;
      const cublasStatus_t st = read_scalar(buf, sizeInBytes, &v);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
      if (v < 0) return CUBLAS_STATUS_NOT_SUPPORTED;
      layout->stride = v;
      return CUBLAS_STATUS_SUCCESS;
    }
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new (std::nothrow) cublasLtMatmulPreferenceOpaque_t;
  return *pref == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t sizeInBytes) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) {
    return read_scalar(buf, sizeInBytes, &pref->max_workspace);
  }
  if (attr == CUBLASLT_MATMUL_PREF_SEARCH_MODE) {
    uint32_t v = 0;
    return read_scalar(buf, sizeInBytes, &v);
  }
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t /*preference*/, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (requestedAlgoCount < 1 || heuristicResultsArray == nullptr || returnAlgoCount == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *returnAlgoCount = 0;
  LtShape s{};
  const cublasStatus_t st = lt_shape(desc, Adesc, Bdesc, Cdesc, Ddesc, &s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  heuristicResultsArray[0] = cublasLtMatmulHeuristicResult_t{};
  heuristicResultsArray[0].state = CUBLAS_STATUS_SUCCESS;
  heuristicResultsArray[0].wavesCount = 1.0F;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                              cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                              cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t* /*algo*/, void* /*workspace*/,
                              size_t /*workspaceSizeInBytes*/, cudaStream_t stream) {
  constexpr const char* kCall = "cublasLtMatmul";
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  LtShape s{};
  const cublasStatus_t st = lt_shape(desc, Adesc, Bdesc, Cdesc, Ddesc, &s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (s.integer && !int8_layout_ok(true, false, 4, 4, 4, 4, 4, A, B, D)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;  // misaligned pointers
  }
  if (s.m == 0 || s.n == 0) return CUBLAS_STATUS_SUCCESS;
  const size_t es = elem_bytes(s.ae), cs = elem_bytes(s.ce);
  const int dev = handle->device;
  const auto span = [&](cublasLtMatrixLayout_t l, size_t bytes) {
    return span_bytes(static_cast<int64_t>(l->rows), static_cast<int64_t>(l->cols), l->ld, l->batch,
                      l->stride, bytes);
  };
  Problem q{};
  q.m = s.m;
  q.n = s.n;
  q.k = s.k;
  q.a = {A, s.ae, Adesc->ld, s.ta};
  q.b = {B, s.ae, Bdesc->ld, s.tb};
  q.c = C;
  q.ce = s.ce;
  q.ldc = Cdesc->ld;
  q.d = D;
  q.de = s.ce;
  q.ldd = Ddesc->ld;
  q.integer = s.integer;
  if (s.integer) {
    q.alpha_i = *static_cast<const int32_t*>(alpha);
    q.beta_i = *static_cast<const int32_t*>(beta);
  } else {
    q.alpha_f = *static_cast<const float*>(alpha);
    q.beta_f = *static_cast<const float*>(beta);
  }
  const bool reads_c = s.integer ? q.beta_i != 0 : q.beta_f != 0;
  if (!in_device(kCall, "A", A, span(Adesc, es), dev) ||
      !in_device(kCall, "B", B, span(Bdesc, es), dev) ||
      (reads_c && !in_device(kCall, "C", C, span(Cdesc, cs), dev)) ||
      !in_device(kCall, "D", D, span(Ddesc, cs), dev)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int64_t sa = Adesc->stride, sb = Bdesc->stride, sc = Cdesc->stride, sd = Ddesc->stride;
  const int32_t batch = s.batch;
  const cudaError_t e = emu::enqueue_kernel(stream, kCall, [q, sa, sb, sc, sd, batch, es, cs] {
    for (int32_t i = 0; i < batch; ++i) {
      Problem p = q;
      p.a.p = static_cast<const char*>(q.a.p) + static_cast<size_t>(i * sa) * es;
      p.b.p = static_cast<const char*>(q.b.p) + static_cast<size_t>(i * sb) * es;
      p.c = static_cast<const char*>(q.c) + static_cast<size_t>(i * sc) * cs;
      p.d = static_cast<char*>(q.d) + static_cast<size_t>(i * sd) * cs;
      run(p);
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // extern "C"
