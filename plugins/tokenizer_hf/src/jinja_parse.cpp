// Jinja parser: tokens -> AST, recursive descent with Jinja's operator precedence:
//   cond-expr > or > and > not > compare (==, !=, <, <=, >, >=, in, not in)
//   > + - > ~ > * / // % > ** > unary - + > postfix (.a, [i], [a:b], (call)) and | filter, is test
#include <cerrno>
#include <cstdlib>
#include <set>

#include "jinja_ast.hpp"

namespace rlh::tok::jinja {

namespace {

constexpr int kMaxDepth = 200;

struct Parser {
  const std::vector<Token>& t;
  size_t p = 0;
  int depth = 0;

  const Token& cur() const { return t[p]; }
  const Token& peek(size_t k = 1) const { return t[std::min(p + k, t.size() - 1)]; }
  [[noreturn]] void fail(const std::string& msg) const {
    throw Error("line " + std::to_string(cur().line) + ": " + msg);
  }
  bool is_op(const char* o) const { return cur().type == Tok::Op && cur().text == o; }
  bool is_name(const char* n) const { return cur().type == Tok::Name && cur().text == n; }
  bool accept_op(const char* o) {
    if (!is_op(o)) return false;
    ++p;
    return true;
  }
  bool accept_name(const char* n) {
    if (!is_name(n)) return false;
    ++p;
    return true;
  }
  void expect_op(const char* o) {
    if (!accept_op(o)) fail(std::string("expected '") + o + "', got " + describe());
  }
  std::string describe() const {
    switch (cur().type) {
      case Tok::End: return "end of template";
      case Tok::BlockEnd: return "end of statement block";
      case Tok::VarEnd: return "end of print statement";
      case Tok::Text: return "template text";
      default: return "'" + cur().text + "'";
    }
  }
  std::string expect_name() {
    if (cur().type != Tok::Name) fail("expected a name, got " + describe());
    return t[p++].text;
  }

  struct DepthGuard {
    Parser& ps;
    explicit DepthGuard(Parser& x) : ps(x) {
      if (++ps.depth > kMaxDepth) ps.fail("template nested too deeply");
    }
    ~DepthGuard() { --ps.depth; }
  };

  // Left-associative chains (a ~ b ~ c, x.a.b, x|f|g, a if b else c if d...) are built in loops,
  // not by recursion, but every link is one more level of the tree that the evaluator and the
  // destructors walk recursively: each link counts against the same depth bound.
  struct ChainGuard {
    Parser& ps;
    int links = 0;
    explicit ChainGuard(Parser& x) : ps(x) {}
    void link() {
      ++links;
      if (++ps.depth > kMaxDepth) ps.fail("template nested too deeply");
    }
    ~ChainGuard() { ps.depth -= links; }
  };

  ExprP node(EK k) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = cur().line;
    return e;
  }

  // ------------------------------------------------------------------------------- expressions

  ExprP expression(bool with_cond = true) {
    DepthGuard g(*this);
    ExprP e = or_expr();
    if (!with_cond) return e;
    ChainGuard chain(*this);
    while (is_name("if")) {
      chain.link();
      ++p;
      auto c = node(EK::Cond);
      ExprP test = or_expr();
      ExprP alt;
      if (accept_name("else")) alt = expression();
      c->kids.push_back(std::move(e));
      c->kids.push_back(std::move(test));
      c->kids.push_back(std::move(alt));
      e = std::move(c);
    }
    return e;
  }

  ExprP or_expr() {
    ExprP l = and_expr();
    ChainGuard chain(*this);
    while (is_name("or")) {
      chain.link();
      ++p;
      auto n = node(EK::Or);
      n->kids.push_back(std::move(l));
      n->kids.push_back(and_expr());
      l = std::move(n);
    }
    return l;
  }

  ExprP and_expr() {
    ExprP l = not_expr();
    ChainGuard chain(*this);
    while (is_name("and")) {
      chain.link();
      ++p;
      auto n = node(EK::And);
      n->kids.push_back(std::move(l));
      n->kids.push_back(not_expr());
      l = std::move(n);
    }
    return l;
  }

  ExprP not_expr() {
    if (is_name("not")) {
      DepthGuard g(*this);
      auto n = node(EK::Not);
      ++p;
      n->kids.push_back(not_expr());
      return n;
    }
    return compare();
  }

  ExprP compare() {
    ExprP first = math1();
    std::unique_ptr<Expr> cmp;
    for (;;) {
      std::string op;
      if (cur().type == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = t[p++].text;
      } else if (is_name("in")) {
        ++p;
        op = "in";
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        p += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(EK::Compare);
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprP binary(ExprP l, std::string op, ExprP r) {
    auto n = node(EK::Binary);
    n->name = std::move(op);
    n->kids.push_back(std::move(l));
    n->kids.push_back(std::move(r));
    return n;
  }

  ExprP math1() {
    ExprP l = concat();
    ChainGuard chain(*this);
    while (is_op("+") || is_op("-")) {
      chain.link();
      std::string op = t[p++].text;
      l = binary(std::move(l), op, concat());
    }
    return l;
  }

  ExprP concat() {
    ExprP l = math2();
    ChainGuard chain(*this);
    while (accept_op("~")) {
      chain.link();
      l = binary(std::move(l), "~", math2());
    }
    return l;
  }

  ExprP math2() {
    ExprP l = power();
    ChainGuard chain(*this);
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      chain.link();
      std::string op = t[p++].text;
      l = binary(std::move(l), op, power());
    }
    return l;
  }

  ExprP power() {
    ExprP l = unary(true);
    ChainGuard chain(*this);
    while (accept_op("**")) {
      chain.link();
      l = binary(std::move(l), "**", unary(true));
    }
    return l;
  }

  ExprP unary(bool with_filter) {
    DepthGuard g(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      auto n = node(EK::Unary);
      n->name = t[p++].text;
      n->kids.push_back(unary(false));
      e = std::move(n);
    } else {
      e = postfix(primary());
    }
    if (with_filter) e = filter_expr(std::move(e));
    return e;
  }

  void call_args(Expr& n) {
    // after '('
    while (!accept_op(")")) {
      if (!n.kids.empty() && n.kids.size() > 1 + 0 && false) {}
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string k = t[p].text;
        p += 2;
        n.kwargs.emplace_back(std::move(k), expression());
      } else {
        if (!n.kwargs.empty()) fail("positional argument after keyword argument");
        n.kids.push_back(expression());
      }
      if (!accept_op(",")) {
        expect_op(")");
        break;
      }
    }
  }

  ExprP postfix(ExprP e) {
    ChainGuard chain(*this);
    for (;;) {
      if (is_op(".") || is_op("[") || is_op("(")) chain.link();
      if (accept_op(".")) {
        auto n = node(EK::Attr);
        if (cur().type == Tok::Int) n->name = t[p++].text;  // x.0 works like x[0] in Jinja
        else n->name = expect_name();
        n->kids.push_back(std::move(e));
        e = std::move(n);
      } else if (accept_op("[")) {
        ExprP a, b, c;
        bool slice = false;
        if (!is_op(":")) a = expression();
        if (accept_op(":")) {
          slice = true;
          if (!is_op("]") && !is_op(":")) b = expression();
          if (accept_op(":") && !is_op("]")) c = expression();
        }
        expect_op("]");
        auto n = node(slice ? EK::Slice : EK::Item);
        n->kids.push_back(std::move(e));
        n->kids.push_back(std::move(a));
        if (slice) {
          n->kids.push_back(std::move(b));
          n->kids.push_back(std::move(c));
        }
        e = std::move(n);
      } else if (is_op("(")) {
        ++p;
        auto n = node(EK::Call);
        n->kids.push_back(std::move(e));
        call_args(*n);
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  ExprP filter_expr(ExprP e) {
    ChainGuard chain(*this);
    for (;;) {
      if (is_op("|") || is_name("is") || is_op("(")) chain.link();
      if (accept_op("|")) {
        e = filter(std::move(e));
      } else if (is_name("is")) {
        ++p;
        auto n = node(EK::Test);
        n->negate = accept_name("not");
        n->name = expect_name();
        if (n->name == "none" || n->name == "true" || n->name == "false") {}
        if (!has_test(n->name)) fail("no test named '" + n->name + "'");
        n->kids.push_back(std::move(e));
        if (is_op("(")) {
          ++p;
          call_args(*n);
        } else if ((cur().type == Tok::Name && cur().text != "else" && cur().text != "or" && cur().text != "and" &&
                    cur().text != "if" && cur().text != "in" && cur().text != "is" && cur().text != "not") ||
                   cur().type == Tok::String || cur().type == Tok::Int || cur().type == Tok::Float ||
                   is_op("[") || is_op("{")) {
          n->kids.push_back(postfix(primary()));  // `is divisibleby 3`, `is sameas false`
        }
        e = std::move(n);
      } else if (is_op("(")) {
        ++p;
        auto n = node(EK::Call);
        n->kids.push_back(std::move(e));
        call_args(*n);
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  ExprP filter(ExprP operand) {
    auto n = node(EK::Filter);
    n->name = expect_name();
    while (accept_op(".")) n->name += "." + expect_name();
    if (!has_filter(n->name)) fail("no filter named '" + n->name + "'");
    n->kids.push_back(std::move(operand));
    if (accept_op("(")) call_args(*n);
    return n;
  }

  ExprP primary() {
    DepthGuard g(*this);
    const Token& k = cur();
    if (k.type == Tok::Name) {
      ++p;
      auto n = node(EK::Literal);
      if (k.text == "true" || k.text == "True") n->lit = Value::boolean(true);
      else if (k.text == "false" || k.text == "False") n->lit = Value::boolean(false);
      else if (k.text == "none" || k.text == "None") n->lit = Value::none();
      else {
        n->kind = EK::Name;
        n->name = k.text;
      }
      return n;
    }
    if (k.type == Tok::String) {
      auto n = node(EK::Literal);
      std::string s;
      while (cur().type == Tok::String) s += t[p++].text;  // adjacent literals concatenate
      n->lit = Value::str(std::move(s));
      return n;
    }
    if (k.type == Tok::Int) {
      auto n = node(EK::Literal);
      ++p;
      // strtoll/strtod: out-of-range literals saturate instead of throwing std::out_of_range.
      errno = 0;
      const long long v = std::strtoll(k.text.c_str(), nullptr, 10);
      if (errno == ERANGE) n->lit = Value::number(std::strtod(k.text.c_str(), nullptr));
      else n->lit = Value::integer(v);
      return n;
    }
    if (k.type == Tok::Float) {
      auto n = node(EK::Literal);
      ++p;
      n->lit = Value::number(std::strtod(k.text.c_str(), nullptr));
      return n;
    }
    if (accept_op("(")) {
      if (accept_op(")")) return node(EK::Tuple);
      ExprP e = expression();
      if (is_op(",")) {
        auto tup = node(EK::Tuple);
        tup->kids.push_back(std::move(e));
        while (accept_op(",")) {
          if (is_op(")")) break;
          tup->kids.push_back(expression());
        }
        e = std::move(tup);
      }
      expect_op(")");
      return e;
    }
    if (accept_op("[")) {
      auto n = node(EK::List);
      while (!accept_op("]")) {
        n->kids.push_back(expression());
        if (!accept_op(",")) {
          expect_op("]");
          break;
        }
      }
      return n;
    }
    if (accept_op("{")) {
      auto n = node(EK::Dict);
      while (!accept_op("}")) {
        n->kids.push_back(expression());
        expect_op(":");
        n->kids.push_back(expression());
        if (!accept_op(",")) {
          expect_op("}");
          break;
        }
      }
      return n;
    }
    fail("unexpected " + describe());
  }

  // -------------------------------------------------------------------------------- statements

  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) fail("expected end of statement block, got " + describe());
    ++p;
  }

  StmtP stmt(SK k) {
    auto s = std::make_unique<Stmt>();
    s->kind = k;
    s->line = cur().line;
    return s;
  }

  // Parses statements until a block tag whose name is in `ends`; leaves p at that name.
  Body body(const std::set<std::string>& ends, std::string* which) {
    DepthGuard g(*this);
    Body out;
    for (;;) {
      const Token& k = cur();
      if (k.type == Tok::End) {
        if (ends.empty()) return out;
        fail("unexpected end of template, expected one of: " + join(ends));
      }
      if (k.type == Tok::Text) {
        auto s = stmt(SK::Text);
        s->text = k.text;
        ++p;
        out.push_back(std::move(s));
      } else if (k.type == Tok::VarBegin) {
        ++p;
        auto s = stmt(SK::Output);
        s->expr = expression();
        if (cur().type != Tok::VarEnd) fail("expected end of print statement, got " + describe());
        ++p;
        out.push_back(std::move(s));
      } else if (k.type == Tok::BlockBegin) {
        ++p;
        if (cur().type != Tok::Name) fail("expected a statement name, got " + describe());
        const std::string name = cur().text;
        if (ends.count(name)) {
          *which = name;
          ++p;
          return out;
        }
        out.push_back(statement());
      } else {
        fail("unexpected " + describe());
      }
    }
  }

  static std::string join(const std::set<std::string>& s) {
    std::string out;
    for (const auto& x : s) out += (out.empty() ? "" : ", ") + x;
    return out;
  }

  StmtP statement() {
    const std::string name = expect_name();
    std::string which;
    if (name == "if") {
      auto s = stmt(SK::If);
      ExprP c = expression();
      expect_block_end();
      for (;;) {
        Body b = body({"elif", "else", "endif"}, &which);
        s->branches.emplace_back(std::move(c), std::move(b));
        if (which == "elif") {
          c = expression();
          expect_block_end();
          continue;
        }
        if (which == "else") {
          expect_block_end();
          s->else_body = body({"endif"}, &which);
        }
        expect_block_end();
        return s;
      }
    }
    if (name == "for") {
      auto s = stmt(SK::For);
      s->targets.push_back(expect_name());
      while (accept_op(",")) s->targets.push_back(expect_name());
      if (!accept_name("in")) fail("expected 'in' in for loop, got " + describe());
      s->expr = expression(false);
      if (accept_name("if")) s->cond = expression(false);
      if (accept_name("recursive")) fail("recursive for loops are not supported");
      expect_block_end();
      s->body = body({"else", "endfor"}, &which);
      if (which == "else") {
        expect_block_end();
        s->else_body = body({"endfor"}, &which);
      }
      expect_block_end();
      return s;
    }
    if (name == "set") {
      std::string first = expect_name();
      if (accept_op(".")) {
        auto s = stmt(SK::Set);
        s->targets.push_back(first);
        s->attr = expect_name();
        expect_op("=");
        s->expr = expression();
        expect_block_end();
        return s;
      }
      std::vector<std::string> names{first};
      while (accept_op(",")) names.push_back(expect_name());
      if (cur().type == Tok::BlockEnd && names.size() == 1) {
        ++p;
        auto s = stmt(SK::SetBlock);
        s->targets = names;
        s->body = body({"endset"}, &which);
        expect_block_end();
        return s;
      }
      auto s = stmt(SK::Set);
      s->targets = names;
      expect_op("=");
      s->expr = expression();
      if (is_op(",")) {  // set a = 1, 2 builds a tuple
        auto tup = node(EK::Tuple);
        tup->kids.push_back(std::move(s->expr));
        while (accept_op(",")) tup->kids.push_back(expression());
        s->expr = std::move(tup);
      }
      expect_block_end();
      return s;
    }
    if (name == "macro") {
      auto s = stmt(SK::Macro);
      s->targets.push_back(expect_name());
      expect_op("(");
      while (!accept_op(")")) {
        std::string pn = expect_name();
        ExprP dflt;
        if (accept_op("=")) dflt = expression();
        s->params.emplace_back(std::move(pn), std::move(dflt));
        if (!accept_op(",")) {
          expect_op(")");
          break;
        }
      }
      expect_block_end();
      s->body = body({"endmacro"}, &which);
      if (cur().type == Tok::Name) ++p;  // {% endmacro name %}
      expect_block_end();
      return s;
    }
    if (name == "break" || name == "continue") {
      auto s = stmt(name == "break" ? SK::Break : SK::Continue);
      expect_block_end();
      return s;
    }
    if (name == "generation") {
      auto s = stmt(SK::Block);
      expect_block_end();
      s->body = body({"endgeneration"}, &which);
      expect_block_end();
      return s;
    }
    if (name == "filter") {
      auto s = stmt(SK::FilterBlock);
      s->expr = filter(nullptr);
      ChainGuard chain(*this);
      while (accept_op("|")) {
        chain.link();
        s->expr = filter(std::move(s->expr));
      }
      expect_block_end();
      s->body = body({"endfilter"}, &which);
      expect_block_end();
      return s;
    }
    fail("unknown or unsupported statement '" + name + "'");
  }
};

}  // namespace

std::unique_ptr<Program> parse(const std::vector<Token>& toks) {
  Parser ps{toks};
  auto prog = std::make_unique<Program>();
  std::string which;
  prog->body = ps.body({}, &which);
  return prog;
}

}  // namespace rlh::tok::jinja
