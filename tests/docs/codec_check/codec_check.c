/* The template codec keeps what docs/sdk.md ("Writing a codec") says a codec must:
 * the error-feedback identity, a valid layout for zero elements, 0-element calls,
 * INVALID_ARGUMENT for aliased buffers, non-finite input (error untouched), a bad
 * `accumulate` and an unpadded length, and DATA_LOSS for bytes that are not its chunks.
 *
 * Usage: codec_check PLUGIN_DIR   (the folder holding loom_scaled_sign.so) */
#include <loom/embed.h>
#include <loom/kinds/codec.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond, ...)                        \
  do {                                           \
    if (!(cond)) {                               \
      fprintf(stderr, "codec_check: FAIL: ");    \
      fprintf(stderr, __VA_ARGS__);              \
      fprintf(stderr, " (line %d)\n", __LINE__); \
      ++failures;                                \
    }                                            \
  } while (0)

/* The status's code (0 for NULL), destroying it. */
static int code_of(loom_status* st) {
  if (st == NULL) return 0;
  const int code = st->code;
  st->destroy(st);
  return code;
}

static DLTensor fp32(float* data, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static int encode(const loom_codec_v1* vt, void* obj, DLTensor* in, DLTensor* err, uint32_t chunks,
                  void* out) {
  loom_codec_encode_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
  a.chunk_count = chunks;
  a.input = in;
  a.error = err;
  a.output = out;
  return code_of(vt->encode(obj, &a));
}

static int decode(const loom_codec_v1* vt, void* obj, const void* in, uint32_t chunks,
                  DLTensor* out, int32_t accumulate) {
  loom_codec_decode_args a;
  memset(&a, 0, sizeof a);
  a.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
  a.chunk_count = chunks;
  a.input = in;
  a.output = out;
  a.alpha = 1.0f;
  a.accumulate = accumulate;
  return code_of(vt->decode(obj, &a));
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: codec_check PLUGIN_DIR\n");
    return 2;
  }
  loom_open_options opts;
  memset(&opts, 0, sizeof opts);
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.plugin_path = argv[1];
  opts.log_level = -1;
  loom_session* s = NULL;
  if (loom_open_string("[codec.c]\nplugin = \"scaled_sign\"\n", "check.toml", &opts, &s) !=
      LOOM_OK) {
    fprintf(stderr, "codec_check: %s\n", loom_last_error());
    return 1;
  }
  loom_instance* inst = NULL;
  if (loom_find_instance(s, "codec", "c", &inst) != LOOM_OK) {
    fprintf(stderr, "codec_check: %s\n", loom_last_error());
    return 1;
  }
  const loom_codec_v1* vt = (const loom_codec_v1*)loom_instance_vtable(inst);
  void* obj = loom_instance_object(inst);

  /* Layout: 13 elements on 2 ranks pad to 16 (chunks of 8: one byte of bits + a scale). */
  loom_codec_layout l;
  memset(&l, 0, sizeof l);
  l.struct_size = LOOM_CODEC_LAYOUT_SIZE;
  l.elements = 13;
  l.world_size = 2;
  EXPECT(code_of(vt->layout(obj, &l)) == 0, "layout(13, 2) failed");
  EXPECT(l.padded_elements == 16 && l.chunk_bytes == 5, "layout(13, 2) = %llu, %llu",
         (unsigned long long)l.padded_elements, (unsigned long long)l.chunk_bytes);
  l.elements = 0;
  l.world_size = 3;
  EXPECT(code_of(vt->layout(obj, &l)) == 0, "layout(0, 3) failed");
  EXPECT(l.padded_elements == 0 && l.chunk_bytes == 4, "layout(0, 3) = %llu, %llu",
         (unsigned long long)l.padded_elements, (unsigned long long)l.chunk_bytes);
  l.world_size = 0;
  EXPECT(code_of(vt->layout(obj, &l)) == LOOM_ERR_INVALID_ARGUMENT, "layout(world 0)");

  /* Error feedback: decode(encode(x, e)) + e' == x + e, element by element. */
  float x[16], e[16], before[16], out[16];
  unsigned char wire[10];
  int64_t n16 = 16;
  for (int i = 0; i < 16; ++i) {
    x[i] = (float)sin(1.0 + i) * (i % 3 == 0 ? -2.0f : 1.0f);
    e[i] = 0.125f * (float)cos(2.0 * i);
  }
  x[5] = 0.0f; /* zero and -0.0 both decode to +scale */
  x[6] = -0.0f;
  e[5] = 0.0f;
  e[6] = -0.0f;
  for (int i = 0; i < 16; ++i) before[i] = x[i] + e[i];
  DLTensor xt = fp32(x, &n16), et = fp32(e, &n16), ot = fp32(out, &n16);
  EXPECT(encode(vt, obj, &xt, &et, 2, wire) == 0, "encode failed");
  EXPECT(decode(vt, obj, wire, 2, &ot, 0) == 0, "decode failed");
  EXPECT(out[5] > 0.0f && out[6] > 0.0f, "0 and -0 decoded to %g and %g, not +scale", out[5],
         out[6]);
  for (int i = 0; i < 16; ++i) {
    EXPECT(fabsf(out[i] + e[i] - before[i]) <= 1e-6f * (1.0f + fabsf(before[i])),
           "element %d: decoded %g + new error %g != input + old error %g", i, out[i], e[i],
           before[i]);
  }

  /* Failures change nothing: aliased buffers and non-finite input leave the error as it was. */
  float saved[16];
  memcpy(saved, e, sizeof e);
  DLTensor alias = fp32(x, &n16);
  EXPECT(encode(vt, obj, &xt, &alias, 2, wire) == LOOM_ERR_INVALID_ARGUMENT,
         "error aliasing input was accepted");
  EXPECT(encode(vt, obj, &xt, &et, 2, x) == LOOM_ERR_INVALID_ARGUMENT,
         "output overlapping input was accepted");
  EXPECT(decode(vt, obj, out, 2, &ot, 0) == LOOM_ERR_INVALID_ARGUMENT,
         "decode output overlapping its input was accepted");
  x[3] = NAN;
  EXPECT(encode(vt, obj, &xt, &et, 2, wire) == LOOM_ERR_INVALID_ARGUMENT, "NaN input accepted");
  EXPECT(memcmp(saved, e, sizeof e) == 0, "a failed encode changed the error buffer");
  x[3] = 1.0f;
  EXPECT(decode(vt, obj, wire, 2, &ot, 2) == LOOM_ERR_INVALID_ARGUMENT, "accumulate = 2 accepted");
  int64_t n13 = 13;
  DLTensor unpadded = fp32(x, &n13);
  EXPECT(encode(vt, obj, &unpadded, NULL, 1, wire) == LOOM_ERR_INVALID_ARGUMENT,
         "an unpadded input was accepted");

  /* Bytes that are not this codec's chunks: DATA_LOSS. */
  unsigned char junk[10];
  memset(junk, 0xFF, sizeof junk); /* NaN scales */
  EXPECT(decode(vt, obj, junk, 2, &ot, 0) == LOOM_ERR_DATA_LOSS, "garbage chunks accepted");

  /* Zero elements: NULL data, header-only chunks. */
  int64_t n0 = 0;
  DLTensor empty = fp32(NULL, &n0);
  unsigned char headers[12];
  memset(headers, 0xAB, sizeof headers);
  EXPECT(encode(vt, obj, &empty, NULL, 3, headers) == 0, "encode of 0 elements failed");
  float zero = 1.0f;
  memcpy(&zero, headers + 8, sizeof zero);
  EXPECT(zero == 0.0f, "the third empty chunk's scale is %g, not 0", zero);
  EXPECT(decode(vt, obj, headers, 3, &empty, 0) == 0, "decode of 0 elements failed");

  loom_close(s);
  if (failures == 0) printf("codec_check: ok\n");
  return failures == 0 ? 0 : 1;
}
