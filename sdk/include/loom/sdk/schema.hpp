// Parameter schemas: a few builder calls become the static loom_param_spec array that a
// factory publishes.
//
//   static loom::sdk::Schema schema() {
//     using namespace loom::sdk;
//     return {
//         Float("momentum", 0.0, "Momentum factor.").range(0, 1),
//         Float("eps", 1e-8, "Added to the denominator.").greater_than(0),
//         Int("seed", 0, "Random seed.").int_range(0, INT64_MAX),   // exact int64 bounds
//         Int("freeze_step", 100000, "Steps before compression starts.").min(1),
//         FloatList("betas", {0.9, 0.999}, "Adam's betas.").length(2).range(0, 1),
//         String("mode", "fast", "Kernel choice.").choices({"fast", "exact"}),
//         Bool("nesterov", false, "Use Nesterov momentum."),
//         Ref("comm", LOOM_KIND_COMM, "The transport.").required(),
//     };
//   }
#ifndef LOOM_SDK_SCHEMA_HPP
#define LOOM_SDK_SCHEMA_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::sdk {

// One parameter as written by the plugin author. Owns its strings and lists; the
// loom_param_spec that points into them is built once by Schema (see SchemaStorage).
class Param {
 public:
  Param(loom_param_type type, std::string name, std::string doc)
      : type_(type), name_(std::move(name)), doc_(std::move(doc)) {}

  loom_param_type type() const { return type_; }
  const std::string& name() const { return name_; }

 protected:
  friend class SchemaStorage;

  loom_param_type type_;
  std::string name_;
  std::string doc_;
  bool required_ = false;
  int32_t length_ = 0;
  double min_ = -std::numeric_limits<double>::infinity();
  double max_ = std::numeric_limits<double>::infinity();
  bool min_exclusive_ = false;
  bool max_exclusive_ = false;
  // Int / IntList: exact bounds (LOOM_PARAM_INT_RANGE) once int_range/int_min/int_max is
  // used; kept in step with min_/max_ by every bound setter.
  bool int_range_ = false;
  int64_t int_min_ = std::numeric_limits<int64_t>::min();
  int64_t int_max_ = std::numeric_limits<int64_t>::max();
  bool bool_default_ = false;
  int64_t int_default_ = 0;
  double float_default_ = 0.0;
  std::string string_default_;
  bool has_string_default_ = false;
  std::vector<int64_t> int_list_default_;
  std::vector<double> float_list_default_;
  std::vector<std::string> string_list_default_;
  std::vector<std::string> choices_;
  std::string ref_kind_;
};

namespace detail {

// The fluent part every builder shares; returns the builder's own type so that calls chain
// in any order.
template <class Self>
class ParamBuilder : public Param {
 public:
  using Param::Param;

  // The manifest must set the parameter; any default is ignored.
  Self required() const {
    Self copy = self();
    copy.required_ = true;
    return copy;
  }

 protected:
  const Self& self() const { return static_cast<const Self&>(*this); }
};

// The integer bound an integer x must meet for `x >= lo` (inclusive) or `x > lo`
// (exclusive) to hold as it does against the double lo; saturates at the int64 limits.
inline int64_t int_lower_bound(double lo, bool exclusive) {
  if (std::isnan(lo) || lo <= -0x1p63) return std::numeric_limits<int64_t>::min();
  if (lo >= 0x1p63) return std::numeric_limits<int64_t>::max();
  return static_cast<int64_t>(exclusive ? std::floor(lo) : std::ceil(lo));
}
inline int64_t int_upper_bound(double hi, bool exclusive) {
  if (std::isnan(hi) || hi >= 0x1p63) return std::numeric_limits<int64_t>::max();
  if (hi <= -0x1p63) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(exclusive ? std::ceil(hi) : std::floor(hi));
}
// An int64 as a double rounded down (lower bounds) or up (upper bounds), so a reader that
// only knows the double bounds (a host before ABI 1.2) accepts at least every valid value.
inline double double_at_or_below(int64_t v) {
  if (v == std::numeric_limits<int64_t>::min()) return -std::numeric_limits<double>::infinity();
  double d = static_cast<double>(v);
  if (static_cast<long double>(d) > static_cast<long double>(v)) {
    d = std::nextafter(d, -std::numeric_limits<double>::infinity());
  }
  return d;
}
inline double double_at_or_above(int64_t v) {
  if (v == std::numeric_limits<int64_t>::max()) return std::numeric_limits<double>::infinity();
  double d = static_cast<double>(v);
  if (static_cast<long double>(d) < static_cast<long double>(v)) {
    d = std::nextafter(d, std::numeric_limits<double>::infinity());
  }
  return d;
}

// Bounds for numbers and for each element of numeric lists: inclusive (range, min, max) or
// exclusive (greater_than, less_than). Setting a bound again replaces it.
template <class Self>
class NumericBuilder : public ParamBuilder<Self> {
 public:
  using ParamBuilder<Self>::ParamBuilder;

  Self range(double lo, double hi) const { return this->self().min(lo).max(hi); }
  Self min(double lo) const { return lower(lo, false); }
  Self max(double hi) const { return upper(hi, false); }
  // value > lo, e.g. a learning-rate-like ratio or an epsilon: .greater_than(0).
  Self greater_than(double lo) const { return lower(lo, true); }
  // value < hi.
  Self less_than(double hi) const { return upper(hi, true); }

 protected:
  Self lower(double lo, bool exclusive) const {
    Self copy = this->self();
    copy.min_ = lo;
    copy.min_exclusive_ = exclusive;
    copy.int_min_ = int_lower_bound(lo, exclusive);
    return copy;
  }
  Self upper(double hi, bool exclusive) const {
    Self copy = this->self();
    copy.max_ = hi;
    copy.max_exclusive_ = exclusive;
    copy.int_max_ = int_upper_bound(hi, exclusive);
    return copy;
  }
};

// Int and IntList: bounds as exact int64 values (LOOM_PARAM_INT_RANGE), for ranges the
// double bounds cannot state exactly (past 2^53). Inclusive; greater_than/less_than still
// make a bound exclusive.
template <class Self>
class IntBuilder : public NumericBuilder<Self> {
 public:
  using NumericBuilder<Self>::NumericBuilder;

  Self int_range(int64_t lo, int64_t hi) const { return this->self().int_min(lo).int_max(hi); }
  Self int_min(int64_t lo) const {
    Self copy = this->self();
    copy.int_range_ = true;
    copy.int_min_ = lo;
    copy.min_ = double_at_or_below(lo);
    copy.min_exclusive_ = false;
    return copy;
  }
  Self int_max(int64_t hi) const {
    Self copy = this->self();
    copy.int_range_ = true;
    copy.int_max_ = hi;
    copy.max_ = double_at_or_above(hi);
    copy.max_exclusive_ = false;
    return copy;
  }
};

template <class Self>
class ListBuilder {
 public:
  // Exact number of elements the manifest must give (0: any).
  Self length(int32_t n) const {
    Self copy = static_cast<const Self&>(*this);
    copy.length_ = n;
    return copy;
  }
};

template <class Self>
class ChoicesBuilder {
 public:
  // The only values allowed (for lists: for each element).
  Self choices(std::initializer_list<std::string> allowed) const {
    Self copy = static_cast<const Self&>(*this);
    copy.choices_.assign(allowed.begin(), allowed.end());
    return copy;
  }
};

}  // namespace detail

class Bool : public detail::ParamBuilder<Bool> {
 public:
  Bool(std::string name, bool default_value, std::string doc)
      : ParamBuilder(LOOM_PARAM_BOOL, std::move(name), std::move(doc)) {
    bool_default_ = default_value;
  }
};

class Int : public detail::IntBuilder<Int> {
 public:
  Int(std::string name, int64_t default_value, std::string doc)
      : IntBuilder(LOOM_PARAM_INT, std::move(name), std::move(doc)) {
    int_default_ = default_value;
  }
};

class Float : public detail::NumericBuilder<Float> {
 public:
  Float(std::string name, double default_value, std::string doc)
      : NumericBuilder(LOOM_PARAM_FLOAT, std::move(name), std::move(doc)) {
    float_default_ = default_value;
  }
};

class String : public detail::ParamBuilder<String>, public detail::ChoicesBuilder<String> {
 public:
  String(std::string name, std::string default_value, std::string doc)
      : ParamBuilder(LOOM_PARAM_STRING, std::move(name), std::move(doc)) {
    string_default_ = std::move(default_value);
    has_string_default_ = true;
  }

 private:
  friend class detail::ChoicesBuilder<String>;
};

class IntList : public detail::IntBuilder<IntList>, public detail::ListBuilder<IntList> {
 public:
  IntList(std::string name, std::vector<int64_t> default_value, std::string doc)
      : IntBuilder(LOOM_PARAM_INT_LIST, std::move(name), std::move(doc)) {
    int_list_default_ = std::move(default_value);
  }

 private:
  friend class detail::ListBuilder<IntList>;
};

class FloatList : public detail::NumericBuilder<FloatList>, public detail::ListBuilder<FloatList> {
 public:
  FloatList(std::string name, std::vector<double> default_value, std::string doc)
      : NumericBuilder(LOOM_PARAM_FLOAT_LIST, std::move(name), std::move(doc)) {
    float_list_default_ = std::move(default_value);
  }

 private:
  friend class detail::ListBuilder<FloatList>;
};

class StringList : public detail::ParamBuilder<StringList>,
                   public detail::ListBuilder<StringList>,
                   public detail::ChoicesBuilder<StringList> {
 public:
  StringList(std::string name, std::vector<std::string> default_value, std::string doc)
      : ParamBuilder(LOOM_PARAM_STRING_LIST, std::move(name), std::move(doc)) {
    string_list_default_ = std::move(default_value);
  }

 private:
  friend class detail::ListBuilder<StringList>;
  friend class detail::ChoicesBuilder<StringList>;
};

// A reference to another instance of kind `kind` (e.g. LOOM_KIND_COMM), named in the
// manifest. Optional unless .required() or given a default instance name.
class Ref : public detail::ParamBuilder<Ref> {
 public:
  Ref(std::string name, std::string kind, std::string doc)
      : ParamBuilder(LOOM_PARAM_REF, std::move(name), std::move(doc)) {
    ref_kind_ = std::move(kind);
  }

  // The instance used when the manifest does not name one, e.g. "world".
  Ref default_instance(std::string instance) const {
    Ref copy = *this;
    copy.string_default_ = std::move(instance);
    copy.has_string_default_ = true;
    return copy;
  }
};

// The ordered list of a factory's parameters.
class Schema {
 public:
  Schema() = default;
  Schema(std::initializer_list<Param> params) : params_(params) {}

  Schema& add(Param param) {
    params_.push_back(std::move(param));
    return *this;
  }
  const std::vector<Param>& params() const { return params_; }

 private:
  std::vector<Param> params_;
};

// Owns a schema and the C view of it. Never copied or moved once built, because the specs
// point into the Params' strings and vectors; the SDK keeps one in static storage per
// factory so the pointers stay valid while the library is loaded.
class SchemaStorage {
 public:
  // Throws Error(INVALID_ARGUMENT) when the schema itself is wrong (a bug in the plugin).
  explicit SchemaStorage(const Schema& schema) : params_(schema.params()) {
    specs_.reserve(params_.size());
    choice_ptrs_.resize(params_.size());
    string_list_ptrs_.resize(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      validate(i);
      specs_.push_back(make_spec(i));
    }
  }
  SchemaStorage(const SchemaStorage&) = delete;
  SchemaStorage& operator=(const SchemaStorage&) = delete;

  const loom_param_spec* data() const { return specs_.empty() ? nullptr : specs_.data(); }
  std::size_t size() const { return specs_.size(); }

 private:
  static bool valid_name(const std::string& name) {
    if (name.empty()) return false;
    for (char c : name) {
      if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
    }
    return true;
  }

  static bool is_numeric(loom_param_type t) {
    return t == LOOM_PARAM_INT || t == LOOM_PARAM_FLOAT || t == LOOM_PARAM_INT_LIST ||
           t == LOOM_PARAM_FLOAT_LIST;
  }

  static bool int_range_allows_some(const Param& p) {
    // Widen to avoid overflow at the int64 limits.
    const auto lo = static_cast<long double>(p.int_min_) + (p.min_exclusive_ ? 1 : 0);
    const auto hi = static_cast<long double>(p.int_max_) - (p.max_exclusive_ ? 1 : 0);
    return lo <= hi;
  }

  [[noreturn]] static void fail(const Param& p, const std::string& what) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "schema parameter '" + p.name_ + "': " + what);
  }

  void validate(std::size_t index) const {
    const Param& p = params_[index];
    if (!valid_name(p.name_)) fail(p, "name must match [a-z0-9_]+");
    for (std::size_t j = 0; j < index; ++j) {
      if (params_[j].name_ == p.name_) fail(p, "declared twice");
    }
    if (std::isnan(p.min_) || std::isnan(p.max_) || p.min_ > p.max_ ||
        (p.min_ == p.max_ && (p.min_exclusive_ || p.max_exclusive_))) {
      fail(p, "empty range");
    }
    // Integers: no integer in the range is an empty range too (> 3 and < 4), whichever
    // bounds the spec carries; int_min_/int_max_ follow every bound setter.
    const bool integral = p.type_ == LOOM_PARAM_INT || p.type_ == LOOM_PARAM_INT_LIST;
    if (integral && !int_range_allows_some(p)) fail(p, "empty range");
    if (p.length_ < 0) fail(p, "negative list length");
    if (p.type_ == LOOM_PARAM_REF && p.ref_kind_.empty()) fail(p, "reference without a kind");
    if (p.required_) return;  // the default is ignored
    auto in_range = [&](double v) {
      return (p.min_exclusive_ ? v > p.min_ : v >= p.min_) &&
             (p.max_exclusive_ ? v < p.max_ : v <= p.max_);
    };
    auto int_in_range = [&](int64_t v) {
      if (!p.int_range_) return in_range(static_cast<double>(v));
      return (p.min_exclusive_ ? v > p.int_min_ : v >= p.int_min_) &&
             (p.max_exclusive_ ? v < p.int_max_ : v <= p.int_max_);
    };
    auto allowed = [&](const std::string& s) {
      if (p.choices_.empty()) return true;
      for (const std::string& c : p.choices_) {
        if (c == s) return true;
      }
      return false;
    };
    auto check_length = [&](std::size_t n) {
      if (p.length_ != 0 && n != static_cast<std::size_t>(p.length_)) {
        fail(p, "default has " + std::to_string(n) + " elements, length() says " +
                    std::to_string(p.length_));
      }
    };
    switch (p.type_) {
      case LOOM_PARAM_INT:
        if (!int_in_range(p.int_default_)) fail(p, "default out of range");
        break;
      case LOOM_PARAM_FLOAT:
        if (!in_range(p.float_default_)) fail(p, "default out of range");
        break;
      case LOOM_PARAM_STRING:
        if (!allowed(p.string_default_)) fail(p, "default is not one of the choices");
        break;
      case LOOM_PARAM_INT_LIST:
        check_length(p.int_list_default_.size());
        for (int64_t v : p.int_list_default_) {
          if (!int_in_range(v)) fail(p, "default element out of range");
        }
        break;
      case LOOM_PARAM_FLOAT_LIST:
        check_length(p.float_list_default_.size());
        for (double v : p.float_list_default_) {
          if (!in_range(v)) fail(p, "default element out of range");
        }
        break;
      case LOOM_PARAM_STRING_LIST:
        check_length(p.string_list_default_.size());
        for (const std::string& s : p.string_list_default_) {
          if (!allowed(s)) fail(p, "default element '" + s + "' is not one of the choices");
        }
        break;
      default:
        break;
    }
  }

  loom_param_spec make_spec(std::size_t index) {
    const Param& p = params_[index];
    loom_param_spec spec{};
    spec.struct_size = LOOM_PARAM_SPEC_SIZE;
    spec.type = p.type_;
    spec.name = p.name_.c_str();
    spec.doc = p.doc_.c_str();
    spec.required = p.required_ ? 1 : 0;
    spec.list_length = p.length_;
    spec.min = is_numeric(p.type_) ? p.min_ : -std::numeric_limits<double>::infinity();
    spec.max = is_numeric(p.type_) ? p.max_ : std::numeric_limits<double>::infinity();
    if (is_numeric(p.type_)) {
      if (p.min_exclusive_) spec.flags |= LOOM_PARAM_MIN_EXCLUSIVE;
      if (p.max_exclusive_) spec.flags |= LOOM_PARAM_MAX_EXCLUSIVE;
    }
    if (p.int_range_ && (p.type_ == LOOM_PARAM_INT || p.type_ == LOOM_PARAM_INT_LIST)) {
      spec.flags |= LOOM_PARAM_INT_RANGE;
      spec.int_min = p.int_min_;
      spec.int_max = p.int_max_;
    }
    if (!p.choices_.empty()) {
      std::vector<const char*>& ptrs = choice_ptrs_[index];
      for (const std::string& c : p.choices_) ptrs.push_back(c.c_str());
      ptrs.push_back(nullptr);
      spec.choices = ptrs.data();
    }
    spec.ref_kind = p.type_ == LOOM_PARAM_REF ? p.ref_kind_.c_str() : nullptr;

    loom_value& v = spec.default_value;
    v.struct_size = LOOM_VALUE_SIZE;
    v.type = p.type_;
    switch (p.type_) {
      case LOOM_PARAM_BOOL:
        v.int_value = p.bool_default_ ? 1 : 0;
        break;
      case LOOM_PARAM_INT:
        v.int_value = p.int_default_;
        break;
      case LOOM_PARAM_FLOAT:
        v.float_value = p.float_default_;
        break;
      case LOOM_PARAM_STRING:
      case LOOM_PARAM_REF:
        v.string_value = p.has_string_default_ ? p.string_default_.c_str() : nullptr;
        break;
      case LOOM_PARAM_INT_LIST:
        v.count = p.int_list_default_.size();
        v.int_list = p.int_list_default_.empty() ? nullptr : p.int_list_default_.data();
        break;
      case LOOM_PARAM_FLOAT_LIST:
        v.count = p.float_list_default_.size();
        v.float_list = p.float_list_default_.empty() ? nullptr : p.float_list_default_.data();
        break;
      case LOOM_PARAM_STRING_LIST: {
        std::vector<const char*>& ptrs = string_list_ptrs_[index];
        for (const std::string& s : p.string_list_default_) ptrs.push_back(s.c_str());
        v.count = ptrs.size();
        v.string_list = ptrs.empty() ? nullptr : ptrs.data();
        break;
      }
      default:
        break;
    }
    return spec;
  }

  // Sized once in the constructor and never resized afterwards: the specs point into them.
  const std::vector<Param> params_;
  std::vector<loom_param_spec> specs_;
  std::vector<std::vector<const char*>> choice_ptrs_;
  std::vector<std::vector<const char*>> string_list_ptrs_;
};

}  // namespace loom::sdk

#endif  // LOOM_SDK_SCHEMA_HPP
