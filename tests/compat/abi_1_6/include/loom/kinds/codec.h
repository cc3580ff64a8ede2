/* Kind "loom.codec/1": lossy compression of fp32 buffers with error feedback, used by
 * the compressed allreduce (written once in Loom over any loom.comm transport).
 * The factory's vtable points to a loom_codec_v1.
 *
 * A buffer of n elements is split into `chunk_count` equal chunks; each chunk encodes
 * to exactly chunk_bytes(n / chunk_count) bytes, which include whatever the codec
 * needs to decode it alone (for example its scale). Chunks are laid out back to
 * back, so chunk i of an encoded buffer can be sent to rank i as it is. */
#ifndef LOOM_KINDS_CODEC_H
#define LOOM_KINDS_CODEC_H

#include <loom/abi.h>

/* This kind's ID: loom_factory.kind of a plugin that provides it. */
#define LOOM_KIND_CODEC "loom.codec/1"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_codec_layout {
  uint32_t struct_size;
  uint32_t reserved;
  /* in */
  uint64_t elements;  /* unpadded length of the buffer */
  int32_t world_size; /* number of chunks the buffer will be split into */
  int32_t reserved2;
  /* out */
  uint64_t padded_elements; /* >= elements, a multiple of world_size, as the codec needs */
  uint64_t chunk_bytes;     /* encoded size of one chunk of padded_elements / world_size */
} loom_codec_layout;
#define LOOM_CODEC_LAYOUT_SIZE LOOM_STRUCT_SIZE(loom_codec_layout, chunk_bytes)
LOOM_CHECK_STRUCT_SIZE(loom_codec_layout, LOOM_CODEC_LAYOUT_SIZE);

typedef struct loom_codec_encode_args {
  uint32_t struct_size;
  uint32_t chunk_count;
  const DLTensor* input; /* fp32, padded length (a layout's padded_elements) */
  DLTensor* error;       /* fp32, same length, error-feedback buffer (in/out); NULL: none */
  void* output;          /* chunk_count * chunk_bytes bytes, same device as input */
  void* stream;
} loom_codec_encode_args;
#define LOOM_CODEC_ENCODE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_codec_encode_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_codec_encode_args, LOOM_CODEC_ENCODE_ARGS_SIZE);

typedef struct loom_codec_decode_args {
  uint32_t struct_size;
  uint32_t chunk_count;
  const void* input;  /* chunk_count encoded chunks */
  DLTensor* output;   /* fp32, chunk_count * chunk elements */
  float alpha;        /* decoded values are multiplied by alpha */
  int32_t accumulate; /* 1: output += alpha * decoded; 0: output = alpha * decoded */
  void* stream;
} loom_codec_decode_args;
#define LOOM_CODEC_DECODE_ARGS_SIZE LOOM_STRUCT_SIZE(loom_codec_decode_args, stream)
LOOM_CHECK_STRUCT_SIZE(loom_codec_decode_args, LOOM_CODEC_DECODE_ARGS_SIZE);

typedef struct loom_codec_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  /* [any] Fills the out fields of `layout`. */
  loom_status* (*layout)(void* instance, loom_codec_layout* layout);
  /* [any] 1 when the codec can run on tensors on `device`. */
  int32_t (*supports_device)(void* instance, DLDevice device);
  /* [instance] Encodes input + error into chunks and, when error is set, stores the new
   * residual (input + error - decoded) in error. */
  loom_status* (*encode)(void* instance, const loom_codec_encode_args* args);
  /* [instance] Decodes chunks into output. */
  loom_status* (*decode)(void* instance, const loom_codec_decode_args* args);
  /* [instance] Optional (ABI 1.1; NULL or absent: decode the chunks one by one with
   * `accumulate`). Decodes the chunk_count chunks and sums them into ONE chunk-length
   * output: output (=|+=) alpha * chunk 0 + alpha * chunk 1 + ..., each addition rounded
   * in fp32 in chunk order, so the result is bit-identical to chunk_count decode calls
   * (the first with `accumulate`, the others accumulating) while writing the output once.
   * The compressed allreduce's server step uses it. `output` has chunk elements. */
  loom_status* (*decode_sum)(void* instance, const loom_codec_decode_args* args);
} loom_codec_v1;
#define LOOM_CODEC_V1_SIZE LOOM_STRUCT_SIZE(loom_codec_v1, decode_sum)
LOOM_CHECK_STRUCT_SIZE(loom_codec_v1, LOOM_CODEC_V1_SIZE);
/* The smallest table a host accepts for this kind: the fields of the first ABI minor that
 * had it (later fields are optional and checked against struct_size before use). */
#define LOOM_CODEC_V1_MIN_SIZE LOOM_STRUCT_SIZE(loom_codec_v1, decode)

#ifdef __cplusplus
}
#endif

#endif /* LOOM_KINDS_CODEC_H */

/* This kind's row in the kind list (loom/kinds/kinds.def): outside the include guard, so a
 * reader that defines LOOM_KIND(section, NAME) and includes the list gets one row per kind. */
#ifdef LOOM_KIND
LOOM_KIND(codec, CODEC)
#endif
