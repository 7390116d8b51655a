// Jinja built-ins: filters, tests, str/dict/list methods and global functions, with the Python
// behaviour templates rely on (see jinja_eval.hpp).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>
#include <set>

#include "jinja_eval.hpp"
#include "unicode.hpp"

namespace rlh::tok::jinja {

namespace {

bool py_space(char32_t c) { return uni::is_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

template <class F>
std::string map_cps(std::string_view s, F&& f) {
  std::string out;
  out.reserve(s.size());
  const char* p = s.data();
  const char* e = p + s.size();
  while (p < e) {
    char32_t c;
    p += uni::decode(p, e, c);
    f(c, out);
  }
  charge(out.size());
  return out;
}

std::string upper(std::string_view s) { return map_cps(s, [](char32_t c, std::string& o) { uni::append_upper(o, c); }); }
std::string lower(std::string_view s) { return map_cps(s, [](char32_t c, std::string& o) { uni::append_lower(o, c); }); }

bool is_cased_letter(char32_t c) {
  return uni::is_alphabetic(c) && (uni::to_utf8(c) != upper(uni::to_utf8(c)) || uni::to_utf8(c) != lower(uni::to_utf8(c)));
}

// Python str.title().
std::string py_title(std::string_view s) {
  bool prev_cased = false;
  return map_cps(s, [&](char32_t c, std::string& o) {
    const bool cased = is_cased_letter(c);
    if (cased) {
      if (prev_cased) uni::append_lower(o, c);
      else uni::append_upper(o, c);
    } else {
      uni::append(o, c);
    }
    prev_cased = cased;
  });
}

std::string capitalize(std::string_view s) {
  bool first = true;
  return map_cps(s, [&](char32_t c, std::string& o) {
    if (first) uni::append_upper(o, c);
    else uni::append_lower(o, c);
    first = false;
  });
}

// Python str.strip/lstrip/rstrip with optional character set.
std::string strip(std::string_view s, const Value* chars, bool left, bool right) {
  charge(s.size() * (sizeof(char32_t) + 1));
  std::vector<char32_t> cps;
  const char* p = s.data();
  const char* e = p + s.size();
  while (p < e) {
    char32_t c;
    p += uni::decode(p, e, c);
    cps.push_back(c);
  }
  std::set<char32_t> set;
  const bool custom = chars && chars->is_string();
  if (custom) {
    const char* q = chars->s.data();
    const char* qe = q + chars->s.size();
    while (q < qe) {
      char32_t c;
      q += uni::decode(q, qe, c);
      set.insert(c);
    }
  }
  auto drop = [&](char32_t c) { return custom ? set.count(c) > 0 : py_space(c); };
  size_t b = 0, en = cps.size();
  if (left) while (b < en && drop(cps[b])) ++b;
  if (right) while (en > b && drop(cps[en - 1])) --en;
  std::string out;
  for (size_t k = b; k < en; ++k) uni::append(out, cps[k]);
  return out;
}

std::vector<std::string> split_ws(std::string_view s, int64_t maxsplit) {
  std::vector<std::string> out;
  const char* p = s.data();
  const char* e = p + s.size();
  std::string cur;
  bool in_word = false;
  while (p < e) {
    char32_t c;
    const int n = uni::decode(p, e, c);
    if (py_space(c) && !(maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit && in_word == false && !cur.empty())) {
      if (in_word) {
        out.push_back(cur);
        cur.clear();
        in_word = false;
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
          // The rest (after leading whitespace) is one piece.
          p += n;
          while (p < e) {
            char32_t d;
            const int m = uni::decode(p, e, d);
            if (!py_space(d)) break;
            p += m;
          }
          if (p < e) {
            std::string rest(p, e);
            // Python keeps trailing whitespace in the remainder... except it strips it.
            out.push_back(strip(rest, nullptr, false, true));
          }
          return out;
        }
      }
    } else {
      cur.append(p, static_cast<size_t>(n));
      in_word = true;
    }
    p += n;
  }
  if (in_word) out.push_back(cur);
  return out;
}

std::vector<std::string> split_sep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  if (sep.empty()) throw Error("empty separator");
  std::vector<std::string> out;
  size_t k = 0, f;
  while ((maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) && (f = s.find(sep, k)) != std::string::npos) {
    out.push_back(s.substr(k, f - k));
    k = f + sep.size();
  }
  out.push_back(s.substr(k));
  return out;
}

// Each replacement can insert a long string: the result is checked as it grows, so
// 'a'*1000|replace('a', 'a'*10**6) stops at the string limit instead of allocating a gigabyte.
std::string replace_all(const std::string& s, const std::string& a, const std::string& b, int64_t count) {
  if (a.empty()) {
    // Python inserts `b` between characters (and at both ends).
    auto chars = utf8_chars(s);
    std::string out;
    int64_t done = 0;
    for (size_t k = 0; k <= chars.size(); ++k) {
      if (count < 0 || done < count) { out += b; ++done; }
      if (k < chars.size()) out += chars[k];
      check_string(out.size());
    }
    charge(out.size());
    return out;
  }
  std::string out;
  size_t k = 0, f;
  int64_t done = 0;
  while ((count < 0 || done < count) && (f = s.find(a, k)) != std::string::npos) {
    out.append(s, k, f - k);
    out += b;
    check_string(out.size());
    k = f + a.size();
    ++done;
  }
  out.append(s, k, std::string::npos);
  charge(out.size());
  return out;
}

Value str_list(const std::vector<std::string>& v) {
  check_items(v.size());
  Value r = Value::array();
  r.arr->reserve(v.size());
  for (const auto& s : v) {
    charge(sizeof(Value) + s.size());
    r.arr->push_back(Value::str(s));
  }
  return r;
}

int64_t arg_int(const Args& a, size_t i, const char* name, int64_t dflt) {
  const Value* v = a.get(i, name);
  if (!v || v->is_none()) return dflt;
  if (v->kind != Value::Kind::Int && v->kind != Value::Kind::Bool) throw Error(std::string("argument '") + name + "' must be an integer");
  return v->as_int();
}

bool arg_bool(const Args& a, size_t i, const char* name, bool dflt) {
  const Value* v = a.get(i, name);
  return v ? v->truthy() : dflt;
}

std::string arg_str(const Args& a, size_t i, const char* name, const std::string& dflt) {
  const Value* v = a.get(i, name);
  if (!v || v->is_undefined()) return dflt;
  return v->to_str();
}

// The %[flags][width][.precision] of a printf-style conversion, with width and precision bounded
// by the string limit before anything is formatted (Python pads '%99999999999d' for real).
struct FormatSpec {
  std::string flags;
  long long width = -1, precision = -1;
};

FormatSpec parse_spec(const std::string& fmt, size_t& k) {
  FormatSpec f;
  while (k < fmt.size() && std::string("-+ #0").find(fmt[k]) != std::string::npos) f.flags.push_back(fmt[k++]);
  auto number = [&](long long& out) {
    if (k >= fmt.size() || fmt[k] < '0' || fmt[k] > '9') return;
    out = 0;
    while (k < fmt.size() && fmt[k] >= '0' && fmt[k] <= '9') {
      out = out * 10 + (fmt[k++] - '0');
      check_string(static_cast<size_t>(out));  // also keeps `out` far from overflowing
    }
  };
  number(f.width);
  if (k < fmt.size() && fmt[k] == '.') {
    ++k;
    f.precision = 0;
    number(f.precision);
  }
  return f;
}

template <class T>
std::string c_format(const FormatSpec& f, const char* conv, T v) {
  std::string spec = "%" + f.flags;
  if (f.width >= 0) spec += "*";
  if (f.precision >= 0) spec += ".*";
  spec += conv;
  const int w = static_cast<int>(f.width >= 0 ? f.width : 0), p = static_cast<int>(f.precision >= 0 ? f.precision : 0);
  auto call = [&](char* buf, size_t n) {
    if (f.width >= 0 && f.precision >= 0) return std::snprintf(buf, n, spec.c_str(), w, p, v);
    if (f.width >= 0) return std::snprintf(buf, n, spec.c_str(), w, v);
    if (f.precision >= 0) return std::snprintf(buf, n, spec.c_str(), p, v);
    return std::snprintf(buf, n, spec.c_str(), v);
  };
  const int n = call(nullptr, 0);
  if (n < 0) throw Error("format: cannot format this value");
  check_string(static_cast<size_t>(n));
  std::string out(static_cast<size_t>(n) + 1, '\0');
  call(out.data(), out.size());
  out.resize(static_cast<size_t>(n));
  return out;
}

// Python printf-style formatting for `"..." % args` and |format.
std::string percent_format(const std::string& fmt, const std::vector<Value>& args) {
  std::string out;
  size_t ai = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    check_string(out.size());
    if (fmt[k] != '%') {
      out.push_back(fmt[k]);
      continue;
    }
    if (++k >= fmt.size()) throw Error("incomplete format");
    const FormatSpec spec = parse_spec(fmt, k);
    if (k >= fmt.size()) throw Error("incomplete format");
    const char c = fmt[k];
    if (c == '%') { out.push_back('%'); continue; }
    if (ai >= args.size()) throw Error("not enough arguments for format string");
    const Value& v = args[ai++];
    switch (c) {
      case 's': case 'r': {
        std::string t = c == 's' ? v.to_str() : v.repr();
        if (spec.precision >= 0 && static_cast<size_t>(spec.precision) < t.size()) t.resize(static_cast<size_t>(spec.precision));
        const size_t len = utf8_length(t);
        if (spec.width > 0 && static_cast<size_t>(spec.width) > len) {
          const std::string pad(static_cast<size_t>(spec.width) - len, ' ');
          t = spec.flags.find('-') != std::string::npos ? t + pad : pad + t;
        }
        out += t;
        break;
      }
      case 'd': case 'i':
        if (!v.is_number()) throw Error("%d format: a real number is required");
        out += c_format(spec, "lld", static_cast<long long>(v.as_int()));
        break;
      case 'f': case 'e': case 'g':
        if (!v.is_number()) throw Error("%f format: a real number is required");
        out += c_format(spec, c == 'f' ? "f" : c == 'e' ? "e" : "g", v.as_double());
        break;
      default: throw Error(std::string("unsupported format character '") + c + "'");
    }
  }
  if (ai < args.size()) throw Error("not all arguments converted during string formatting");
  check_string(out.size());
  charge(out.size());
  return out;
}

Value bound(const std::string& name, NativeFn f) { return Value::func(name, std::move(f)); }

Value str_method(const std::string& self, const std::string& name) {
  auto m = [&](NativeFn f) { return bound(name, std::move(f)); };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    return m([self, name](Context&, Args& a) {
      return Value::str(strip(self, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
    });
  }
  if (name == "upper") return m([self](Context&, Args&) { return Value::str(upper(self)); });
  if (name == "lower") return m([self](Context&, Args&) { return Value::str(lower(self)); });
  if (name == "title") return m([self](Context&, Args&) { return Value::str(py_title(self)); });
  if (name == "capitalize") return m([self](Context&, Args&) { return Value::str(capitalize(self)); });
  if (name == "startswith" || name == "endswith") {
    const bool start = name == "startswith";
    return m([self, start](Context&, Args& a) {
      const Value* p = a.get(0, "prefix");
      if (!p) throw Error("startswith/endswith needs an argument");
      std::vector<std::string> cands;
      if (p->is_string()) cands.push_back(p->s);
      else if (p->is_array()) for (const auto& x : *p->arr) {
        if (!x.is_string()) throw Error("tuple for startswith/endswith must only contain str");
        cands.push_back(x.s);
      }
      else throw Error("startswith/endswith argument must be str or a tuple of str");
      for (const auto& c : cands) {
        if (c.size() <= self.size() &&
            (start ? self.compare(0, c.size(), c) == 0 : self.compare(self.size() - c.size(), c.size(), c) == 0)) {
          return Value::boolean(true);
        }
      }
      return Value::boolean(false);
    });
  }
  if (name == "split" || name == "rsplit") {
    return m([self](Context&, Args& a) {
      const Value* sep = a.get(0, "sep");
      const int64_t maxsplit = arg_int(a, 1, "maxsplit", -1);
      if (!sep || sep->is_none()) return str_list(split_ws(self, maxsplit));
      return str_list(split_sep(self, sep->to_str(), maxsplit));
    });
  }
  if (name == "splitlines") {
    return m([self](Context&, Args&) {
      std::vector<std::string> lines;
      size_t k = 0;
      while (k < self.size()) {
        size_t e = self.find_first_of("\r\n", k);
        if (e == std::string::npos) { lines.push_back(self.substr(k)); break; }
        lines.push_back(self.substr(k, e - k));
        k = e + ((self[e] == '\r' && e + 1 < self.size() && self[e + 1] == '\n') ? 2 : 1);
      }
      return str_list(lines);
    });
  }
  if (name == "replace") {
    return m([self](Context&, Args& a) {
      return Value::str(replace_all(self, arg_str(a, 0, "old", ""), arg_str(a, 1, "new", ""), arg_int(a, 2, "count", -1)));
    });
  }
  if (name == "find" || name == "index" || name == "rfind") {
    return m([self, name](Context&, Args& a) {
      const std::string sub = arg_str(a, 0, "sub", "");
      const size_t f = name == "rfind" ? self.rfind(sub) : self.find(sub);
      if (f == std::string::npos) {
        if (name == "index") throw Error("substring not found");
        return Value::integer(-1);
      }
      return Value::integer(static_cast<int64_t>(utf8_length(std::string_view(self).substr(0, f))));
    });
  }
  if (name == "count") {
    return m([self](Context&, Args& a) {
      const std::string sub = arg_str(a, 0, "sub", "");
      if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_length(self) + 1));
      int64_t n = 0;
      for (size_t k = self.find(sub); k != std::string::npos; k = self.find(sub, k + sub.size())) ++n;
      return Value::integer(n);
    });
  }
  if (name == "join") {
    return m([self](Context&, Args& a) {
      const Value* it = a.get(0, "iterable");
      if (!it) throw Error("join needs an argument");
      std::string out;
      bool first = true;
      for (const Value& v : iterate(*it)) {
        if (!v.is_string()) throw Error(std::string("sequence item: expected str instance, ") + v.type_name() + " found");
        if (!first) out += self;
        out += v.s;
        check_string(out.size());
        first = false;
      }
      charge(out.size());
      return Value::str(out);
    });
  }
  if (name == "format") {
    return m([self](Context&, Args& a) {
      // "{}" / "{0}" / "{name}" replacement fields, no format specs.
      std::string out;
      size_t auto_idx = 0;
      for (size_t k = 0; k < self.size(); ++k) {
        if (self[k] == '{' && k + 1 < self.size() && self[k + 1] == '{') { out.push_back('{'); ++k; continue; }
        if (self[k] == '}' && k + 1 < self.size() && self[k + 1] == '}') { out.push_back('}'); ++k; continue; }
        if (self[k] != '{') { out.push_back(self[k]); continue; }
        const size_t e = self.find('}', k);
        if (e == std::string::npos) throw Error("Single '{' encountered in format string");
        const std::string field = self.substr(k + 1, e - k - 1);
        const Value* v;
        if (field.empty()) v = a.get(auto_idx++, "");
        else if (field.find_first_not_of("0123456789") == std::string::npos) v = a.get(std::stoul(field), "");
        else v = a.get(static_cast<size_t>(-1), field);
        if (!v) throw Error("format: missing argument '" + field + "'");
        out += v->to_str();
        check_string(out.size());
        k = e;
      }
      charge(out.size());
      return Value::str(out);
    });
  }
  auto pred = [&](auto f) {
    return m([self, f](Context&, Args&) {
      if (self.empty()) return Value::boolean(false);
      const char* p = self.data();
      const char* e = p + self.size();
      while (p < e) {
        char32_t c;
        p += uni::decode(p, e, c);
        if (!f(c)) return Value::boolean(false);
      }
      return Value::boolean(true);
    });
  };
  if (name == "isdigit") return pred([](char32_t c) { return uni::is_numeric(c); });
  if (name == "isalpha") return pred([](char32_t c) { return uni::is_alphabetic(c); });
  if (name == "isalnum") return pred([](char32_t c) { return uni::is_alphanumeric(c); });
  if (name == "isspace") return pred([](char32_t c) { return py_space(c); });
  if (name == "islower") return m([self](Context&, Args&) { return Value::boolean(lower(self) == self && upper(self) != self); });
  if (name == "isupper") return m([self](Context&, Args&) { return Value::boolean(upper(self) == self && lower(self) != self); });
  return Value::undefined(name);
}

Value dict_method(const Value& self, const std::string& name) {
  auto obj = self.obj;
  if (name == "items") {
    return bound(name, [obj](Context&, Args&) {
      charge(obj->items.size() * 3 * sizeof(Value));
      Value r = Value::array();
      for (const auto& [k, v] : obj->items) r.arr->push_back(Value::array({Value::str(k), v}));
      return r;
    });
  }
  if (name == "keys") {
    return bound(name, [obj](Context&, Args&) {
      charge(obj->items.size() * sizeof(Value));
      Value r = Value::array();
      for (const auto& kv : obj->items) r.arr->push_back(Value::str(kv.first));
      return r;
    });
  }
  if (name == "values") {
    return bound(name, [obj](Context&, Args&) {
      charge(obj->items.size() * sizeof(Value));
      Value r = Value::array();
      for (const auto& kv : obj->items) r.arr->push_back(kv.second);
      return r;
    });
  }
  if (name == "get") {
    return bound(name, [obj](Context&, Args& a) {
      const Value* k = a.get(0, "key");
      if (!k) throw Error("get expected at least 1 argument");
      if (k->is_string()) {
        if (const Value* v = obj->find(k->s)) return *v;
      }
      const Value* d = a.get(1, "default");
      return d ? *d : Value::none();
    });
  }
  return Value::undefined(name);
}

Value list_method(const Value& self, const std::string& name) {
  auto arr = self.arr;
  if (name == "append" || name == "extend" || name == "pop" || name == "insert" || name == "remove" || name == "clear" ||
      name == "sort" || name == "reverse") {
    return bound(name, [name](Context&, Args&) -> Value {
      throw Error("access to attribute '" + name + "' of 'list' object is unsafe (templates cannot modify lists)");
    });
  }
  if (name == "index") {
    return bound(name, [arr](Context&, Args& a) {
      const Value* x = a.get(0, "value");
      charge(arr->size() * sizeof(Value));
      if (x) for (size_t k = 0; k < arr->size(); ++k) if (equal((*arr)[k], *x)) return Value::integer(static_cast<int64_t>(k));
      throw Error("value is not in list");
    });
  }
  if (name == "count") {
    return bound(name, [arr](Context&, Args& a) {
      const Value* x = a.get(0, "value");
      charge(arr->size() * sizeof(Value));
      int64_t n = 0;
      if (x) for (const auto& v : *arr) if (equal(v, *x)) ++n;
      return Value::integer(n);
    });
  }
  return Value::undefined(name);
}

// Attribute lookup used by map(attribute=), sort(attribute=)...: "a.b" paths, digits index lists.
Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t k = 0;
  while (k <= path.size()) {
    const size_t e = path.find('.', k);
    const std::string part = path.substr(k, e == std::string::npos ? std::string::npos : e - k);
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos && cur.is_array()) {
      cur = get_item(cur, Value::integer(std::stoll(part)));
    } else {
      cur = cur.is_object() ? get_item(cur, Value::str(part)) : get_attr(cur, part);
    }
    if (e == std::string::npos) break;
    k = e + 1;
  }
  return cur;
}

// Jinja's sort key: case-insensitive strings unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::str(lower(v.s));
  return v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

Value to_list(const Value& v) { return Value::array(iterate(v)); }

using FilterFn = Value (*)(Context&, Value&, Args&);

bool truthy_test(Context& ctx, const std::string& test, const Value& v, Args& rest) {
  return test.empty() ? v.truthy() : apply_test(ctx, test, v, rest);
}

// select / reject / selectattr / rejectattr
Value select_impl(Context& ctx, Value& v, Args& a, bool by_attr, bool keep) {
  size_t i = 0;
  std::string attr;
  if (by_attr) {
    const Value* at = a.get(i++, "attribute");
    if (!at) throw Error("selectattr needs an attribute");
    attr = at->to_str();
  }
  std::string test;
  if (i < a.pos.size()) test = a.pos[i++].to_str();
  Args rest;
  rest.pos.assign(a.pos.begin() + static_cast<ptrdiff_t>(std::min(i, a.pos.size())), a.pos.end());
  Value r = Value::array();
  for (const Value& item : iterate(v)) {
    const Value x = by_attr ? attr_path(item, attr) : item;
    if (truthy_test(ctx, test, x, rest) == keep) r.arr->push_back(item);
  }
  return r;
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> f = {
      {"abs", [](Context&, Value& v, Args&) {
         if (!v.is_number()) throw Error(std::string("bad operand type for abs(): '") + v.type_name() + "'");
         if (v.kind == Value::Kind::Float) return Value::number(std::fabs(v.f));
         if (v.as_int() == INT64_MIN) throw Error("integer overflow: abs(" + std::to_string(v.i) + ") is outside the 64-bit range");
         return Value::integer(std::llabs(v.as_int()));
       }},
      {"attr", [](Context&, Value& v, Args& a) { return get_attr(v, arg_str(a, 0, "name", "")); }},
      {"capitalize", [](Context&, Value& v, Args&) { return Value::str(capitalize(v.to_str())); }},
      {"center", [](Context&, Value& v, Args& a) {
         const std::string s = v.to_str();
         const int64_t w = arg_int(a, 0, "width", 80);
         const int64_t len = static_cast<int64_t>(utf8_length(s));
         if (w <= len) return Value::str(s);
         check_string(s.size() + static_cast<uint64_t>(w - len));  // before padding is built
         const int64_t total = w - len, left = total / 2 + (total & w & 1);
         return Value::str(std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(total - left), ' '));
       }},
      {"default", [](Context&, Value& v, Args& a) {
         const bool boolean = arg_bool(a, 1, "boolean", false);
         if (v.is_undefined() || (boolean && !v.truthy())) {
           const Value* d = a.get(0, "default_value");
           return d ? *d : Value::str("");
         }
         return v;
       }},
      {"dictsort", [](Context&, Value& v, Args& a) {
         if (!v.is_object()) throw Error("dictsort expects a dict");
         const bool cs = arg_bool(a, 0, "case_sensitive", false);
         const bool by_value = arg_str(a, 1, "by", "key") == "value";
         const bool rev = arg_bool(a, 2, "reverse", false);
         std::vector<std::pair<std::string, Value>> items = v.obj->items;
         std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
           tick();
           const Value kx = by_value ? x.second : Value::str(x.first), ky = by_value ? y.second : Value::str(y.first);
           const int c = compare(sort_key(kx, cs), sort_key(ky, cs));
           return rev ? c > 0 : c < 0;
         });
         Value r = Value::array();
         for (auto& [k, x] : items) r.arr->push_back(Value::array({Value::str(k), x}));
         return r;
       }},
      {"escape", [](Context&, Value& v, Args&) { return Value::str(html_escape(v.to_str())); }},
      {"first", [](Context&, Value& v, Args&) {
         if (v.is_string()) return v.s.empty() ? Value::undefined("first") : Value::str(utf8_chars(v.s).front());
         auto items = iterate(v);
         return items.empty() ? Value::undefined("first") : items.front();
       }},
      {"float", [](Context&, Value& v, Args& a) {
         if (v.is_number()) return Value::number(v.as_double());
         if (v.is_string()) {
           try {
             size_t used;
             const std::string s = strip(v.s, nullptr, true, true);
             const double d = std::stod(s, &used);
             if (used == s.size()) return Value::number(d);
           } catch (const std::exception&) {}
         }
         const Value* d = a.get(0, "default");
         return d ? *d : Value::number(0.0);
       }},
      {"format", [](Context&, Value& v, Args& a) {
         if (!a.kw.empty()) throw Error("format with keyword arguments is not supported");
         return Value::str(percent_format(v.to_str(), a.pos));
       }},
      {"indent", [](Context&, Value& v, Args& a) {
         const Value* w = a.get(0, "width");
         const int64_t width = w && !w->is_string() ? std::max<int64_t>(0, w->as_int()) : 4;
         if (!(w && w->is_string())) check_string(static_cast<uint64_t>(width));
         const std::string ind = w && w->is_string() ? w->s : std::string(static_cast<size_t>(width), ' ');
         const bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
         std::string s = v.to_str() + "\n";
         std::vector<std::string> lines;
         size_t k = 0;
         while (k < s.size()) {
           const size_t e = s.find_first_of("\r\n", k);
           lines.push_back(s.substr(k, e - k));
           k = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
         }
         // Every line gets the indent: lines x width can be far more than either.
         check_string(s.size() + lines.size() * ind.size());
         std::string rv;
         if (blank) {
           for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
         } else {
           rv = lines.empty() ? "" : lines[0];
           for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
         }
         if (first) rv = ind + rv;
         return Value::str(rv);
       }},
      {"int", [](Context&, Value& v, Args& a) {
         // Jinja's do_int: int(x), else int(float(x)), else the default. NaN has no int (the
         // default); an infinity or a float past the 64-bit range is an error (Python raises
         // OverflowError, or makes an integer this engine cannot hold).
         const Value* dflt = a.get(0, "default");
         const Value fallback = dflt ? *dflt : Value::integer(0);
         auto from_float = [&](double x) { return std::isnan(x) ? fallback : Value::integer(Value::float_to_int(x)); };
         if (v.kind == Value::Kind::Float) return from_float(v.f);
         if (v.is_number()) return Value::integer(v.as_int());
         if (v.is_string()) {
           std::string s = strip(v.s, nullptr, true, true);
           s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
           try {
             size_t used;
             const long long x = std::stoll(s, &used, static_cast<int>(arg_int(a, 1, "base", 10)));
             if (used == s.size()) return Value::integer(x);
           } catch (const std::logic_error&) {}
           std::optional<double> d;
           try {
             size_t used;
             const double x = std::stod(s, &used);
             if (used == s.size()) d = x;
           } catch (const std::invalid_argument&) {
           } catch (const std::out_of_range&) {
             d = s.find('-') == std::string::npos ? HUGE_VAL : -HUGE_VAL;  // "1e999": past every double
           }
           if (d) return from_float(*d);
         }
         return fallback;
       }},
      {"items", [](Context&, Value& v, Args&) {
         if (v.is_undefined()) return Value::array();
         if (!v.is_object()) throw Error(std::string("items filter expects a dict, got ") + v.type_name());
         Value r = Value::array();
         for (const auto& [k, x] : v.obj->items) r.arr->push_back(Value::array({Value::str(k), x}));
         return r;
       }},
      {"join", [](Context&, Value& v, Args& a) {
         const std::string sep = arg_str(a, 0, "d", "");
         const Value* attr = a.get(1, "attribute");
         std::string out;
         bool first = true;
         for (const Value& x : iterate(v)) {
           if (!first) out += sep;
           out += (attr ? attr_path(x, attr->to_str()) : x).to_str();
           check_string(out.size());
           first = false;
         }
         charge(out.size());
         return Value::str(out);
       }},
      {"last", [](Context&, Value& v, Args&) {
         if (v.is_string()) return v.s.empty() ? Value::undefined("last") : Value::str(utf8_chars(v.s).back());
         auto items = iterate(v);
         return items.empty() ? Value::undefined("last") : items.back();
       }},
      {"length", [](Context&, Value& v, Args&) {
         switch (v.kind) {
           case Value::Kind::String: return Value::integer(static_cast<int64_t>(utf8_length(v.s)));
           case Value::Kind::Array: return Value::integer(static_cast<int64_t>(v.arr->size()));
           case Value::Kind::Object: return Value::integer(static_cast<int64_t>(v.obj->items.size()));
           case Value::Kind::Undefined: return Value::integer(0);
           default: throw Error(std::string("object of type '") + v.type_name() + "' has no len()");
         }
       }},
      {"list", [](Context&, Value& v, Args&) { return to_list(v); }},
      {"lower", [](Context&, Value& v, Args&) { return Value::str(lower(v.to_str())); }},
      {"map", [](Context& ctx, Value& v, Args& a) {
         Value r = Value::array();
         const Value* attr = nullptr;
         for (const auto& [k, x] : a.kw) if (k == "attribute") attr = &x;
         if (attr) {
           const Value* dflt = nullptr;
           for (const auto& [k, x] : a.kw) if (k == "default") dflt = &x;
           for (const Value& x : iterate(v)) {
             Value y = attr_path(x, attr->to_str());
             r.arr->push_back(y.is_undefined() && dflt ? *dflt : y);
           }
           return r;
         }
         if (a.pos.empty()) throw Error("map needs a filter name or attribute=");
         const std::string name = a.pos[0].to_str();
         Args rest;
         rest.pos.assign(a.pos.begin() + 1, a.pos.end());
         rest.kw = a.kw;
         for (const Value& x : iterate(v)) r.arr->push_back(apply_filter(ctx, name, x, rest));
         return r;
       }},
      {"max", [](Context&, Value& v, Args& a) {
         auto items = iterate(v);
         if (items.empty()) return Value::undefined("max");
         const bool cs = arg_bool(a, 0, "case_sensitive", false);
         const Value* attr = a.get(1, "attribute");
         auto key = [&](const Value& x) { return sort_key(attr ? attr_path(x, attr->to_str()) : x, cs); };
         Value best = items[0];
         for (const auto& x : items) if (compare(key(x), key(best)) > 0) best = x;
         return best;
       }},
      {"min", [](Context&, Value& v, Args& a) {
         auto items = iterate(v);
         if (items.empty()) return Value::undefined("min");
         const bool cs = arg_bool(a, 0, "case_sensitive", false);
         const Value* attr = a.get(1, "attribute");
         auto key = [&](const Value& x) { return sort_key(attr ? attr_path(x, attr->to_str()) : x, cs); };
         Value best = items[0];
         for (const auto& x : items) if (compare(key(x), key(best)) < 0) best = x;
         return best;
       }},
      {"reject", [](Context& ctx, Value& v, Args& a) { return select_impl(ctx, v, a, false, false); }},
      {"rejectattr", [](Context& ctx, Value& v, Args& a) { return select_impl(ctx, v, a, true, false); }},
      {"replace", [](Context&, Value& v, Args& a) {
         return Value::str(replace_all(v.to_str(), arg_str(a, 0, "old", ""), arg_str(a, 1, "new", ""), arg_int(a, 2, "count", -1)));
       }},
      {"reverse", [](Context&, Value& v, Args&) {
         if (v.is_string()) {
           auto cs = utf8_chars(v.s);
           std::string out;
           for (size_t k = cs.size(); k-- > 0;) out += cs[k];
           return Value::str(out);
         }
         auto items = iterate(v);
         std::reverse(items.begin(), items.end());
         return Value::array(std::move(items));
       }},
      {"round", [](Context&, Value& v, Args& a) {
         if (!v.is_number()) throw Error("round expects a number");
         // Past 300 digits a double rounds to itself (or to 0), and 10^prec would overflow.
         const int64_t prec = arg_int(a, 0, "precision", 0);
         const std::string method = arg_str(a, 1, "method", "common");
         if (method != "common" && method != "ceil" && method != "floor") throw Error("method must be common, ceil or floor");
         if (prec > 300) return Value::number(v.as_double());
         if (prec < -300) return Value::number(0.0);
         const double m = std::pow(10.0, static_cast<double>(prec));
         double x = v.as_double() * m;
         if (method == "common") x = std::round(x);
         else if (method == "ceil") x = std::ceil(x);
         else if (method == "floor") x = std::floor(x);
         else throw Error("method must be common, ceil or floor");
         return Value::number(x / m);
       }},
      {"safe", [](Context&, Value& v, Args&) { return v; }},
      {"select", [](Context& ctx, Value& v, Args& a) { return select_impl(ctx, v, a, false, true); }},
      {"selectattr", [](Context& ctx, Value& v, Args& a) { return select_impl(ctx, v, a, true, true); }},
      {"sort", [](Context&, Value& v, Args& a) {
         auto items = iterate(v);
         const bool rev = arg_bool(a, 0, "reverse", false), cs = arg_bool(a, 1, "case_sensitive", false);
         const Value* attr = a.get(2, "attribute");
         auto key = [&](const Value& x) { return sort_key(attr ? attr_path(x, attr->to_str()) : x, cs); };
         std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
           tick();
           const int c = compare(key(x), key(y));
           return rev ? c > 0 : c < 0;
         });
         return Value::array(std::move(items));
       }},
      {"string", [](Context&, Value& v, Args&) { return Value::str(v.to_str()); }},
      {"sum", [](Context&, Value& v, Args& a) {
         const Value* attr = a.get(0, "attribute");
         const Value* start = a.get(1, "start");
         Value acc = start ? *start : Value::integer(0);
         for (const Value& x : iterate(v)) {
           const Value y = attr ? attr_path(x, attr->to_str()) : x;
           if (!y.is_number() || !acc.is_number()) throw Error("sum of non-numbers");
           if (y.kind == Value::Kind::Float || acc.kind == Value::Kind::Float) acc = Value::number(acc.as_double() + y.as_double());
           else {
             int64_t r;
             if (__builtin_add_overflow(acc.as_int(), y.as_int(), &r))
               throw Error("integer overflow: sum is outside the 64-bit range");
             acc = Value::integer(r);
           }
         }
         return acc;
       }},
      {"title", [](Context&, Value& v, Args&) {
         // Jinja: split at runs of [-\s({[<], capitalize each part.
         const std::string s = v.to_str();
         std::string out, word;
         auto flush = [&] { if (!word.empty()) { out += capitalize(word); word.clear(); } };
         const char* p = s.data();
         const char* e = p + s.size();
         while (p < e) {
           char32_t c;
           const int n = uni::decode(p, e, c);
           if (py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<') {
             flush();
             out.append(p, static_cast<size_t>(n));
           } else {
             word.append(p, static_cast<size_t>(n));
           }
           p += n;
         }
         flush();
         return Value::str(out);
       }},
      {"tojson", [](Context&, Value& v, Args& a) {
         const Value* ind = a.get(0, "indent");
         const int64_t want = ind && !ind->is_none() ? ind->as_int() : -1;
         if (want > 0) check_string(static_cast<uint64_t>(want));
         const int indent = want < 0 ? -1 : static_cast<int>(want);
         std::string isep = indent >= 0 ? "," : ", ", ksep = ": ";
         if (const Value* sep = a.get(static_cast<size_t>(-1), "separators"); sep && sep->is_array() && sep->arr->size() == 2) {
           isep = (*sep->arr)[0].to_str();
           ksep = (*sep->arr)[1].to_str();
         }
         return Value::str(to_json(v, indent, isep, ksep, arg_bool(a, static_cast<size_t>(-1), "sort_keys", false)));
       }},
      {"trim", [](Context&, Value& v, Args& a) { return Value::str(strip(v.to_str(), a.get(0, "chars"), true, true)); }},
      {"unique", [](Context&, Value& v, Args& a) {
         const bool cs = arg_bool(a, 0, "case_sensitive", false);
         const Value* attr = a.get(1, "attribute");
         Value r = Value::array();
         std::vector<Value> seen;
         for (const Value& x : iterate(v)) {
           const Value k = sort_key(attr ? attr_path(x, attr->to_str()) : x, cs);
           bool dup = false;
           for (const auto& s : seen) {
             tick();  // n^2 comparisons
             if (equal(s, k)) { dup = true; break; }
           }
           if (!dup) { seen.push_back(k); r.arr->push_back(x); }
         }
         return r;
       }},
      {"upper", [](Context&, Value& v, Args&) { return Value::str(upper(v.to_str())); }},
      {"wordcount", [](Context&, Value& v, Args&) {
         int64_t n = 0;
         bool in = false;
         const std::string s = v.to_str();
         const char* p = s.data();
         const char* e = p + s.size();
         while (p < e) {
           char32_t c;
           p += uni::decode(p, e, c);
           const bool w = uni::is_word(c);
           if (w && !in) ++n;
           in = w;
         }
         return Value::integer(n);
       }},
  };
  return f;
}

const std::unordered_map<std::string, std::string>& filter_aliases() {
  static const std::unordered_map<std::string, std::string> a = {
      {"d", "default"}, {"e", "escape"}, {"count", "length"}};
  return a;
}

bool is_test_name(const std::string& n) {
  static const std::set<std::string> t = {
      "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "escaped", "even", "false", "filter",
      "float", "ge", "gt", "greaterthan", "in", "integer", "iterable", "le", "lower", "lessthan", "lt", "mapping",
      "ne", "none", "number", "odd", "sameas", "sequence", "string", "test", "true", "undefined", "upper",
      "==", "!=", "<", "<=", ">", ">="};
  return t.count(n) > 0;
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) || filter_aliases().count(name); }
bool has_test(const std::string& name) { return is_test_name(name); }

Value apply_filter(Context& ctx, const std::string& name, Value operand, Args& args) {
  auto al = filter_aliases().find(name);
  const std::string& real = al == filter_aliases().end() ? name : al->second;
  auto it = filters().find(real);
  if (it == filters().end()) throw Error("no filter named '" + name + "'");
  return it->second(ctx, operand, args);
}

bool apply_test(Context&, const std::string& name, const Value& v, Args& a) {
  using K = Value::Kind;
  const Value* arg = a.get(0, "other");
  auto need = [&]() -> const Value& {
    if (!arg) throw Error("test '" + name + "' needs an argument");
    return *arg;
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == K::Bool;
  if (name == "true") return v.kind == K::Bool && v.b;
  if (name == "false") return v.kind == K::Bool && !v.b;
  if (name == "integer") return v.kind == K::Int;
  if (name == "float") return v.kind == K::Float;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object() && !v.obj->is_namespace;
  if (name == "iterable") return v.is_string() || v.is_array() || v.is_object() || v.is_undefined();
  if (name == "sequence") return v.is_string() || v.is_array() || (v.is_object() && !v.obj->is_namespace) || v.is_undefined();
  if (name == "callable") return v.kind == K::Func;
  if (name == "escaped") return false;
  if (name == "lower") return v.is_string() && lower(v.s) == v.s && upper(v.s) != v.s;
  if (name == "upper") return v.is_string() && upper(v.s) == v.s && lower(v.s) != v.s;
  if (name == "odd" || name == "even") {
    if (!v.is_number()) throw Error("odd/even test needs an integer");
    const int64_t x = v.as_int();
    return name == "odd" ? (x % 2 != 0) : (x % 2 == 0);
  }
  if (name == "divisibleby") {
    const int64_t d = need().as_int();
    if (d == 0) throw Error("integer division or modulo by zero");
    if (d == -1) return true;  // INT64_MIN % -1 traps in C++
    return v.as_int() % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, need());
  if (name == "ne" || name == "!=") return !equal(v, need());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, need()) < 0;
  if (name == "le" || name == "<=") return compare(v, need()) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, need()) > 0;
  if (name == "ge" || name == ">=") return compare(v, need()) >= 0;
  if (name == "in") return contains(need(), v);
  if (name == "sameas") {
    const Value& o = need();
    if (v.kind != o.kind) return false;
    if (v.is_array()) return v.arr == o.arr;
    if (v.is_object()) return v.obj == o.obj;
    return equal(v, o);
  }
  if (name == "filter") return v.is_string() && has_filter(v.s);
  if (name == "test") return v.is_string() && has_test(v.s);
  throw Error("no test named '" + name + "'");
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::String: return str_method(obj.s, name);
    case Value::Kind::Array:
      if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) {
        return get_item(obj, Value::integer(std::stoll(name)));
      }
      return list_method(obj, name);
    case Value::Kind::Object: {
      if (!obj.obj->is_namespace && (name == "items" || name == "keys" || name == "values" || name == "get")) {
        return dict_method(obj, name);
      }
      if (const Value* v = obj.obj->find(name)) return *v;
      return Value::undefined(name);
    }
    default: return Value::undefined(name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_object()) {
    if (key.is_string()) {
      if (const Value* v = obj.obj->find(key.s)) return *v;
      return obj.obj->is_namespace ? Value::undefined(key.s) : get_attr(obj, key.s);
    }
    return Value::undefined();
  }
  if ((obj.is_array() || obj.is_string()) && (key.kind == Value::Kind::Int || key.kind == Value::Kind::Bool)) {
    int64_t i = key.as_int();
    if (obj.is_array()) {
      const int64_t n = static_cast<int64_t>(obj.arr->size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined();
      return (*obj.arr)[static_cast<size_t>(i)];
    }
    // The i-th code point, found by walking (no vector of every character per access).
    const std::string& str = obj.s;
    const int64_t n = static_cast<int64_t>(utf8_length(str));
    charge(str.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined();
    size_t at = 0;
    for (int64_t c = 0; c < i; ++c) at += std::min<size_t>(static_cast<size_t>(uni::seq_len(static_cast<unsigned char>(str[at]))), str.size() - at);
    const size_t len = std::min<size_t>(static_cast<size_t>(uni::seq_len(static_cast<unsigned char>(str[at]))), str.size() - at);
    return Value::str(str.substr(at, len));
  }
  if (key.is_string()) return get_attr(obj, key.s);
  return Value::undefined();
}

Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
  auto as_opt = [](const Value* v) -> std::optional<int64_t> {
    if (!v || v->is_none() || v->is_undefined()) return std::nullopt;
    if (v->kind != Value::Kind::Int && v->kind != Value::Kind::Bool) throw Error("slice indices must be integers or None");
    return v->as_int();
  };
  const int64_t st = as_opt(step).value_or(1);
  if (st == 0) throw Error("slice step cannot be zero");
  std::vector<Value> items;
  bool is_str = false;
  if (obj.is_string()) {
    is_str = true;
    for (auto& c : utf8_chars(obj.s)) items.push_back(Value::str(std::move(c)));
  } else if (obj.is_array()) {
    items = *obj.arr;
  } else if (obj.is_undefined()) {
    return Value::undefined();
  } else {
    throw Error(std::string("'") + obj.type_name() + "' object is not subscriptable");
  }
  const int64_t n = static_cast<int64_t>(items.size());
  charge(items.size() * sizeof(Value));
  auto norm = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t v = *x;
    if (v < 0) v += n;
    if (st > 0) return std::clamp<int64_t>(v, 0, n);
    return std::clamp<int64_t>(v, -1, n - 1);
  };
  const int64_t b = norm(as_opt(start), st > 0 ? 0 : n - 1);
  const int64_t e = norm(as_opt(stop), st > 0 ? n : -1);
  std::vector<Value> out;
  for (int64_t k = b; st > 0 ? k < e : k > e;) {
    out.push_back(items[static_cast<size_t>(k)]);
    if (__builtin_add_overflow(k, st, &k)) break;  // x[5::2**63-1]: the next index is past the end
  }
  if (is_str) {
    std::string s;
    for (const auto& v : out) s += v.s;
    return Value::str(s);
  }
  return Value::array(std::move(out));
}

bool contains(const Value& c, const Value& item) {
  if (c.is_string()) {
    if (!item.is_string()) throw Error(std::string("'in <string>' requires string as left operand, not ") + item.type_name());
    return c.s.find(item.s) != std::string::npos;
  }
  if (c.is_array()) {
    charge(c.arr->size() * sizeof(Value));
    for (const auto& v : *c.arr) if (equal(v, item)) return true;
    return false;
  }
  if (c.is_object()) return item.is_string() && c.obj->find(item.s) != nullptr;
  if (c.is_undefined()) return false;
  throw Error(std::string("argument of type '") + c.type_name() + "' is not iterable");
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Array: {
      // A copy: every item, and each string item's bytes.
      size_t bytes = v.arr->size() * sizeof(Value);
      for (const Value& x : *v.arr) bytes += x.s.size();
      charge(bytes);
      return *v.arr;
    }
    case Value::Kind::Object: {
      charge(v.obj->items.size() * sizeof(Value));
      std::vector<Value> keys;
      for (const auto& kv : v.obj->items) keys.push_back(Value::str(kv.first));
      return keys;
    }
    case Value::Kind::String: {
      std::vector<Value> cs;
      for (auto& c : utf8_chars(v.s)) cs.push_back(Value::str(std::move(c)));
      return cs;
    }
    case Value::Kind::Undefined: return {};
    default: throw Error(std::string("'") + v.type_name() + "' object is not iterable");
  }
}

void install_globals(std::unordered_map<std::string, Value>& g) {
  auto put = [&](const char* name, NativeFn f) {
    if (!g.count(name)) g[name] = Value::func(name, std::move(f));
  };
  put("raise_exception", [](Context&, Args& a) -> Value {
    throw Error("raise_exception: " + (a.pos.empty() ? std::string() : a.pos[0].to_str()));
  });
  put("range", [](Context&, Args& a) {
    if (a.pos.empty() || a.pos.size() > 3) throw Error("range expected 1 to 3 arguments");
    for (const auto& x : a.pos) if (x.kind != Value::Kind::Int && x.kind != Value::Kind::Bool) throw Error("range arguments must be integers");
    int64_t b = 0, e, s = 1;
    if (a.pos.size() == 1) e = a.pos[0].as_int();
    else { b = a.pos[0].as_int(); e = a.pos[1].as_int(); }
    if (a.pos.size() == 3) s = a.pos[2].as_int();
    if (s == 0) throw Error("range() arg 3 must not be zero");
    Value r = Value::array();
    for (int64_t k = b; s > 0 ? k < e : k > e;) {
      check_items(r.arr->size() + 1);
      charge(sizeof(Value));
      r.arr->push_back(Value::integer(k));
      if (__builtin_add_overflow(k, s, &k)) break;  // the next value is past the 64-bit range: done
    }
    return r;
  });
  put("namespace", [](Context& ctx, Args& a) {
    Value ns = Value::namespace_object();
    ctx.namespaces.push_back(ns.obj);  // cleared after the render (jinja_eval.hpp)
    for (const auto& p : a.pos) {
      if (!p.is_object()) throw Error("namespace() positional argument must be a dict");
      for (const auto& [k, v] : p.obj->items) ns.obj->set(k, v);
    }
    for (const auto& [k, v] : a.kw) ns.obj->set(k, v);
    return ns;
  });
  put("dict", [](Context&, Args& a) {
    Value d = Value::object();
    for (const auto& p : a.pos) {
      if (!p.is_object()) throw Error("dict() positional argument must be a dict");
      for (const auto& [k, v] : p.obj->items) d.obj->set(k, v);
    }
    for (const auto& [k, v] : a.kw) d.obj->set(k, v);
    return d;
  });
  put("strftime_now", [](Context&, Args& a) {
    const std::string fmt = a.pos.empty() ? std::string("%Y-%m-%d") : a.pos[0].to_str();
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
    return Value::str(std::string(buf, n));
  });
}

}  // namespace rlh::tok::jinja
