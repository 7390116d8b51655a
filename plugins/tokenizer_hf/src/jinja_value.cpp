// Jinja values: Python-compatible formatting, comparison and JSON conversion (see jinja_value.hpp).
#include "jinja_value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "unicode.hpp"

namespace rlh::tok::jinja {

// ---------------------------------------------------------------------------------------------
// Budget

namespace {
thread_local Budget* t_budget = nullptr;

std::string mib(size_t bytes) {
  return bytes % (1u << 20) == 0 ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes) + " bytes";
}
}  // namespace

Budget* current_budget() { return t_budget; }

BudgetScope::BudgetScope(Budget& b) : prev_(t_budget) { t_budget = &b; }
BudgetScope::~BudgetScope() { t_budget = prev_; }

void tick() {
  Budget* b = t_budget;
  if (b != nullptr && ++b->steps > b->lim.max_steps)
    throw Error("template runs too long (more than " + std::to_string(b->lim.max_steps) + " steps)");
}

void charge(size_t bytes) {
  Budget* b = t_budget;
  if (b == nullptr) return;
  b->bytes += bytes;
  if (b->bytes > b->lim.max_bytes)
    throw Error("template builds or copies more than " + mib(b->lim.max_bytes) + " of values");
}

void check_string(size_t bytes) {
  Budget* b = t_budget;
  if (b != nullptr && bytes > b->lim.max_string)
    throw Error("a string of " + std::to_string(bytes) + " bytes is longer than the limit of " + mib(b->lim.max_string));
}

void check_items(size_t n) {
  Budget* b = t_budget;
  if (b != nullptr && n > b->lim.max_items)
    throw Error("a list of " + std::to_string(n) + " items is longer than the limit of " +
                std::to_string(b->lim.max_items));
}

Nest::Nest() : b_(t_budget) {
  if (b_ != nullptr && ++b_->nesting > b_->lim.max_nesting) {
    --b_->nesting;
    throw Error("template nests more than " + std::to_string(b_->lim.max_nesting) +
                " levels deep (recursion, or a value nested that deeply)");
  }
}
Nest::~Nest() {
  if (b_ != nullptr) --b_->nesting;
}

// ---------------------------------------------------------------------------------------------
// Release without recursion

namespace {
// Containers whose last reference is being dropped, while an outer release() empties them.
struct Graveyard {
  std::vector<std::shared_ptr<Array>> arrs;
  std::vector<std::shared_ptr<Object>> objs;
  std::vector<std::shared_ptr<Callable>> fns;
  bool empty() const { return arrs.empty() && objs.empty() && fns.empty(); }
};
thread_local Graveyard* t_graveyard = nullptr;
}  // namespace

void Value::release() noexcept {
  if (t_graveyard != nullptr) {
    // Inside an outer release: hand the containers over and return, so the nested values of a
    // deep list are freed by the outer loop one level at a time.
    if (arr) t_graveyard->arrs.push_back(std::move(arr));
    if (obj) t_graveyard->objs.push_back(std::move(obj));
    if (fn) t_graveyard->fns.push_back(std::move(fn));
    return;
  }
  Graveyard g;
  t_graveyard = &g;
  if (arr) g.arrs.push_back(std::move(arr));
  if (obj) g.objs.push_back(std::move(obj));
  if (fn) g.fns.push_back(std::move(fn));
  while (!g.empty()) {
    if (!g.arrs.empty()) {
      std::shared_ptr<Array> a = std::move(g.arrs.back());
      g.arrs.pop_back();
      a.reset();  // its items' destructors push their containers into g
    } else if (!g.objs.empty()) {
      std::shared_ptr<Object> o = std::move(g.objs.back());
      g.objs.pop_back();
      o.reset();
    } else {
      std::shared_ptr<Callable> f = std::move(g.fns.back());
      g.fns.pop_back();
      f.reset();
    }
  }
  t_graveyard = nullptr;
}

int64_t Value::float_to_int(double d) {
  if (std::isnan(d)) throw Error("cannot convert float NaN to integer");
  if (std::isinf(d)) throw Error("cannot convert float infinity to integer");
  const double t = std::trunc(d);
  // 2^63 is exactly representable; every double below it in magnitude converts.
  if (t >= 9223372036854775808.0 || t < -9223372036854775808.0)
    throw Error("float " + py_float_repr(d) + " is too large for a 64-bit integer");
  return static_cast<int64_t>(t);
}

// ---------------------------------------------------------------------------------------------

const Value* Args::get(size_t i, std::string_view name) const {
  if (i < pos.size()) return &pos[i];
  for (const auto& [k, v] : kw) if (k == name) return &v;
  return nullptr;
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::Undefined: case Kind::None: return false;
    case Kind::Bool: return b;
    case Kind::Int: return i != 0;
    case Kind::Float: return f != 0.0;
    case Kind::String: return !s.empty();
    case Kind::Array: return !arr->empty();
    case Kind::Object: return obj->is_namespace || !obj->items.empty();
    case Kind::Func: return true;
  }
  return false;
}

const char* Value::type_name() const {
  switch (kind) {
    case Kind::Undefined: return "Undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Array: return "list";
    case Kind::Object: return obj->is_namespace ? "Namespace" : "dict";
    case Kind::Func: return "function";
  }
  return "?";
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  // sci is "-d.ddde+XX": split sign, digits and exponent.
  const bool neg = sci[0] == '-';
  const size_t epos = sci.find('e');
  std::string digits;
  for (size_t k = neg ? 1 : 0; k < epos; ++k) if (sci[k] != '.') digits.push_back(sci[k]);
  const int exp = std::stoi(sci.substr(epos + 1));
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0.";
      out.append(static_cast<size_t>(-exp - 1), '0');
      out += digits;
    } else if (static_cast<size_t>(exp + 1) >= digits.size()) {
      out += digits;
      out.append(static_cast<size_t>(exp + 1) - digits.size(), '0');
      out += ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(exp + 1));
      out += ".";
      out += digits.substr(static_cast<size_t>(exp + 1));
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char eb[16];
  std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + eb;
}

std::string py_str_repr(std::string_view s) {
  const bool has_sq = s.find('\'') != std::string_view::npos;
  const bool has_dq = s.find('"') != std::string_view::npos;
  const char q = has_sq && !has_dq ? '"' : '\'';
  std::string out(1, q);
  const char* p = s.data();
  const char* e = p + s.size();
  while (p < e) {
    char32_t c;
    const int n = uni::decode(p, e, c);
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<char32_t>(q)) { out.push_back('\\'); out.push_back(q); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", static_cast<unsigned>(c));
      out += b;
    } else {
      out.append(p, static_cast<size_t>(n));
    }
    p += n;
  }
  out.push_back(q);
  return out;
}

std::string Value::repr() const {
  switch (kind) {
    case Kind::String: return py_str_repr(s);
    case Kind::Undefined: return "";
    default: return to_str();
  }
}

namespace {
// str() of a list or dict: items are shared, so a list of a list of ... can denote far more text
// than it holds; the string is checked as it grows and every item visited is charged.
void append_container(std::string& out, const Value& v) {
  Nest nest;
  charge(sizeof(Value));
  auto add = [&](std::string_view piece) {
    out += piece;
    check_string(out.size());
    charge(piece.size());
  };
  auto item = [&](const Value& x) {
    if (x.is_array() || x.is_object()) append_container(out, x);
    else add(x.repr());
  };
  if (v.is_array()) {
    add("[");
    for (size_t k = 0; k < v.arr->size(); ++k) {
      if (k) add(", ");
      item((*v.arr)[k]);
    }
    add("]");
    return;
  }
  add(v.obj->is_namespace ? "<Namespace {" : "{");
  bool first = true;
  for (const auto& [k, x] : v.obj->items) {
    if (!first) add(", ");
    first = false;
    add(py_str_repr(k));
    add(": ");
    item(x);
  }
  add(v.obj->is_namespace ? "}>" : "}");
}
}  // namespace

std::string Value::to_str() const {
  switch (kind) {
    case Kind::Undefined: return "";
    case Kind::None: return "None";
    case Kind::Bool: return b ? "True" : "False";
    case Kind::Int: return std::to_string(i);
    case Kind::Float: return py_float_repr(f);
    case Kind::String: return s;
    case Kind::Array:
    case Kind::Object: {
      std::string out;
      append_container(out, *this);
      return out;
    }
    case Kind::Func: return "<function " + fn->name + ">";
  }
  return "";
}

bool equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if ((a.is_array() && b.is_array()) || (a.is_object() && b.is_object())) {
    // Python compares containers item by item after an identity check; deep or shared
    // structures are bounded by the render's nesting and byte budgets.
    if (a.is_array() ? a.arr == b.arr : a.obj == b.obj) return true;
    Nest nest;
    charge(sizeof(Value));
  }
  if (a.is_number() && b.is_number()) {
    if (a.kind == K::Float || b.kind == K::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::Undefined: case K::None: return true;
    case K::String: return a.s == b.s;
    case K::Array:
      if (a.arr->size() != b.arr->size()) return false;
      for (size_t k = 0; k < a.arr->size(); ++k) if (!equal((*a.arr)[k], (*b.arr)[k])) return false;
      return true;
    case K::Object:
      if (a.obj == b.obj) return true;
      if (a.obj->is_namespace || b.obj->is_namespace || a.obj->items.size() != b.obj->items.size()) return false;
      for (const auto& [k, v] : a.obj->items) {
        const Value* o = b.obj->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    case K::Func: return a.fn == b.fn;
    default: return false;
  }
}

int compare(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind == K::Float || b.kind == K::Float) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind == K::String && b.kind == K::String) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  if (a.kind == K::Array && b.kind == K::Array) {
    Nest nest;
    charge(sizeof(Value));
    const size_t n = std::min(a.arr->size(), b.arr->size());
    for (size_t k = 0; k < n; ++k) {
      if (!equal((*a.arr)[k], (*b.arr)[k])) return compare((*a.arr)[k], (*b.arr)[k]);
    }
    return a.arr->size() < b.arr->size() ? -1 : a.arr->size() > b.arr->size() ? 1 : 0;
  }
  throw Error(std::string("'<' not supported between instances of '") + a.type_name() + "' and '" + b.type_name() + "'");
}

Value from_json(const nlohmann::json& j) {
  Nest nest;  // an embedder may hand in any document; readers bound it before (json_input.hpp)
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(INT64_MAX) ? Value::number(static_cast<double>(u)) : Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      Value v = Value::array();
      v.arr->reserve(j.size());
      for (const auto& e : j) v.arr->push_back(from_json(e));
      return v;
    }
    case nlohmann::json::value_t::object: {
      Value v = Value::object();
      for (auto it = j.begin(); it != j.end(); ++it) v.obj->set(it.key(), from_json(it.value()));
      return v;
    }
    default: return Value::none();
  }
}

namespace {

void json_str(std::string& out, std::string_view s) {
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          out += b;
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
}

void dump(std::string& out, const Value& v, int indent, int level, const std::string& isep,
          const std::string& ksep, bool sort_keys, int depth) {
  if (depth > 200) throw Error("tojson: value nested too deeply");
  Nest nest;
  charge(sizeof(Value));
  check_string(out.size());
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    const size_t pad = static_cast<size_t>(indent) * static_cast<size_t>(lvl);
    check_string(out.size() + pad);
    charge(pad);
    out.push_back('\n');
    out.append(pad, ' ');
  };
  using K = Value::Kind;
  switch (v.kind) {
    case K::None: out += "null"; return;
    case K::Bool: out += v.b ? "true" : "false"; return;
    case K::Int: out += std::to_string(v.i); return;
    case K::Float:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f > 0 ? "Infinity" : "-Infinity";
      else out += py_float_repr(v.f);
      return;
    case K::String: json_str(out, v.s); return;
    case K::Array: {
      if (v.arr->empty()) { out += "[]"; return; }
      out.push_back('[');
      for (size_t k = 0; k < v.arr->size(); ++k) {
        if (k) out += isep;
        newline(level + 1);
        dump(out, (*v.arr)[k], indent, level + 1, isep, ksep, sort_keys, depth + 1);
      }
      newline(level);
      out.push_back(']');
      return;
    }
    case K::Object: {
      if (v.obj->items.empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.obj->items) items.push_back(&kv);
      if (sort_keys) std::sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out.push_back('{');
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += isep;
        newline(level + 1);
        json_str(out, items[k]->first);
        out += ksep;
        dump(out, items[k]->second, indent, level + 1, isep, ksep, sort_keys, depth + 1);
      }
      newline(level);
      out.push_back('}');
      return;
    }
    case K::Undefined: throw Error("Object of type Undefined is not JSON serializable");
    case K::Func: throw Error("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep, bool sort_keys) {
  std::string out;
  dump(out, v, indent, 0, item_sep, key_sep, sort_keys, 0);
  return out;
}

std::vector<std::string> utf8_chars(std::string_view s) {
  charge(s.size() * (sizeof(std::string) + 1));
  std::vector<std::string> out;
  size_t k = 0;
  while (k < s.size()) {
    const size_t n = std::min<size_t>(static_cast<size_t>(uni::seq_len(static_cast<unsigned char>(s[k]))), s.size() - k);
    out.emplace_back(s.substr(k, n));
    k += n;
  }
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (const char c : s) if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;
  return n;
}

}  // namespace rlh::tok::jinja
