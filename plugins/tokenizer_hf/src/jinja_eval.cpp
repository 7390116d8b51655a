// Jinja evaluator: statements and expressions over Values (see jinja_eval.hpp).
#include "jinja_eval.hpp"

#include <cmath>

namespace rlh::tok::jinja {

namespace {

enum class Flow { Normal, Break, Continue };

[[noreturn]] void fail_at(int line, const std::string& msg) {
  throw Error("line " + std::to_string(line) + ": " + msg);
}

// Python integers do not overflow; 64-bit ones do, and a wrapped result would be a silently
// wrong value, so a result outside the range is an error (and INT64_MIN // -1 never traps).
[[noreturn]] void int_overflow(int line, int64_t x, const std::string& op, int64_t y) {
  fail_at(line, "integer overflow: " + std::to_string(x) + " " + op + " " + std::to_string(y) +
                    " is outside the 64-bit range");
}

int64_t int_pow(int64_t x, int64_t y, int line) {  // y >= 0, by squaring with overflow checks
  int64_t r = 1, base = x;
  for (int64_t e = y;;) {
    if (e & 1) {
      if (__builtin_mul_overflow(r, base, &r)) int_overflow(line, x, "**", y);
    }
    e >>= 1;
    if (e == 0) break;
    if (__builtin_mul_overflow(base, base, &base)) {
      // base^2 overflows; the result does too unless it is 0, 1 or -1 (handled by values).
      if (x == 0 || x == 1) return x;
      if (x == -1) return (y & 1) ? -1 : 1;
      int_overflow(line, x, "**", y);
    }
  }
  return r;
}

Value arith(const std::string& op, const Value& a, const Value& b, int line) {
  using K = Value::Kind;
  if (op == "~") {
    std::string l = a.to_str();
    const std::string r = b.to_str();
    check_string(l.size() + r.size());
    charge(l.size() + r.size());
    return Value::str(std::move(l) + r);
  }
  if (a.is_undefined() || b.is_undefined()) {
    fail_at(line, "'" + (a.is_undefined() ? a.s : b.s) + "' is undefined");
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      check_string(a.s.size() + b.s.size());
      charge(a.s.size() + b.s.size());
      return Value::str(a.s + b.s);
    }
    if (a.is_array() && b.is_array()) {
      check_items(a.arr->size() + b.arr->size());
      charge((a.arr->size() + b.arr->size()) * sizeof(Value));
      Array r = *a.arr;
      r.insert(r.end(), b.arr->begin(), b.arr->end());
      return Value::array(std::move(r));
    }
  }
  if (op == "*") {
    const Value* s = a.is_string() || a.is_array() ? &a : b.is_string() || b.is_array() ? &b : nullptr;
    const Value* n = s == &a ? &b : &a;
    if (s && (n->kind == K::Int || n->kind == K::Bool)) {
      const int64_t times = std::max<int64_t>(0, n->as_int());
      const size_t unit = s->is_string() ? s->s.size() : s->arr->size();
      // Checked before anything is built: 'x' * 10**12 must not allocate first.
      if (unit > 0 && static_cast<uint64_t>(times) > (s->is_string() ? SIZE_MAX : SIZE_MAX / sizeof(Value)) / unit)
        fail_at(line, "repetition result too large");
      const size_t total = unit * static_cast<size_t>(times);
      if (s->is_string()) {
        check_string(total);
        charge(total);
        std::string r;
        r.reserve(total);
        for (int64_t k = 0; k < times && unit > 0; ++k) r += s->s;
        return Value::str(std::move(r));
      }
      check_items(total);
      charge(total * sizeof(Value));
      Array r;
      r.reserve(total);
      for (int64_t k = 0; k < times && unit > 0; ++k) r.insert(r.end(), s->arr->begin(), s->arr->end());
      return Value::array(std::move(r));
    }
  }
  if (op == "%" && a.is_string()) {
    Args args;
    if (b.is_array()) args.pos = *b.arr;
    else args.pos.push_back(b);
    Context dummy;
    return apply_filter(dummy, "format", a, args);
  }
  if (!a.is_number() || !b.is_number()) {
    fail_at(line, std::string("unsupported operand type(s) for ") + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
  }
  const bool ints = a.kind != K::Float && b.kind != K::Float;
  if (op == "/") {
    if (b.as_double() == 0) fail_at(line, "division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (ints) {
    const int64_t x = a.as_int(), y = b.as_int();
    int64_t r;
    if (op == "+") {
      if (__builtin_add_overflow(x, y, &r)) int_overflow(line, x, op, y);
      return Value::integer(r);
    }
    if (op == "-") {
      if (__builtin_sub_overflow(x, y, &r)) int_overflow(line, x, op, y);
      return Value::integer(r);
    }
    if (op == "*") {
      if (__builtin_mul_overflow(x, y, &r)) int_overflow(line, x, op, y);
      return Value::integer(r);
    }
    if (op == "//" || op == "%") {
      if (y == 0) fail_at(line, "integer division or modulo by zero");
      if (y == -1) {  // x // -1 = -x (overflows for INT64_MIN), x % -1 = 0; C++ traps on INT64_MIN
        if (op == "%") return Value::integer(0);
        if (x == INT64_MIN) int_overflow(line, x, op, y);
        return Value::integer(-x);
      }
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) { --q; m += y; }  // Python floors
      return Value::integer(op == "//" ? q : m);
    }
    if (op == "**") {
      if (y < 0) {
        if (x == 0) fail_at(line, "0.0 cannot be raised to a negative power");
        return Value::number(std::pow(static_cast<double>(x), static_cast<double>(y)));
      }
      return Value::integer(int_pow(x, y, line));
    }
  }
  const double x = a.as_double(), y = b.as_double();
  if (op == "+") return Value::number(x + y);
  if (op == "-") return Value::number(x - y);
  if (op == "*") return Value::number(x * y);
  if (op == "//" || op == "%") {
    if (y == 0) fail_at(line, "float division by zero");
    const double q = std::floor(x / y);
    return Value::number(op == "//" ? q : x - q * y);
  }
  if (op == "**") {
    if (x == 0 && y < 0) fail_at(line, "0.0 cannot be raised to a negative power");
    const double r = std::pow(x, y);
    // Python raises OverflowError where C returns infinity from finite operands.
    if (std::isinf(r) && std::isfinite(x) && std::isfinite(y)) fail_at(line, "numerical result out of range");
    return Value::number(r);
  }
  fail_at(line, "unknown operator " + op);
}

struct Evaluator {
  Context& ctx;

  Args eval_args(const Expr& e, size_t first) {
    Args a;
    for (size_t k = first; k < e.kids.size(); ++k) a.pos.push_back(eval(*e.kids[k]));
    for (const auto& [n, x] : e.kwargs) a.kw.emplace_back(n, eval(*x));
    return a;
  }

  // Every value an expression yields is a fresh copy here (strings by value); counting its bytes
  // bounds what a loop of copies can cost.
  Value eval(const Expr& e) {
    Nest nest;
    Value v;
    try {
      v = eval_node(e);
    } catch (const Error& err) {
      // Errors from values and limits get the line of the innermost expression.
      const std::string m = err.what();
      if (m.rfind("line ", 0) == 0 || m.rfind("raise_exception:", 0) == 0) throw;
      fail_at(e.line, m);
    }
    if (v.is_string()) {
      check_string(v.s.size());
      charge(v.s.size());
    }
    return v;
  }

  Value eval_node(const Expr& e) {
    switch (e.kind) {
      case EK::Literal: return e.lit;
      case EK::Name: return ctx.lookup(e.name);
      case EK::Attr: {
        Value o = eval(*e.kids[0]);
        if (o.is_undefined()) fail_at(e.line, "'" + (o.s.empty() ? std::string("value") : o.s) + "' is undefined");
        Value r = get_attr(o, e.name);
        if (r.is_undefined()) r.s = e.name;
        return r;
      }
      case EK::Item: {
        Value o = eval(*e.kids[0]);
        if (o.is_undefined()) fail_at(e.line, "'" + (o.s.empty() ? std::string("value") : o.s) + "' is undefined");
        return get_item(o, eval(*e.kids[1]));
      }
      case EK::Slice: {
        Value o = eval(*e.kids[0]);
        Value a, b, c;
        if (e.kids[1]) a = eval(*e.kids[1]);
        if (e.kids[2]) b = eval(*e.kids[2]);
        if (e.kids[3]) c = eval(*e.kids[3]);
        return slice(o, e.kids[1] ? &a : nullptr, e.kids[2] ? &b : nullptr, e.kids[3] ? &c : nullptr);
      }
      case EK::Call: {
        Value f = eval(*e.kids[0]);
        if (f.kind != Value::Kind::Func) {
          if (f.is_undefined()) fail_at(e.line, "'" + (f.s.empty() ? std::string("value") : f.s) + "' is undefined");
          fail_at(e.line, std::string("'") + f.type_name() + "' object is not callable");
        }
        Args a = eval_args(e, 1);
        ctx.tick();
        const Budget* b = current_budget();
        if (++ctx.call_depth > (b ? b->lim.max_call_depth : 100)) {
          --ctx.call_depth;
          fail_at(e.line, "call depth exceeded");
        }
        struct Restore { int& d; ~Restore() { --d; } } restore{ctx.call_depth};
        try {
          return f.fn->fn(ctx, a);
        } catch (const Error& err) {
          const std::string m = err.what();
          if (m.rfind("line ", 0) == 0 || m.rfind("raise_exception:", 0) == 0) throw;
          fail_at(e.line, m);
        }
      }
      case EK::Filter: {
        Value v = e.kids[0] ? eval(*e.kids[0]) : Value::undefined();
        Args a = eval_args(e, 1);
        try {
          return apply_filter(ctx, e.name, std::move(v), a);
        } catch (const Error& err) {
          const std::string m = err.what();
          if (m.rfind("line ", 0) == 0) throw;
          fail_at(e.line, m);
        }
      }
      case EK::Test: {
        Value v = eval(*e.kids[0]);
        Args a = eval_args(e, 1);
        bool r;
        try {
          r = apply_test(ctx, e.name, v, a);
        } catch (const Error& err) {
          fail_at(e.line, err.what());
        }
        return Value::boolean(e.negate ? !r : r);
      }
      case EK::Unary: {
        Value v = eval(*e.kids[0]);
        if (!v.is_number()) fail_at(e.line, std::string("bad operand type for unary ") + e.name + ": '" + v.type_name() + "'");
        if (e.name == "+") return v.kind == Value::Kind::Bool ? Value::integer(v.as_int()) : v;
        if (v.kind == Value::Kind::Float) return Value::number(-v.f);
        if (v.as_int() == INT64_MIN) fail_at(e.line, "integer overflow: -(" + std::to_string(v.i) + ") is outside the 64-bit range");
        return Value::integer(-v.as_int());
      }
      case EK::Binary: return arith(e.name, eval(*e.kids[0]), eval(*e.kids[1]), e.line);
      case EK::Compare: {
        Value l = eval(*e.kids[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value r = eval(*e.kids[k + 1]);
          const std::string& op = e.ops[k];
          bool ok;
          try {
            if (op == "==") ok = equal(l, r);
            else if (op == "!=") ok = !equal(l, r);
            else if (op == "in") ok = contains(r, l);
            else if (op == "notin") ok = !contains(r, l);
            else {
              const int c = compare(l, r);
              ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
            }
          } catch (const Error& err) {
            fail_at(e.line, err.what());
          }
          if (!ok) return Value::boolean(false);
          l = std::move(r);
        }
        return Value::boolean(true);
      }
      case EK::And: {
        Value l = eval(*e.kids[0]);
        return l.truthy() ? eval(*e.kids[1]) : l;
      }
      case EK::Or: {
        Value l = eval(*e.kids[0]);
        return l.truthy() ? l : eval(*e.kids[1]);
      }
      case EK::Not: return Value::boolean(!eval(*e.kids[0]).truthy());
      case EK::Cond:
        if (eval(*e.kids[1]).truthy()) return eval(*e.kids[0]);
        return e.kids[2] ? eval(*e.kids[2]) : Value::undefined();
      case EK::List:
      case EK::Tuple: {
        Value v = Value::array();
        charge(e.kids.size() * sizeof(Value));
        for (const auto& k : e.kids) v.arr->push_back(eval(*k));
        return v;
      }
      case EK::Dict: {
        Value v = Value::object();
        charge(e.kids.size() * sizeof(Value));
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = eval(*e.kids[k]);
          if (!key.is_string()) fail_at(e.line, "only string dict keys are supported");
          v.obj->set(key.s, eval(*e.kids[k + 1]));
        }
        return v;
      }
    }
    return Value::undefined();
  }

  void write(const std::string& s) {
    const Budget* b = current_budget();
    if (b != nullptr && ctx.out.size() + s.size() > b->lim.max_output)
      throw Error("rendered text exceeds " + std::to_string(b->lim.max_output) + " bytes");
    charge(s.size());
    ctx.out += s;
  }

  Flow exec(const Body& b) {
    Nest nest;
    for (const auto& s : b) {
      const Flow f = exec(*s);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  // Renders `b` into a string instead of the output (set blocks, filter blocks, macros).
  std::string capture(const Body& b) {
    std::string saved;
    saved.swap(ctx.out);
    try {
      exec(b);
    } catch (...) {
      ctx.out.swap(saved);
      throw;
    }
    saved.swap(ctx.out);
    return saved;
  }

  void assign(const Stmt& s, Value v) {
    if (!s.attr.empty()) {
      Value ns = ctx.lookup(s.targets[0]);
      if (!ns.is_object() || !ns.obj->is_namespace) {
        fail_at(s.line, "cannot assign attribute on non-namespace object '" + s.targets[0] + "'");
      }
      ns.obj->set(s.attr, std::move(v));
      return;
    }
    if (s.targets.size() == 1) {
      ctx.set(s.targets[0], std::move(v));
      return;
    }
    auto items = iterate(v);
    if (items.size() != s.targets.size()) {
      fail_at(s.line, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(s.targets.size()));
    }
    for (size_t k = 0; k < items.size(); ++k) ctx.set(s.targets[k], items[k]);
  }

  Flow exec_for(const Stmt& s) {
    Value it = eval(*s.expr);
    if (!it.is_undefined() && !it.is_array() && !it.is_object() && !it.is_string()) {
      fail_at(s.line, std::string("'") + it.type_name() + "' object is not iterable");
    }
    std::vector<Value> items = iterate(it);
    ctx.scopes.emplace_back();
    // loop.previtem / nextitem / the loop variable copy an item each per iteration.
    auto item_bytes = [&](size_t k) { return k < items.size() && items[k].is_string() ? items[k].s.size() : 0; };
    struct Pop { Context& c; ~Pop() { c.scopes.pop_back(); } } pop{ctx};
    auto bind = [&](const Value& item) {
      if (s.targets.size() == 1) {
        ctx.set(s.targets[0], item);
        return;
      }
      auto parts = iterate(item);
      if (parts.size() != s.targets.size()) fail_at(s.line, "cannot unpack loop item");
      for (size_t k = 0; k < parts.size(); ++k) ctx.set(s.targets[k], parts[k]);
    };
    if (s.cond) {
      // `for x in xs if cond`: filter first, so loop.* counts only kept items.
      std::vector<Value> kept;
      for (const Value& item : items) {
        bind(item);
        if (eval(*s.cond).truthy()) kept.push_back(item);
      }
      items.swap(kept);
    }
    const size_t n = items.size();
    // One `loop` object for the whole loop, its fields updated each iteration (Jinja2's LoopContext
    // is one object too: loop.cycle kept and called later cycles at the index of the call). A new
    // object of twelve fields per iteration was most of a long loop's time.
    Value loop = Value::object();
    auto& L = *loop.obj;
    auto at = std::make_shared<size_t>(0);
    L.set("cycle", Value::func("cycle", [at](Context&, Args& a) -> Value {
      if (a.pos.empty()) throw Error("no items for cycling given");
      return a.pos[*at % a.pos.size()];
    }));
    for (size_t k = 0; k < n; ++k) {
      ctx.tick();
      charge(sizeof(Value) + item_bytes(k) * 2 + (k ? item_bytes(k - 1) : 0) + item_bytes(k + 1));
      *at = k;
      L.set("index", Value::integer(static_cast<int64_t>(k + 1)));
      L.set("index0", Value::integer(static_cast<int64_t>(k)));
      L.set("revindex", Value::integer(static_cast<int64_t>(n - k)));
      L.set("revindex0", Value::integer(static_cast<int64_t>(n - k - 1)));
      L.set("first", Value::boolean(k == 0));
      L.set("last", Value::boolean(k + 1 == n));
      L.set("length", Value::integer(static_cast<int64_t>(n)));
      L.set("depth", Value::integer(1));
      L.set("depth0", Value::integer(0));
      L.set("previtem", k > 0 ? items[k - 1] : Value::undefined("previtem"));
      L.set("nextitem", k + 1 < n ? items[k + 1] : Value::undefined("nextitem"));
      ctx.set("loop", loop);
      bind(items[k]);
      const Flow f = exec(s.body);
      if (f == Flow::Break) break;
    }
    if (n == 0 && !s.else_body.empty()) return exec(s.else_body);
    return Flow::Normal;
  }

  Value make_macro(const Stmt& s) {
    const Stmt* def = &s;
    return Value::func(s.targets[0], [def](Context& c, Args& a) -> Value {
      std::unordered_map<std::string, Value> locals;
      for (size_t k = 0; k < def->params.size(); ++k) {
        const auto& [pname, dflt] = def->params[k];
        if (const Value* v = a.get(k, pname)) {
          locals[pname] = *v;
        } else if (dflt) {
          Evaluator ev{c};
          locals[pname] = ev.eval(*dflt);
        } else {
          locals[pname] = Value::undefined(pname);
        }
      }
      if (a.pos.size() > def->params.size()) throw Error("macro '" + def->targets[0] + "' takes " +
                                                         std::to_string(def->params.size()) + " arguments");
      // A macro sees globals, top-level variables and its arguments, not the caller's loop
      // variables.
      std::vector<std::unordered_map<std::string, Value>> saved;
      saved.swap(c.scopes);
      c.scopes.push_back(saved[0]);
      if (saved.size() > 1) c.scopes.push_back(saved[1]);  // top-level {% set %} values
      c.scopes.push_back(std::move(locals));
      Evaluator ev{c};
      std::string text;
      try {
        text = ev.capture(def->body);
      } catch (...) {
        c.scopes.swap(saved);
        throw;
      }
      c.scopes.swap(saved);
      return Value::str(std::move(text));
    });
  }

  Flow exec(const Stmt& s) {
    Nest nest;
    switch (s.kind) {
      case SK::Text: write(s.text); return Flow::Normal;
      case SK::Output: write(eval(*s.expr).to_str()); return Flow::Normal;
      case SK::If:
        for (const auto& [c, b] : s.branches) {
          if (eval(*c).truthy()) return exec(b);
        }
        return exec(s.else_body);
      case SK::For: return exec_for(s);
      case SK::Set: assign(s, eval(*s.expr)); return Flow::Normal;
      case SK::SetBlock: ctx.set(s.targets[0], Value::str(capture(s.body))); return Flow::Normal;
      case SK::Macro: ctx.set(s.targets[0], make_macro(s)); return Flow::Normal;
      case SK::Break: return Flow::Break;
      case SK::Continue: return Flow::Continue;
      case SK::Block: return exec(s.body);
      case SK::FilterBlock: {
        Value text = Value::str(capture(s.body));
        // Re-run the filter chain with the captured text as the innermost operand.
        const Expr* e = s.expr.get();
        std::vector<const Expr*> chain;
        for (; e; e = e->kids.empty() ? nullptr : e->kids[0].get()) chain.push_back(e);
        Value v = text;
        for (size_t k = chain.size(); k-- > 0;) {
          Args a = eval_args(*chain[k], 1);
          v = apply_filter(ctx, chain[k]->name, v, a);
        }
        write(v.to_str());
        return Flow::Normal;
      }
    }
    return Flow::Normal;
  }
};

}  // namespace

void Context::tick() { jinja::tick(); }

std::string render_program(const Program& prog, std::unordered_map<std::string, Value> globals) {
  Context ctx;
  // Break reference cycles through namespaces whichever way the render ends.
  struct ClearNamespaces {
    Context& c;
    ~ClearNamespaces() {
      for (auto& ns : c.namespaces) ns->items.clear();
    }
  } clear{ctx};
  install_globals(globals);
  ctx.scopes.push_back(std::move(globals));
  ctx.scopes.emplace_back();  // top-level {% set %} lives here; macros see only globals
  Evaluator ev{ctx};
  ev.exec(prog.body);
  return std::move(ctx.out);
}

}  // namespace rlh::tok::jinja
