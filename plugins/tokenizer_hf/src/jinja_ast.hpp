// Jinja syntax: tokens from the lexer and the AST the parser builds and the evaluator walks.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "jinja_value.hpp"

namespace rlh::tok::jinja {

// ---------------------------------------------------------------------------------------------
// tokens

enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, End };

struct Token {
  Tok type;
  std::string text;  // Text content, name, string value (unescaped), operator, number text
  int line;
};

// Lexes a template with transformers' settings (trim_blocks, lstrip_blocks). Throws Error.
std::vector<Token> lex(const std::string& src);

// ---------------------------------------------------------------------------------------------
// expressions

struct Expr;
using ExprP = std::unique_ptr<Expr>;
using KwArgs = std::vector<std::pair<std::string, ExprP>>;

enum class EK {
  Literal,  // lit
  Name,     // name
  Attr,     // kids[0].name
  Item,     // kids[0][kids[1]]
  Slice,    // kids[0][kids[1]:kids[2]:kids[3]] (null parts allowed)
  Call,     // kids[0](kids[1..], kwargs)
  Filter,   // kids[0] | name(kids[1..], kwargs); kids[0] null in {% filter %} blocks
  Test,     // kids[0] is [not] name(kids[1..]); negate
  Unary,    // name ("-", "+") kids[0]
  Binary,   // kids[0] name kids[1] for + - * / // % ** ~
  Compare,  // kids[0] ops[0] kids[1] ops[1] kids[2] ...
  And, Or, Not,
  Cond,     // kids[0] if kids[1] else kids[2] (kids[2] may be null)
  List, Tuple,
  Dict      // kids = k0, v0, k1, v1, ...
};

struct Expr {
  EK kind;
  int line = 0;
  Value lit;
  std::string name;
  std::vector<ExprP> kids;
  KwArgs kwargs;
  std::vector<std::string> ops;
  bool negate = false;
};

// ---------------------------------------------------------------------------------------------
// statements

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

enum class SK { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, Block, FilterBlock };

struct Stmt {
  SK kind;
  int line = 0;
  std::string text;                              // Text
  ExprP expr;                                    // Output, For (iterable), Set (value), FilterBlock (filter)
  std::vector<std::pair<ExprP, Body>> branches;  // If: (cond, body)...
  Body body, else_body;                          // For / If else / SetBlock / Macro / Block
  std::vector<std::string> targets;              // For loop variables, Set names, Macro name
  std::string attr;                              // Set ns.attr: targets[0] = ns, attr = attr
  ExprP cond;                                    // For ... if cond
  std::vector<std::pair<std::string, ExprP>> params;  // Macro parameters with defaults
};

struct Program {
  Body body;
};

// Parses tokens into a program. Throws Error ("line N: ...").
std::unique_ptr<Program> parse(const std::vector<Token>& toks);

// Known filter / test names (checked at parse time, as Jinja does when compiling).
bool has_filter(const std::string& name);
bool has_test(const std::string& name);

}  // namespace rlh::tok::jinja
