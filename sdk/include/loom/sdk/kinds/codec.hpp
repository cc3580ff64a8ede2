// The "loom.codec/1" kind in the SDK (loom/kinds/codec.h): the base class a gradient codec
// derives from and the table the SDK builds from it. Running codecs over a communicator is
// loom/sdk/compressed_allreduce.hpp's (a helper library for callers).
#ifndef LOOM_SDK_KINDS_CODEC_HPP
#define LOOM_SDK_KINDS_CODEC_HPP

#include <loom/kinds/codec.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>

#include <concepts>
#include <cstdint>

namespace loom::sdk {

// "loom.codec/1"
//   required: void layout(loom_codec_layout&), bool supports_device(DLDevice),
//             void encode(const loom_codec_encode_args&),
//             void decode(const loom_codec_decode_args&)
//   optional: void decode_sum(const loom_codec_decode_args&) (one chunk-length output)
struct Codec {
  static constexpr const char* kKind = LOOM_KIND_CODEC;
  using sdk_kind = Codec;
};

namespace detail {

template <class T>
struct CodecTable {
  using E = Entry<T>;

  static loom_status* layout(void* instance, loom_codec_layout* layout) noexcept {
    return E::filled(instance, layout, "codec layout",
                     [](T& obj, loom_codec_layout& full) { obj.layout(full); });
  }
  static int32_t supports_device(void* instance, DLDevice device) noexcept {
    return E::template value<int32_t>(0, instance,
                                      [&](T& obj) { return obj.supports_device(device) ? 1 : 0; });
  }
  static loom_status* encode(void* instance, const loom_codec_encode_args* args) noexcept {
    return E::forward(instance, args, "encode args", [](T& obj, const auto& a) { obj.encode(a); });
  }
  static loom_status* decode(void* instance, const loom_codec_decode_args* args) noexcept {
    return E::forward(instance, args, "decode args", [](T& obj, const auto& a) { obj.decode(a); });
  }
  static loom_status* decode_sum(void* instance, const loom_codec_decode_args* args) noexcept {
    return E::forward(instance, args, "decode args",
                      [](T& obj, const auto& a) { obj.decode_sum(a); });
  }

  static const loom_codec_v1* get() {
    static_assert(
        requires(T & t, loom_codec_layout & l, DLDevice d, const loom_codec_encode_args& e,
                 const loom_codec_decode_args& x) {
          t.layout(l);
          { t.supports_device(d) } -> std::convertible_to<bool>;
          t.encode(e);
          t.decode(x);
        },
        "a Codec needs layout, supports_device, encode and decode");
    static const loom_codec_v1 table = [] {
      loom_codec_v1 v{};
      v.struct_size = LOOM_CODEC_V1_SIZE;
      v.layout = &layout;
      v.supports_device = &supports_device;
      v.encode = &encode;
      v.decode = &decode;
      // Optional: a codec without decode_sum leaves it NULL (callers fall back to decode).
      if constexpr (requires(T & t, const loom_codec_decode_args& x) { t.decode_sum(x); }) {
        v.decode_sum = &decode_sum;
      }
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Codec> {
  template <class T>
  static const void* table() {
    return CodecTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_CODEC_HPP
