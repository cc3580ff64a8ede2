// The C API over safetensors files and `loom quantize` (loom/embed.h): exception-free
// wrappers over safetensors::MappedFile, quant::logical_tensors and quantize_file.
#include <loom/embed.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../last_error.hpp"
#include "../safetensors/safetensors.hpp"
#include "../session.hpp"
#include "../status.hpp"
#include "quant_file.hpp"
#include "quantize.hpp"

namespace {

using loom::host::Error;
namespace st = loom::host::safetensors;
namespace quant = loom::host::quant;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

template <typename Fn>
int32_t guarded(Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const Error& e) {
    return loom::host::set_last_error(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return loom::host::set_last_error(LOOM_ERR_RESOURCE_EXHAUSTED, "out of memory");
  } catch (const std::exception& e) {
    return loom::host::set_last_error(LOOM_ERR_INTERNAL, e.what());
  } catch (...) {
    return loom::host::set_last_error(LOOM_ERR_INTERNAL, "unknown exception");
  }
}

int32_t null_arg(const char* fn) {
  return loom::host::set_last_error(LOOM_ERR_INVALID_ARGUMENT, std::string(fn) + ": NULL argument");
}

}  // namespace

struct loom_tensor_file {
  std::unique_ptr<st::MappedFile> file;
  std::vector<quant::LogicalTensor> tensors;
  // Shapes handed out through DLTensors, and aligned copies of misaligned entries.
  std::map<const st::TensorEntry*, std::vector<int64_t>> shapes;
  std::map<const st::TensorEntry*, std::unique_ptr<uint8_t, FreeDeleter>> copies;

  // The entry's data, aligned to its element size.
  void* data(const st::TensorEntry* t) {
    uint8_t* p = file->data(*t);
    const uint32_t a = st::dtype_size(t->dtype);
    if (reinterpret_cast<uintptr_t>(p) % a == 0) return p;  // NOLINT
    auto& copy = copies[t];
    if (!copy) {
      void* c = std::aligned_alloc(8, (t->bytes() + 7) / 8 * 8);
      if (c == nullptr) throw std::bad_alloc();
      std::memcpy(c, p, t->bytes());
      copy.reset(static_cast<uint8_t*>(c));
    }
    return copy.get();
  }

  DLTensor tensor(const st::TensorEntry* t) {
    auto& s = shapes[t];
    s = t->shape;
    DLTensor d{};
    d.data = data(t);
    d.device = {kDLCPU, 0};
    d.ndim = static_cast<int32_t>(s.size());
    d.dtype = st::to_dlpack(t->dtype);
    d.shape = s.data();
    return d;
  }
};

LOOM_API int32_t loom_tensor_file_open(const char* path, loom_tensor_file** out) {
  if (out != nullptr) *out = nullptr;
  if (path == nullptr || out == nullptr) return null_arg("loom_tensor_file_open");
  return guarded([&] {
    auto f = std::make_unique<loom_tensor_file>();
    f->file = std::make_unique<st::MappedFile>(path);
    f->tensors = quant::logical_tensors(f->file->header(), path);
    // Checked once, here, for every reader: the whole file is hashed (the mapping verified
    // its checksums), since what is opened is then read in full (a trainer decodes or
    // multiplies by every tensor), so a per-tensor check would save nothing and let a caller
    // use a tensor before a damaged one was found.
    quant::check_quantized_file(*f->file, f->tensors);
    *out = f.release();
    return loom::host::clear_last_error();
  });
}

LOOM_API void loom_tensor_file_close(loom_tensor_file* file) { delete file; }

LOOM_API size_t loom_tensor_file_count(const loom_tensor_file* file) {
  if (file == nullptr) {
    null_arg("loom_tensor_file_count");
    return 0;
  }
  return file->tensors.size();
}

LOOM_API const char* loom_tensor_file_name(const loom_tensor_file* file, size_t index) {
  if (file == nullptr || index >= file->tensors.size()) {
    loom::host::set_last_error(LOOM_ERR_OUT_OF_RANGE,
                               "loom_tensor_file_name: NULL file or index out of range");
    return nullptr;
  }
  return file->tensors[index].name.c_str();
}

LOOM_API int32_t loom_tensor_file_find(const loom_tensor_file* file, const char* name,
                                       size_t* index) {
  if (file == nullptr || name == nullptr || index == nullptr) {
    return null_arg("loom_tensor_file_find");
  }
  for (size_t i = 0; i < file->tensors.size(); ++i) {
    if (file->tensors[i].name == name) {
      *index = i;
      return loom::host::clear_last_error();
    }
  }
  return loom::host::set_last_error(LOOM_ERR_NOT_FOUND,
                                    file->file->path() + ": no tensor '" + std::string(name) + "'");
}

LOOM_API const char* loom_tensor_file_metadata(const loom_tensor_file* file, const char* key) {
  if (file == nullptr || key == nullptr) {
    null_arg("loom_tensor_file_metadata");
    return nullptr;
  }
  const auto& m = file->file->header().metadata;
  const auto it = m.find(key);
  return it == m.end() ? nullptr : it->second.c_str();
}

LOOM_API int32_t loom_tensor_file_info(loom_tensor_file* file, size_t index,
                                       loom_tensor_info* out) {
  if (file == nullptr || out == nullptr) return null_arg("loom_tensor_file_info");
  if (out->struct_size < LOOM_TENSOR_INFO_SIZE) {
    return loom::host::set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                                      "loom_tensor_file_info: struct_size " +
                                          std::to_string(out->struct_size) + " is smaller than " +
                                          std::to_string(LOOM_TENSOR_INFO_SIZE));
  }
  if (index >= file->tensors.size()) {
    return loom::host::set_last_error(
        LOOM_ERR_OUT_OF_RANGE, file->file->path() + ": tensor index " + std::to_string(index) +
                                   " is out of range (" + std::to_string(file->tensors.size()) +
                                   " tensors)");
  }
  return guarded([&] {
    const auto& lt = file->tensors[index];
    loom_tensor_info info{};
    info.struct_size = LOOM_TENSOR_INFO_SIZE;
    info.name = lt.name.c_str();
    if (lt.plain != nullptr) {
      info.tensor = file->tensor(lt.plain);
    } else {
      const quant::QuantRecord& r = *lt.record;
      info.quantized = 1;
      info.tensor.device = {kDLCPU, 0};
      info.tensor.ndim = static_cast<int32_t>(r.shape.size());
      info.tensor.dtype = st::to_dlpack(r.dtype);
      info.tensor.shape = const_cast<int64_t*>(r.shape.data());
      info.format = r.format();
      info.codes = file->tensor(lt.codes);
      info.scales = file->tensor(lt.scales);
      if (lt.zero_points != nullptr) info.zero_points = file->tensor(lt.zero_points);
      info.plugin = r.plugin.c_str();
      info.quantizer = r.quantizer.c_str();
      info.parameters = r.parameters.c_str();
    }
    std::memcpy(out, &info, sizeof info);
    return loom::host::clear_last_error();
  });
}

LOOM_API int32_t loom_tensor_file_write(const char* path, const loom_tensor_out* tensors,
                                        size_t count, const char* const* metadata,
                                        size_t metadata_count) {
  if (path == nullptr || (tensors == nullptr && count != 0) ||
      (metadata == nullptr && metadata_count != 0)) {
    return null_arg("loom_tensor_file_write");
  }
  return guarded([&] {
    const std::string file(path);
    std::vector<st::OutTensor> out;
    out.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      const loom_tensor_out& t = tensors[i];
      const std::string what = file + ": tensor " + std::to_string(i);
      if (t.struct_size < LOOM_TENSOR_OUT_SIZE || t.name == nullptr || t.dtype == nullptr ||
          t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr) || t.data == nullptr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    what + ": struct_size, name, dtype, ndim, shape or data is missing or invalid");
      }
      const auto dtype = st::parse_dtype(t.dtype);
      if (!dtype) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT, what + " ('" + t.name + "') has dtype '" + t.dtype +
                                                   "'; a file holds " + st::dtype_names());
      }
      out.push_back({t.name, *dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim), t.data});
    }
    std::map<std::string, std::string> meta;
    for (size_t i = 0; i < metadata_count; ++i) {
      if (metadata[2 * i] == nullptr || metadata[2 * i + 1] == nullptr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    file + ": metadata pair " + std::to_string(i) + " has a NULL key or value");
      }
      meta[metadata[2 * i]] = metadata[2 * i + 1];
    }
    st::write_file(file, out, meta);
    return loom::host::clear_last_error();
  });
}

LOOM_API int32_t loom_tensor_file_read_f32(loom_tensor_file* file, size_t index, float* out,
                                           size_t count) {
  if (file == nullptr || (out == nullptr && count != 0)) {
    return null_arg("loom_tensor_file_read_f32");
  }
  if (index >= file->tensors.size()) {
    return loom::host::set_last_error(LOOM_ERR_OUT_OF_RANGE,
                                      file->file->path() + ": tensor index out of range");
  }
  return guarded([&] {
    const auto& lt = file->tensors[index];
    const std::string what = file->file->path() + ": tensor '" + lt.name + "'";
    uint64_t numel = 1;
    if (lt.plain != nullptr) {
      numel = lt.plain->numel;
    } else {
      for (const int64_t d : lt.record->shape) numel *= static_cast<uint64_t>(d);
    }
    if (numel != count) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, what + " has " + std::to_string(numel) +
                                                 " elements, not " + std::to_string(count));
    }
    if (lt.plain != nullptr) {
      if (!quant::to_float32(file->file->data(*lt.plain), lt.plain->dtype, numel, out)) {
        throw Error(
            LOOM_ERR_INVALID_ARGUMENT,
            what + " is " + std::string(st::dtype_name(lt.plain->dtype)) + ", not a float dtype");
      }
    } else {
      quant::decode(*lt.record, file->file->data(*lt.codes), file->file->data(*lt.scales),
                    lt.zero_points != nullptr ? file->file->data(*lt.zero_points) : nullptr, out,
                    what);
    }
    return loom::host::clear_last_error();
  });
}

namespace loom::host {
Session* session_of(loom_session* s);  // embed.cpp: the session behind the C handle
}

LOOM_API int32_t loom_quantize_file(loom_session* session, const char* in_path,
                                    const char* out_path, loom_quantize_progress_fn progress,
                                    void* ctx, loom_quantize_summary* summary) {
  if (session == nullptr || in_path == nullptr || out_path == nullptr) {
    return null_arg("loom_quantize_file");
  }
  if (summary != nullptr && summary->struct_size < LOOM_QUANTIZE_SUMMARY_SIZE) {
    return loom::host::set_last_error(LOOM_ERR_INVALID_ARGUMENT,
                                      "loom_quantize_file: summary struct_size is too small");
  }
  return guarded([&] {
    auto report = [&](const loom::host::QuantizeReport& r) {
      if (progress == nullptr) return;
      loom_quantize_report c{};
      c.struct_size = LOOM_QUANTIZE_REPORT_SIZE;
      c.tensor = r.tensor != nullptr ? r.tensor->c_str() : nullptr;
      c.quantizer = r.quantizer != nullptr ? r.quantizer->c_str() : nullptr;
      c.note = r.note.c_str();
      c.index = r.index;
      c.count = r.count;
      c.mse = r.mse;
      c.max_abs_error = r.max_abs_error;
      c.bytes_in = r.bytes_in;
      c.bytes_out = r.bytes_out;
      progress(ctx, &c);
    };
    const auto s =
        loom::host::quantize_file(*loom::host::session_of(session), in_path, out_path, report);
    if (summary != nullptr) {
      summary->tensors = s.tensors;
      summary->quantized = s.quantized;
      summary->in_file_bytes = s.in_file_bytes;
      summary->out_file_bytes = s.out_file_bytes;
    }
    return loom::host::clear_last_error();
  });
}
