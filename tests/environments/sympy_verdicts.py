"""Expected verdicts for math answer pairs, decided by sympy (Debian's python3-sympy).

usage: sympy_verdicts.py CASES.json   -> JSON list on stdout, one entry per [candidate, truth]:
       true / false, or {"undecided": "<why>"} when sympy cannot parse or decide the pair.
exit 2 when sympy is not installed.

The answer notation is turned into sympy input by the same written rules the C++ checker follows
(plugins/environments/math_latex_normalize.cpp, math_equivalence.cpp): strip $ and \\( \\),
\\left/\\right, spacing, degrees, \\text units, "x = ..."; thousands separators; commas make
tuples (brackets kept, compared in order), \\{...\\} sets (any order); a percent sign on one side
may mean /100 or nothing. From there sympy alone parses (implicit multiplication, ^ as power,
decimals as exact rationals) and decides equality (simplify(a - b) == 0).
"""
import json
import re
import sys

try:
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, rationalize, standard_transformations)
except ImportError:
    print("python3-sympy not installed", file=sys.stderr)
    sys.exit(2)

TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor, rationalize)
GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
         "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "varphi",
         "varepsilon"}
FUNCS = {"sin": "sin", "cos": "cos", "tan": "tan", "ln": "log", "log": "log", "exp": "exp"}
DROP = {"displaystyle", "textstyle", "left", "right", "bigl", "bigr", "Bigl", "Bigr", "big", "Big", "quad",
        "qquad", "degree", "circ"}
TEXT = {"text", "textbf", "textrm", "textit", "mathrm", "mbox", "mathbf", "mathit"}
UNICODE = [("\u2212", "-"), ("\u00d7", "\\times "), ("\u00b7", "\\cdot "), ("\u22c5", "\\cdot "),
           ("\u00f7", "\\div "), ("\u03c0", "\\pi "), ("\u221a", "\\sqrt"), ("\u221e", "\\infty "),
           ("\u00b0", ""), ("\u00a0", " ")]


class Unsupported(Exception):
    pass


def match_brace(s, i):
    depth = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def resolve_text_blocks(s):
    blocks, i = [], 0
    while i < len(s):
        m = re.match(r"\\([A-Za-z]+)", s[i:])
        if not m:
            i += 1
            continue
        if m.group(1) not in TEXT:
            i += len(m.group(0))
            continue
        k = i + len(m.group(0))
        while k < len(s) and s[k] == " ":
            k += 1
        if k >= len(s) or s[k] != "{":
            i += 1
            continue
        close = match_brace(s, k)
        if close < 0:
            i += 1
            continue
        blocks.append((i, close + 1, s[k + 1:close]))
        i = close + 1
    if not blocks:
        return s
    rest, kept, at = "", "", 0
    for b, e, content in blocks:
        rest += s[at:b]
        kept += s[at:b] + content
        at = e
    rest += s[at:]
    kept += s[at:]
    return rest if any(c.isdigit() for c in rest) else kept


def drop_commands(s):
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c != "\\":
            out.append(" " if c == "~" else c)
            i += 1
            continue
        if i + 1 >= len(s):
            break
        nxt = s[i + 1]
        if not nxt.isalpha():
            if nxt in ",;:! \\":
                pass
            elif nxt == "%":
                out.append("%")
            else:
                out.append("\\" + nxt)
            i += 2
            continue
        m = re.match(r"\\([A-Za-z]+)", s[i:])
        name, j = m.group(1), i + len(m.group(0))
        if name in DROP:
            if name in ("left", "right") and j < len(s) and s[j] == ".":
                j += 1
            i = j
            continue
        if name in ("dfrac", "tfrac", "cfrac"):
            name = "frac"
        out.append("\\" + name)
        if j < len(s) and s[j].isalpha():
            out.append(" ")
        i = j
    return "".join(out)


def drop_assignment(s):
    eqs = [i for i, c in enumerate(s) if c == "=" and (i == 0 or s[i - 1] not in "<>!")]
    if len(eqs) != 1:
        return s
    lhs = s[:eqs[0]].strip()
    if re.fullmatch(r"[A-Za-z]|\\[A-Za-z]+", lhs):
        return s[eqs[0] + 1:].strip()
    return s


def normalize(raw):
    s = raw
    for a, b in UNICODE:
        s = s.replace(a, b)
    for d in ["^{\\circ}", "^\\circ", "^{ \\circ }", "^{\\circ }"]:
        s = s.replace(d, "")
    s = s.replace("\\$", "").replace("$", "").strip()
    for o, c in [("\\(", "\\)"), ("\\[", "\\]")]:
        if len(s) >= len(o) + len(c) and s.startswith(o) and s.endswith(c):
            s = s[len(o):len(s) - len(c)].strip()
    s = s.replace("{,}", "")
    s = resolve_text_blocks(s)
    s = drop_commands(s).strip()
    while s.endswith("."):
        s = s[:-1].strip()
    return drop_assignment(s)


def normalize_text(raw):
    return "".join(c.lower() for c in normalize(raw) if not c.isspace() and c not in "{}")


def split_top(s):
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def encloses(s):
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def frac_arg(s, i):
    """A \\frac/\\sqrt argument: {group}, one digit, or one atom; returns (python text, next index)."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s):
        raise Unsupported("missing argument")
    if s[i] == "{":
        close = match_brace(s, i)
        if close < 0:
            raise Unsupported("unclosed brace")
        return "(" + convert(s[i + 1:close]) + ")", close + 1
    if s[i].isdigit() or s[i].isalpha():
        return s[i], i + 1
    if s[i] == "\\":
        m = re.match(r"\\([A-Za-z]+)", s[i:])
        if m and m.group(1) in {"pi", "infty"} | GREEK:
            return convert(m.group(0)), i + len(m.group(0))
    raise Unsupported("argument at " + s[i:])


def convert(s, pct="div"):
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+)", s[i:])
            if not m:
                raise Unsupported("command " + s[i:i + 2])
            name = m.group(1)
            i += len(m.group(0))
            if name == "frac":
                a, i = frac_arg(s, i)
                b, i = frac_arg(s, i)
                out.append("((%s)/(%s))" % (a, b))
            elif name == "sqrt":
                j = i
                while j < len(s) and s[j].isspace():
                    j += 1
                idx = None
                if j < len(s) and s[j] == "[":
                    close = s.index("]", j)
                    idx = convert(s[j + 1:close])
                    i = close + 1
                a, i = frac_arg(s, i)
                out.append(" sqrt(%s)" % a if idx is None else " root(%s,%s)" % (a, idx))
            elif name == "pi":
                out.append(" pi ")
            elif name == "infty":
                out.append(" oo ")
            elif name in ("cdot", "times"):
                out.append("*")
            elif name == "div":
                out.append("/")
            elif name in GREEK:
                out.append(" %s " % ("lamda" if name == "lambda" else name))
            elif name in FUNCS:
                out.append(" " + FUNCS[name])
            else:
                raise Unsupported("\\" + name)
        elif c in "{[":
            out.append("(")
            i += 1
        elif c in "}]":
            out.append(")")
            i += 1
        elif c == "^":
            out.append("**")
            i += 1
        elif c == "%":
            out.append("*(1/100)" if pct == "div" else "")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def local_dict():
    d = {ch: sympy.Symbol(ch) for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    d.update({g: sympy.Symbol(g) for g in GREEK if g != "lambda"})
    d.update({"lamda": sympy.Symbol("lambda"), "pi": sympy.pi, "oo": sympy.oo, "sqrt": sympy.sqrt,
              "root": sympy.root, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "log": sympy.log,
              "exp": sympy.exp})
    return d


def parse(raw):
    """(kind, open, close, parts, text, has_percent) with parts as notation strings."""
    s = normalize(raw)
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    text = normalize_text(raw)
    words = re.fullmatch(r"[A-Za-z ]*[A-Za-z]{2,}[A-Za-z ]*", s) is not None
    if not s or (words and s.replace(" ", "").lower() != "pi"):
        return ("text", None, None, [], text, False)
    kind, o, c = "expr", None, None
    if len(s) >= 4 and s.startswith("\\{") and s.endswith("\\}"):
        kind, parts = "set", split_top(s[2:-2])
    else:
        parts = split_top(s)
        if len(parts) > 1:
            kind = "tuple"
        elif s[0] in "([" and s[-1] in ")]" and encloses(s):
            inner = split_top(s[1:-1])
            if len(inner) > 1:
                kind, o, c, parts = "tuple", s[0], s[-1], inner
    return (kind, o, c, parts, text, any("%" in p for p in parts))


def to_sympy(part, pct):
    return parse_expr(convert(part, pct), local_dict=local_dict(), transformations=TRANSFORMS, evaluate=True)


def values_equal(a, b):
    if a == b:
        return True
    d = sympy.simplify(a - b)
    if d == 0:
        return True
    if d.free_symbols:
        return sympy.expand(d) == 0
    z = d.is_zero
    if z is None:
        raise Unsupported("sympy cannot decide whether %s is zero" % d)
    return bool(z)


def answers_equal(A, pa, B, pb):
    ka, oa, ca, parts_a, ta, _ = A
    kb, ob, cb, parts_b, tb, _ = B
    if ka == "text" or kb == "text":
        return ka == kb and ta != "" and ta == tb
    if ka != kb or len(parts_a) != len(parts_b):
        return False
    if ka == "tuple" and oa and ob and (oa != ob or ca != cb):
        return False
    xs = [to_sympy(p, pa) for p in parts_a]
    ys = [to_sympy(p, pb) for p in parts_b]
    if ka == "set":
        used = [False] * len(ys)
        for x in xs:
            for j, y in enumerate(ys):
                if not used[j] and values_equal(x, y):
                    used[j] = True
                    break
            else:
                return False
        return True
    return all(values_equal(x, y) for x, y in zip(xs, ys))


def verdict(candidate, truth):
    A, B = parse(candidate), parse(truth)
    # A side that does not parse is text, as in the C++ checker.
    for side in (A, B):
        if side[0] != "text":
            for p in side[3]:
                try:
                    to_sympy(p, "div")
                except Exception as e:  # noqa: BLE001 - any parse failure means "not math"
                    raise Unsupported("sympy cannot parse %r: %s" % (p, e))
    if A[5] and not B[5]:
        return answers_equal(A, "div", B, "bare") or answers_equal(A, "bare", B, "bare")
    if B[5] and not A[5]:
        return answers_equal(A, "bare", B, "div") or answers_equal(A, "bare", B, "bare")
    return answers_equal(A, "bare", B, "bare")


def main(path):
    cases = json.load(open(path, encoding="utf-8"))
    out = []
    for cand, truth in cases:
        try:
            out.append(bool(verdict(cand, truth)))
        except Exception as e:  # noqa: BLE001
            out.append({"undecided": str(e)})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
