/* Kind "loom.quantizer/1" (since ABI 1.5): weight and activation quantization with real packed
 * storage, and matmuls that compute with the packed form.
 *
 * A quantizer turns a float tensor into packed codes plus scales (and zero points), described
 * by a loom_quant_format (loom/quant_format.h, which defines every byte), turns them back,
 * and multiplies activations by a packed weight without materialising the float weight.
 * Which scheme (bits, symmetric or not, group size, binary or ternary) is the instance's
 * parameters; `layout` reports the format it produces for a shape, so a caller sizes and
 * records everything before quantizing, and a file written with one format is read back with
 * the same description.
 *
 * Roles:
 *   LOOM_QUANTIZER_WEIGHT: a matrix W [N, K] (out features, in features), as a linear layer
 *     y = x . W^T stores it. Groups run along K (axis 1), so a group never spans two output
 *     rows and per-row scales (group_size K) fold into a GEMM's epilogue.
 *   LOOM_QUANTIZER_ACTIVATION: activations X [M, K], one scale per token (row), computed on
 *     the fly from the data (dynamic).
 *
 * Quantisation-aware training uses quantize then dequantize in the forward pass (the weight
 * the layer sees is the quantized one) and the straight-through estimator in backward (the
 * gradient passes to the float weight unchanged), which the trainer computes.
 *
 * Tensors of a call live on one device (CPU or CUDA); device work is enqueued on `stream`.
 * Every call is [any]: an instance holds only its parameters.
 *
 * The factory's vtable points to a loom_quantizer_v1. */
#ifndef LOOM_KINDS_QUANTIZER_H
#define LOOM_KINDS_QUANTIZER_H

#include <loom/abi.h>
#include <loom/quant_format.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_QUANTIZER "loom.quantizer/1"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum loom_quantizer_role {
  LOOM_QUANTIZER_WEIGHT = 1,    /* W [N, K], groups along K */
  LOOM_QUANTIZER_ACTIVATION = 2 /* X [M, K], one dynamic scale per row */
} loom_quantizer_role;

/* loom_quantizer_layout_args.flags (out) */
#define LOOM_QUANTIZER_HAS_MATMUL (1u << 0) /* matmul is set and takes this weight format */
#define LOOM_QUANTIZER_INT8_ACTIVATIONS                                  \
  (1u << 1) /* matmul quantizes x per token to INT8 and multiplies codes \
             * by codes (W8A8, W4A8); else it multiplies float x by the  \
             * weight's decoded values (weight-only) */

typedef struct loom_quantizer_layout_args {
  uint32_t struct_size;
  uint32_t reserved;
  int32_t role;         /* loom_quantizer_role */
  int32_t ndim;         /* 2 */
  const int64_t* shape; /* [N, K] or [M, K]; the format's shape points here */
  DLDataType dtype;     /* of the float side: float32, bfloat16 or float16 (a plugin refuses
                         * one it does not take, naming it) */
  uint32_t reserved2;
  /* The activation rows of the matmul to size its workspace for (0: no matmul planned). */
  int64_t matmul_rows;
  /* out: the caller's descriptor (its struct_size set); layout fills it, with shape =
   * args->shape, so it lives as long as the caller's shape array */
  loom_quant_format* format;
  /* out */
  uint32_t flags; /* LOOM_QUANTIZER_* */
  uint32_t reserved3;
  uint64_t packed_bytes;           /* the uint8 tensor of codes */
  int64_t scale_count;             /* elements of the scale tensor */
  int64_t zero_point_count;        /* elements of the zero-point tensor (0: none) */
  uint64_t workspace_bytes;        /* scratch of quantize and dequantize */
  uint64_t matmul_workspace_bytes; /* scratch of a matmul of matmul_rows rows */
} loom_quantizer_layout_args;
#define LOOM_QUANTIZER_LAYOUT_ARGS_SIZE \
  LOOM_STRUCT_SIZE(loom_quantizer_layout_args, matmul_workspace_bytes)
LOOM_CHECK_STRUCT_SIZE(loom_quantizer_layout_args, LOOM_QUANTIZER_LAYOUT_ARGS_SIZE);

/* quantize: x -> packed, scales (, zero_points). dequantize: the reverse, x written.
 * x is [shape] of layout's dtype, contiguous; packed is uint8 [packed_bytes]; scales has the
 * format's scale dtype and scale_count elements, zero_points its zero-point dtype and
 * zero_point_count elements (NULL when 0). `format` is what layout returned for this shape
 * and role (a mismatch is LOOM_ERR_INVALID_ARGUMENT, naming the field). quantize refuses
 * non-finite input, naming the first such element. */
typedef struct loom_quantizer_quantize_args {
  uint32_t struct_size;
  uint32_t reserved;
  int32_t role;
  uint32_t reserved2;
  const loom_quant_format* format;
  DLTensor* x;
  DLTensor* packed;
  DLTensor* scales;
  DLTensor* zero_points;
  void* workspace; /* workspace_bytes from layout (256-byte aligned; NULL when 0) */
  uint64_t workspace_bytes;
  void* stream; /* cudaStream_t for device tensors, NULL otherwise */
  /* Since 1.7, quantize only (dequantize ignores it). Optional, out: int64 [1] on x's device.
   * Given, a quantize does not fail for x's values: it writes there, in stream order, -1 when
   * x could be quantized, else the row-major index of x's first non-finite element (or
   * numel(x) + g when the elements of group g are finite but its scale overflows float32,
   * where the quantizer checks that; the codes are then unspecified), and a call on CUDA
   * returns without waiting for the device. NULL, or a 1.6 caller's shorter args: such an x is
   * an INVALID_ARGUMENT error naming the element, for which a CUDA call waits for its
   * stream. */
  DLTensor* first_bad LOOM_APPENDED_FIELD;
} loom_quantizer_quantize_args;
#define LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_quantizer_quantize_args, first_bad)
/* The size of a 1.5 / 1.6 caller's quantize args (no first_bad). */
#define LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE_1_5 LOOM_STRUCT_SIZE(loom_quantizer_quantize_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_quantizer_quantize_args, LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE);

/* y [M, N] = x [M, K] . W^T (+ bias [N]), W [N, K] given packed with its weight format, float
 * x, y and bias of one dtype (layout's). With
 * LOOM_QUANTIZER_INT8_ACTIVATIONS the result is that of x quantized per token (symmetric
 * INT8, scale max|x_m| / 127) times the decoded W, accumulated exactly in int32 and scaled in
 * the epilogue; otherwise that of float x times the decoded W. Either way W is never expanded
 * to floats in memory. */
typedef struct loom_quantizer_matmul_args {
  uint32_t struct_size;
  uint32_t reserved;
  const loom_quant_format* format; /* W's, from layout with role WEIGHT */
  const DLTensor* x;               /* [M, K], contiguous */
  const DLTensor* packed;          /* W's codes */
  const DLTensor* scales;
  const DLTensor* zero_points; /* or NULL */
  const DLTensor* bias;        /* [N] or NULL */
  DLTensor* y;                 /* out: [M, N], contiguous (written) */
  void* workspace;             /* matmul_workspace_bytes from layout for M rows or more */
  uint64_t workspace_bytes;
  void* stream;
} loom_quantizer_matmul_args;
#define LOOM_QUANTIZER_MATMUL_ARGS_SIZE LOOM_STRUCT_SIZE(loom_quantizer_matmul_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_quantizer_matmul_args, LOOM_QUANTIZER_MATMUL_ARGS_SIZE);

typedef struct loom_quantizer_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] Pure: the format of a shape and role, and the buffer sizes. Refuses a group size
   * that does not divide K (when the scheme needs whole groups), bits out of range and the
   * like, naming the parameter. */
  loom_status* (*layout)(void* instance, loom_quantizer_layout_args* args);
  /* [any] See loom_quantizer_quantize_args. */
  loom_status* (*quantize)(void* instance, const loom_quantizer_quantize_args* args);
  loom_status* (*dequantize)(void* instance, const loom_quantizer_quantize_args* args);
  /* [any] Optional (NULL: layout never sets LOOM_QUANTIZER_HAS_MATMUL). */
  loom_status* (*matmul)(void* instance, const loom_quantizer_matmul_args* args);
} loom_quantizer_v1;
#define LOOM_QUANTIZER_V1_SIZE LOOM_STRUCT_SIZE(loom_quantizer_v1, matmul)
LOOM_CHECK_STRUCT_SIZE(loom_quantizer_v1, LOOM_QUANTIZER_V1_SIZE);
/* The smallest table a host accepts for this kind (every field: the kind is new in 1.5). */
#define LOOM_QUANTIZER_V1_MIN_SIZE LOOM_QUANTIZER_V1_SIZE

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_QUANTIZER_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(quantizer, QUANTIZER)
#endif
