// Jinja evaluator internals shared by jinja_eval.cpp (statements, expressions) and
// jinja_builtins.cpp (filters, tests, methods, globals).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "jinja_ast.hpp"

namespace rlh::tok::jinja {

struct Context {
  std::vector<std::unordered_map<std::string, Value>> scopes;  // [0] = globals
  std::string out;
  int call_depth = 0;
  // Every namespace() made during the render. Namespaces are the only mutable containers, so
  // every reference cycle (ns.self = ns) passes through one; clearing them at the end frees it.
  std::vector<std::shared_ptr<Object>> namespaces;

  Value lookup(const std::string& name) const {
    for (size_t k = scopes.size(); k-- > 0;) {
      auto it = scopes[k].find(name);
      if (it != scopes[k].end()) return it->second;
    }
    return Value::undefined(name);
  }
  void set(const std::string& name, Value v) { scopes.back()[name] = std::move(v); }
  void tick();
};

// Renders a parsed program with the given global variables, under the budget installed on this
// thread (BudgetScope; without one nothing is bounded).
std::string render_program(const Program& prog, std::unordered_map<std::string, Value> globals);

Value apply_filter(Context& ctx, const std::string& name, Value operand, Args& args);
bool apply_test(Context& ctx, const std::string& name, const Value& v, Args& args);
// Attribute access (x.name): methods of str/dict/list, dict items, namespace attributes.
Value get_attr(const Value& obj, const std::string& name);
// Item access (x[key]) with Python semantics; out of range or missing gives Undefined.
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step);
bool contains(const Value& container, const Value& item);
// Iteration as a Jinja for loop sees it: list items, dict keys, string characters.
std::vector<Value> iterate(const Value& v);
void install_globals(std::unordered_map<std::string, Value>& g);

}  // namespace rlh::tok::jinja
