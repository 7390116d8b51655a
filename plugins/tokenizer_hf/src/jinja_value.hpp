// Jinja values: the dynamic type the chat-template evaluator computes with.
//
// Semantics follow Python as Jinja exposes it (truthiness, ==, ordering, str() and repr()
// formatting, int/float arithmetic), because templates are written against Python Jinja and the
// rendered text must match byte for byte. Lists and dicts are shared by reference like Python
// objects; dicts keep insertion order.
#pragma once

#include <nlohmann/json.hpp>  // nlohmann::json (conversion in and out)

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "rlhost/tokenizer/chat_template.hpp"  // TemplateLimits

namespace rlh::tok::jinja {

struct Value;
using Array = std::vector<Value>;
struct Object;
struct Context;

// Positional and keyword arguments of a call.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t i, std::string_view name) const;  // positional i or keyword name
};

using NativeFn = std::function<Value(Context&, Args&)>;

struct Callable {
  std::string name;
  NativeFn fn;
};

using Limits = TemplateLimits;  // rlhost/tokenizer/chat_template.hpp

// The limits and counters of the render running on this thread. Functions below that build
// values charge it; outside a render (no budget installed) nothing is counted.
struct Budget {
  Limits lim;
  size_t steps = 0;
  size_t bytes = 0;
  int nesting = 0;
};
Budget* current_budget();
// Installs `b` for this thread for the scope's lifetime.
class BudgetScope {
 public:
  explicit BudgetScope(Budget& b);
  ~BudgetScope();
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;

 private:
  Budget* prev_;
};
void tick();                             // one step
void charge(size_t bytes);               // bytes built or copied
void check_string(size_t bytes);         // a string about to have this size
void check_items(size_t n);              // a list about to have this many items
// Entering one more level of a recursive walk (evaluation, formatting, comparison).
class Nest {
 public:
  Nest();
  ~Nest();
  Nest(const Nest&) = delete;
  Nest& operator=(const Nest&) = delete;

 private:
  Budget* b_;
};

struct Value {
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, Array, Object, Func };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                 // String; for Undefined: the name that was looked up
  std::shared_ptr<Array> arr;    // Array (tuples are arrays too)
  std::shared_ptr<Object> obj;   // Object (dicts, namespaces, loop)
  std::shared_ptr<Callable> fn;  // Func

  Value() = default;
  Value(const Value&) = default;
  Value(Value&&) noexcept = default;
  Value& operator=(const Value&) = default;
  Value& operator=(Value&&) noexcept = default;
  // Lists, dicts and namespaces can nest as deeply as a template loop makes them; releasing the
  // last reference to such a value walks it with a work list instead of recursing.
  ~Value() {
    if ((arr && arr.use_count() == 1) || (obj && obj.use_count() == 1) || (fn && fn.use_count() == 1)) release();
  }
  static Value undefined(std::string name = {}) { Value v; v.s = std::move(name); return v; }
  static Value none() { Value v; v.kind = Kind::None; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = Kind::Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.kind = Kind::Float; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.kind = Kind::String; v.s = std::move(x); return v; }
  static Value array(Array a = {}) { Value v; v.kind = Kind::Array; v.arr = std::make_shared<Array>(std::move(a)); return v; }
  static Value object();
  static Value namespace_object();
  static Value func(std::string name, NativeFn f) {
    Value v; v.kind = Kind::Func; v.fn = std::make_shared<Callable>(Callable{std::move(name), std::move(f)}); return v;
  }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_none() const { return kind == Kind::None; }
  bool is_string() const { return kind == Kind::String; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_object() const { return kind == Kind::Object; }
  double as_double() const { return kind == Kind::Float ? f : kind == Kind::Bool ? (b ? 1 : 0) : static_cast<double>(i); }
  // Python's int(x): a float is truncated; NaN, infinities and floats outside the 64-bit range
  // are an Error (Python raises too, or makes a big integer this engine does not have).
  int64_t as_int() const {
    if (kind == Kind::Bool) return b ? 1 : 0;
    if (kind == Kind::Float) return float_to_int(f);
    return i;
  }
  static int64_t float_to_int(double d);

  bool truthy() const;
  std::string to_str() const;   // Python str()
  std::string repr() const;     // Python repr()
  const char* type_name() const;

 private:
  void release() noexcept;
};

struct Object {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;
  const Value* find(std::string_view k) const {
    for (const auto& [key, v] : items) if (key == k) return &v;
    return nullptr;
  }
  void set(std::string_view k, Value v) {
    for (auto& [key, old] : items) if (key == k) { old = std::move(v); return; }
    items.emplace_back(std::string(k), std::move(v));
  }
};

inline Value Value::object() { Value v; v.kind = Kind::Object; v.obj = std::make_shared<Object>(); return v; }
inline Value Value::namespace_object() { Value v = object(); v.obj->is_namespace = true; return v; }

// Rendering errors (raise_exception, type errors, undefined use); the message is user-facing.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);  // <0, 0, >0; throws Error for unorderable types
std::string py_float_repr(double d);
std::string py_str_repr(std::string_view s);

Value from_json(const nlohmann::json& j);
// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...) like
// transformers' tojson filter. indent < 0 means None.
std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys);

// UTF-8 helpers on code points (Jinja strings index by character).
std::vector<std::string> utf8_chars(std::string_view s);
size_t utf8_length(std::string_view s);

}  // namespace rlh::tok::jinja
