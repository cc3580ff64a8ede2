/* Packed sub-byte quantized data (since ABI 1.2).
 *
 * DLPack 0.6 has no 1-, 2-, 3- or 4-bit types, so packed codes cross the ABI as a uint8
 * DLTensor (code kDLUInt, 8 bits, 1 lane; 1-D and contiguous) of exactly the packed byte
 * count below, together with a loom_quant_format that says how to read the bytes. Scales and
 * zero points, when the scheme has them, travel as ordinary DLTensors of their own dtype
 * beside it; the format says their dtype and shape.
 *
 * The logical tensor has `ndim` dimensions `shape` (in elements). Its elements, in row-major
 * order, are numbered 0 .. numel-1 and their codes, `bits` bits each, are laid end to end in
 * one bit stream: element i occupies stream bits [i * bits, (i + 1) * bits).
 *   LOOM_QUANT_PACK_LSB_FIRST: stream bit k is bit (k % 8) of byte k / 8 (bit 0 = least
 *     significant), and a code's least significant bit comes first. So for 4-bit codes
 *     element 0 is byte0 & 0xF, element 1 is byte0 >> 4.
 *   LOOM_QUANT_PACK_MSB_FIRST: stream bit k is bit 7 - (k % 8) of byte k / 8, and a code's
 *     most significant bit comes first. So element 0 is byte0 >> 4, element 1 byte0 & 0xF.
 * Codes straddle bytes when `bits` does not divide 8. The tensor holds
 * ceil(numel * bits / 8) bytes; the unused bits of the last byte are 0. Rows are not padded
 * to whole bytes.
 *
 * Groups: `group_size` consecutive elements along dimension `axis` share one scale (and zero
 * point); elements that differ in any other coordinate never share one. Along the axis the
 * last group may be shorter. The scale tensor has the logical shape with shape[axis]
 * replaced by ceil(shape[axis] / group_size), row-major and contiguous. group_size 0 means
 * one scale for the whole tensor (a scale tensor of one element); `axis` is then ignored.
 * So per-row scales of a [rows, cols] weight are axis 1, group_size cols; 128-element groups
 * along each row are axis 1, group_size 128.
 *
 * Decoding one element with code q (an unsigned integer of `bits` bits):
 *   LOOM_QUANT_INT, LOOM_QUANT_SYMMETRIC set: q is two's complement signed,
 *     in [-2^(bits-1), 2^(bits-1) - 1]; x = scale * q. No zero points.
 *   LOOM_QUANT_INT, LOOM_QUANT_SYMMETRIC clear: q in [0, 2^bits - 1];
 *     x = scale * (q - zero_point), one zero point per group, same shape as the scales.
 *   LOOM_QUANT_BINARY (bits 1): 0 -> -scale, 1 -> +scale.
 *   LOOM_QUANT_TERNARY (bits 2): 0 -> 0, 1 -> +scale, 2 -> -scale; 3 is invalid data.
 *
 * Rules as for every ABI struct: size first, grows at the end; a reader refuses a scheme,
 * packing or flag bit it does not know rather than guess. loom/sdk/quant_format.hpp checks
 * a descriptor against a uint8 tensor.
 */
#ifndef LOOM_QUANT_FORMAT_H
#define LOOM_QUANT_FORMAT_H

#include <loom/abi.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum loom_quant_scheme {
  LOOM_QUANT_INT = 1,    /* integer codes of 1..8 bits, symmetric or with zero points */
  LOOM_QUANT_BINARY = 2, /* sign codes, 1 bit */
  LOOM_QUANT_TERNARY = 3 /* {-1, 0, +1} codes, 2 bits */
} loom_quant_scheme;

typedef enum loom_quant_packing {
  LOOM_QUANT_PACK_LSB_FIRST = 1, /* element 0 in the least significant bits of byte 0 */
  LOOM_QUANT_PACK_MSB_FIRST = 2  /* element 0 in the most significant bits of byte 0 */
} loom_quant_packing;

/* loom_quant_format.flags */
#define LOOM_QUANT_SYMMETRIC                                 \
  (1u << 0) /* INT: signed codes, no zero points (BINARY and \
               TERNARY are symmetric by definition and set it) */
#define LOOM_QUANT_KNOWN_FLAGS (LOOM_QUANT_SYMMETRIC)

typedef struct loom_quant_format {
  uint32_t struct_size; /* LOOM_QUANT_FORMAT_SIZE */
  int32_t scheme;       /* loom_quant_scheme */
  uint32_t bits;        /* bits per code: 1..8 for INT (2..8 when symmetric), 1 BINARY, 2 TERNARY */
  uint32_t flags;       /* LOOM_QUANT_* bits */
  int32_t packing;      /* loom_quant_packing */
  int32_t axis;         /* the dimension groups run along, 0 .. ndim-1 (ignored for group_size 0) */
  int64_t group_size;   /* elements per group along axis, >= 1; 0: one group for the tensor */
  int32_t ndim;         /* dimensions of the logical (unpacked) tensor, >= 0 */
  uint32_t reserved;    /* 0 */
  const int64_t* shape; /* ndim sizes in elements, each >= 0; borrowed, like DLTensor.shape */
  DLDataType scale_dtype;      /* the scale tensor's dtype: float 32 / 16 or bfloat 16, 1 lane */
  DLDataType zero_point_dtype; /* asymmetric INT: the zero points' dtype (uint 8 or int 8, or
                                  the scale dtype for fractional zero points); all zero
                                  ({0, 0, 0}) when there are none */
} loom_quant_format;
#define LOOM_QUANT_FORMAT_SIZE LOOM_STRUCT_SIZE(loom_quant_format, zero_point_dtype)
LOOM_CHECK_STRUCT_SIZE(loom_quant_format, LOOM_QUANT_FORMAT_SIZE);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_QUANT_FORMAT_H */
