/* compatNN_codec: an 8-bit absmax codec as a third party would have written it against an
 * old minor's ABI headers (tests/compat/abi_1_0 or abi_1_1), in plain C11, without the SDK.
 * The 1.0 build's function table ends at `decode` (1.0 had no decode_sum); the 1.1 build
 * fills decode_sum. No state (its factory's export_state and import_state are NULL).
 *
 * A chunk of c elements encodes to 4 + c bytes: the fp32 scale s = max|x| / levels, then
 * c int8 values q = clamp(lrintf(x / s), -levels, levels) (all 0 when s is 0), x being
 * input + error. Decoding gives alpha * (q * s), all in fp32; with error feedback the new
 * error is x - q * s. */
#include <loom/abi.h>
#include <loom/kinds/codec.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "compat_common.h"

LOOM_STATIC_ASSERT(LOOM_ABI_MAJOR == 1 && LOOM_ABI_MINOR == COMPAT_MINOR,
                   "built against the wrong ABI headers");
#if COMPAT_MINOR == 0
LOOM_STATIC_ASSERT(LOOM_CODEC_V1_SIZE == 40, "ABI 1.0 codec table ends at decode");
#else
LOOM_STATIC_ASSERT(LOOM_CODEC_V1_SIZE == 48, "ABI 1.1 codec table ends at decode_sum");
#endif

typedef struct codec {
  int64_t levels;
} codec;

static loom_status* codec_create(const loom_host_services* host, void** out_instance) {
  if (host == NULL || out_instance == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT, "create: NULL argument");
  }
  if (host->param_count != 1 || host->params == NULL ||
      strcmp(host->params[0].name, "levels") != 0) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "create: expected the one parameter 'levels'");
  }
  codec* c = calloc(1, sizeof *c);
  if (c == NULL) return compat_fail(COMPAT_NAME, LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  c->levels = host->params[0].value.int_value;
  *out_instance = c;
  return NULL;
}

static void codec_destroy(void* instance) { free(instance); }

static loom_status* codec_layout(void* instance, loom_codec_layout* layout) {
  (void)instance;
  if (layout == NULL || layout->struct_size < LOOM_CODEC_LAYOUT_SIZE || layout->world_size < 1) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "layout: needs a full layout struct and world_size >= 1");
  }
  const uint64_t w = (uint64_t)layout->world_size;
  const uint64_t chunk = (layout->elements + w - 1) / w;
  layout->padded_elements = chunk * w;
  layout->chunk_bytes = 4 + chunk;
  return NULL;
}

static int32_t codec_supports_device(void* instance, DLDevice device) {
  (void)instance;
  return device.device_type == kDLCPU ? 1 : 0;
}

static loom_status* codec_encode(void* instance, const loom_codec_encode_args* args) {
  const codec* c = instance;
  if (args == NULL || args->struct_size < LOOM_CODEC_ENCODE_ARGS_SIZE || args->chunk_count == 0 ||
      !compat_is_f32_cpu(args->input) || args->output == NULL) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "encode: needs fp32 CPU input, output and chunk_count >= 1");
  }
  const int64_t n = compat_numel(args->input);
  if (n % args->chunk_count != 0 || (args->error != NULL && (!compat_is_f32_cpu(args->error) ||
                                                             compat_numel(args->error) != n))) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "encode: %lld elements do not split into %u chunks (or the error buffer "
                       "differs)",
                       (long long)n, (unsigned)args->chunk_count);
  }
  const int64_t per = n / args->chunk_count;
  const float* in = compat_f32(args->input);
  float* err = args->error != NULL ? compat_f32(args->error) : NULL;
  unsigned char* out = args->output;
  const float levels = (float)c->levels;
  for (uint32_t k = 0; k < args->chunk_count; ++k) {
    const int64_t base = (int64_t)k * per;
    float amax = 0.0f;
    for (int64_t i = 0; i < per; ++i) {
      const float x = in[base + i] + (err != NULL ? err[base + i] : 0.0f);
      if (fabsf(x) > amax) amax = fabsf(x);
    }
    const float scale = amax / levels;
    unsigned char* chunk = out + (size_t)k * (size_t)(4 + per);
    memcpy(chunk, &scale, 4);
    for (int64_t i = 0; i < per; ++i) {
      const float x = in[base + i] + (err != NULL ? err[base + i] : 0.0f);
      long q = scale > 0.0f ? lrintf(x / scale) : 0;
      if (q > c->levels) q = (long)c->levels;
      if (q < -c->levels) q = -(long)c->levels;
      const int8_t q8 = (int8_t)q;
      memcpy(chunk + 4 + i, &q8, 1);
      if (err != NULL) err[base + i] = x - (float)q8 * scale;
    }
  }
  return NULL;
}

/* Checks decode args; *per gets the chunk length. */
static loom_status* check_decode(const loom_codec_decode_args* args, int sum, int64_t* per) {
  if (args == NULL || args->struct_size < LOOM_CODEC_DECODE_ARGS_SIZE || args->chunk_count == 0 ||
      args->input == NULL || !compat_is_f32_cpu(args->output)) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "decode: needs input, fp32 CPU output and chunk_count >= 1");
  }
  const int64_t n = compat_numel(args->output);
  if (sum) {
    *per = n;
    return NULL;
  }
  if (n % args->chunk_count != 0) {
    return compat_fail(COMPAT_NAME, LOOM_ERR_INVALID_ARGUMENT,
                       "decode: %lld output elements do not split into %u chunks", (long long)n,
                       (unsigned)args->chunk_count);
  }
  *per = n / args->chunk_count;
  return NULL;
}

static float decoded(const unsigned char* chunk, int64_t i, float alpha) {
  float scale = 0.0f;
  int8_t q = 0;
  memcpy(&scale, chunk, 4);
  memcpy(&q, chunk + 4 + i, 1);
  return alpha * ((float)q * scale);
}

static loom_status* codec_decode(void* instance, const loom_codec_decode_args* args) {
  (void)instance;
  int64_t per = 0;
  loom_status* st = check_decode(args, 0, &per);
  if (st != NULL) return st;
  const unsigned char* in = args->input;
  float* out = compat_f32(args->output);
  for (uint32_t k = 0; k < args->chunk_count; ++k) {
    const unsigned char* chunk = in + (size_t)k * (size_t)(4 + per);
    for (int64_t i = 0; i < per; ++i) {
      const float v = decoded(chunk, i, args->alpha);
      float* o = &out[(int64_t)k * per + i];
      *o = args->accumulate ? *o + v : v;
    }
  }
  return NULL;
}

#if COMPAT_MINOR >= 1
/* 1.1: every chunk summed into one chunk-length output, in chunk order, fp32. */
static loom_status* codec_decode_sum(void* instance, const loom_codec_decode_args* args) {
  (void)instance;
  int64_t per = 0;
  loom_status* st = check_decode(args, 1, &per);
  if (st != NULL) return st;
  const unsigned char* in = args->input;
  float* out = compat_f32(args->output);
  for (int64_t i = 0; i < per; ++i) {
    float acc = decoded(in, i, args->alpha);
    if (args->accumulate) acc = out[i] + acc;
    for (uint32_t k = 1; k < args->chunk_count; ++k) {
      acc = acc + decoded(in + (size_t)k * (size_t)(4 + per), i, args->alpha);
    }
    out[i] = acc;
  }
  return NULL;
}
#endif

static const loom_param_spec k_specs[] = {
    {LOOM_PARAM_SPEC_SIZE,
     LOOM_PARAM_INT,
     "levels",
     "Quantisation levels on each side of 0.",
     0,
     0,
     {LOOM_VALUE_SIZE, LOOM_PARAM_INT, 127, 0.0, NULL, 0, NULL, NULL, NULL, NULL, NULL},
     1.0,
     127.0,
     NULL,
     NULL COMPAT_SPEC_TAIL},
};

static const loom_codec_v1 k_table = {LOOM_CODEC_V1_SIZE,
                                      0,
                                      codec_layout,
                                      codec_supports_device,
                                      codec_encode,
                                      codec_decode
#if COMPAT_MINOR >= 1
                                      ,
                                      codec_decode_sum
#endif
};

LOOM_EXPORT const loom_plugin_v1* loom_plugin_entry_v1(void) {
  static const loom_plugin_v1* plugin = NULL;
  if (plugin != NULL) return plugin;
  const loom_param_spec* specs = guarded_copy(k_specs, sizeof k_specs);
  const loom_codec_v1* table = guarded_copy(&k_table, LOOM_CODEC_V1_SIZE);
  if (specs == NULL || table == NULL) return NULL;
  const loom_factory factory = {LOOM_FACTORY_SIZE,
                                0,
                                LOOM_KIND_CODEC,
                                specs,
                                1,
                                codec_create,
                                codec_destroy,
                                table,
                                NULL,
                                NULL COMPAT_FACTORY_TAIL};
  const loom_factory* f = guarded_copy(&factory, LOOM_FACTORY_SIZE);
  if (f == NULL) return NULL;
  const loom_factory* const* factories = guarded_copy(&f, sizeof f);
  if (factories == NULL) return NULL;
  const loom_plugin_v1 desc = {LOOM_PLUGIN_V1_SIZE,
                               1,
                               COMPAT_MINOR,
                               COMPAT_NAME,
                               "1." COMPAT_MINOR_TEXT ".0",
                               "8-bit absmax codec built from the ABI 1." COMPAT_MINOR_TEXT
                               " headers (compatibility tests)",
                               factories,
                               1};
  plugin = guarded_copy(&desc, LOOM_PLUGIN_V1_SIZE);
  return plugin;
}
