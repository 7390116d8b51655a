// Exact canonical values: sums of rational x (variables^k) x pi^k x sqrt(m), m square-free.
//
// Square roots of distinct square-free integers, powers of pi (transcendental) and monomials in
// independent variables are linearly independent over the rationals, so two expressions in this
// class are equal exactly when their canonical forms are. Anything outside it (division by a
// sum, roots of non-constants, functions, huge sizes) throws NotExact and the caller falls back
// to floats.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "math_internal.hpp"

namespace rlh::environments::math {
namespace {

struct NotExact {};

constexpr size_t kMaxTerms = 2048;
constexpr size_t kMaxBits = 20000;
constexpr long kMaxExponent = 100000;

size_t bits(const BigInt& x) { return x == 0 ? 0 : boost::multiprecision::msb(boost::multiprecision::abs(x)) + 1; }

// Work of a product (or quotient, gcd) of numbers of these sizes, in machine words squared.
void charge_mul(size_t bits_a, size_t bits_b) { charge((bits_a / 64 + 1) * (bits_b / 64 + 1)); }
// One term's product or sum beyond its numbers' arithmetic: monomial merge, map insertion and
// the rationals' allocations take ~0.5 us, where a unit elsewhere is a few ns (a byte scanned,
// a word multiplied). Charged at 1 unit, (x+y+z+1)^{32} spent 25 ms on 50,000 units, so 50 M
// units of such terms would have run far past the budget's intent.
constexpr uint64_t kTermUnits = 128;
size_t rbits(const Rational& r) {
  return bits(boost::multiprecision::numerator(r)) + bits(boost::multiprecision::denominator(r));
}

void check_size(const Rational& r) {
  if (bits(boost::multiprecision::numerator(r)) > kMaxBits || bits(boost::multiprecision::denominator(r)) > kMaxBits)
    throw NotExact{};
}

Exact constant(const Rational& r) {
  Exact e;
  if (r != 0) e.terms[Monomial{}] = r;
  return e;
}

void add_term(std::map<Monomial, Rational>& t, const Monomial& m, const Rational& c) {
  charge(kTermUnits);
  charge_mul(rbits(c), rbits(c));  // the sum's gcd normalisation
  Rational& x = t[m];
  x += c;
  check_size(x);
  if (x == 0) t.erase(m);
}

std::optional<Rational> as_constant(const Exact& e) {
  if (e.infinity != 0) return std::nullopt;
  if (e.terms.empty()) return Rational(0);
  if (e.terms.size() == 1 && e.terms.begin()->first == Monomial{}) return e.terms.begin()->second;
  return std::nullopt;
}

Exact add(const Exact& a, const Exact& b, bool subtract) {
  if (a.infinity != 0 || b.infinity != 0) throw NotExact{};
  Exact r = a;
  for (const auto& [m, c] : b.terms) add_term(r.terms, m, subtract ? Rational(-c) : c);
  return r;
}

// a*b as a monomial; the square part of the radicand product moves into `coef`.
Monomial mul_mono(const Monomial& a, const Monomial& b, Rational& coef) {
  Monomial r;
  size_t i = 0, j = 0;
  while (i < a.vars.size() || j < b.vars.size()) {
    std::pair<std::string, long> v;
    if (j >= b.vars.size() || (i < a.vars.size() && a.vars[i].first < b.vars[j].first)) {
      v = {a.vars[i].first, a.vars[i].second};
      ++i;
    } else if (i >= a.vars.size() || b.vars[j].first < a.vars[i].first) {
      v = {b.vars[j].first, b.vars[j].second};
      ++j;
    } else {
      v = {a.vars[i].first, static_cast<long>(a.vars[i].second) + b.vars[j].second};
      ++i;
      ++j;
    }
    if (v.second > kMaxExponent || v.second < -kMaxExponent) throw NotExact{};
    if (v.second != 0) r.vars.emplace_back(v.first, static_cast<int>(v.second));
  }
  const long pi = static_cast<long>(a.pi) + b.pi;
  if (pi > kMaxExponent || pi < -kMaxExponent) throw NotExact{};
  r.pi = static_cast<int>(pi);
  // sqrt(a) sqrt(b) = g sqrt((a/g)(b/g)) with g = gcd(a, b); a, b square-free keeps it so.
  const uint64_t g = std::gcd(a.radicand, b.radicand);
  const unsigned __int128 prod = static_cast<unsigned __int128>(a.radicand / g) * (b.radicand / g);
  if (prod > UINT64_MAX) throw NotExact{};
  r.radicand = static_cast<uint64_t>(prod);
  coef *= g;
  return r;
}

Exact mul(const Exact& a, const Exact& b) {
  if (a.infinity != 0 || b.infinity != 0) throw NotExact{};
  if (a.terms.size() * b.terms.size() > kMaxTerms) throw NotExact{};
  Exact r;
  for (const auto& [ma, ca] : a.terms)
    for (const auto& [mb, cb] : b.terms) {
      charge(kTermUnits);
      charge_mul(rbits(ca), rbits(cb));
      Rational c = ca * cb;
      const Monomial m = mul_mono(ma, mb, c);
      add_term(r.terms, m, c);
    }
  return r;
}

// 1/b for a single term c x^v pi^k sqrt(m): (1/(c m)) x^-v pi^-k sqrt(m).
Exact inverse(const Exact& b) {
  if (b.infinity != 0 || b.terms.size() != 1) throw NotExact{};  // zero or a sum
  const auto& [m, c] = *b.terms.begin();
  Monomial inv = m;
  for (auto& v : inv.vars) v.second = -v.second;
  inv.pi = -m.pi;
  Exact r;
  r.terms[inv] = Rational(1) / (c * m.radicand);
  return r;
}

Exact negate(Exact a) {
  a.infinity = -a.infinity;
  for (auto& [m, c] : a.terms) c = -c;
  return a;
}

BigInt ipow(const BigInt& b, long n) {
  if (bits(b) * static_cast<size_t>(n) > kMaxBits) throw NotExact{};
  charge_mul(bits(b) * static_cast<size_t>(n), bits(b) * static_cast<size_t>(n));
  return boost::multiprecision::pow(b, static_cast<unsigned>(n));
}

Rational rpow(const Rational& r, long n) {  // n >= 0
  return Rational(ipow(boost::multiprecision::numerator(r), n), ipow(boost::multiprecision::denominator(r), n));
}

Exact pow_int(const Exact& base, long n) {
  if (base.infinity != 0) throw NotExact{};
  if (n == 0) return constant(1);  // 0^0 = 1, as sympy
  if (base.terms.empty()) {
    if (n < 0) throw NotExact{};  // division by zero
    return base;
  }
  if (base.terms.size() == 1) {
    const auto& [m, c] = *base.terms.begin();
    const long k = n < 0 ? -n : n;
    Rational coef = rpow(c, k);
    Monomial r;
    for (const auto& [name, e] : m.vars) {
      const long ne = static_cast<long>(e) * n;
      if (ne > kMaxExponent || ne < -kMaxExponent) throw NotExact{};
      r.vars.emplace_back(name, static_cast<int>(ne));
    }
    const long pi = static_cast<long>(m.pi) * n;
    if (pi > kMaxExponent || pi < -kMaxExponent) throw NotExact{};
    r.pi = static_cast<int>(pi);
    // sqrt(m)^k = m^(k div 2) sqrt(m)^(k mod 2).
    coef *= rpow(Rational(m.radicand), k / 2);
    r.radicand = (k % 2 == 1) ? m.radicand : 1;
    if (n < 0) {
      // 1/(coef sqrt(rad)) = sqrt(rad) / (coef rad)
      coef = Rational(1) / (coef * r.radicand);
    }
    check_size(coef);
    Exact out;
    out.terms[r] = coef;
    return out;
  }
  if (n < 0 || n > 32) throw NotExact{};  // 1/(a+b) is outside the class
  Exact r = constant(1);
  for (long i = 0; i < n; ++i) r = mul(r, base);
  return r;
}

// n = s^2 m with m square-free, for n < 2^64: trial division up to the cube root leaves at most
// two prime factors, which are either equal (a perfect square) or not.
std::pair<uint64_t, uint64_t> square_free(uint64_t n) {
  charge(static_cast<uint64_t>(std::cbrt(static_cast<double>(n))) / 2 + 1);  // the trial divisions
  uint64_t s = 1, m = 1;
  for (uint64_t d = 2; static_cast<unsigned __int128>(d) * d * d <= n; d += (d == 2 ? 1 : 2)) {
    int e = 0;
    while (n % d == 0) {
      n /= d;
      ++e;
    }
    for (int i = 0; i < e / 2; ++i) s *= d;
    if (e % 2 == 1) m *= d;
  }
  uint64_t r = static_cast<uint64_t>(std::sqrt(static_cast<long double>(n)));
  while (static_cast<unsigned __int128>(r) * r > n) --r;
  while (static_cast<unsigned __int128>(r + 1) * (r + 1) <= n) ++r;
  if (n > 1 && r * r == n) s *= r;
  else m *= n;
  return {s, m};
}

// sqrt(p/q) = sqrt(p q) / q.
Exact sqrt_rational(const Rational& v) {
  if (v < 0) throw NotExact{};
  const BigInt n = boost::multiprecision::numerator(v) * boost::multiprecision::denominator(v);
  if (n > BigInt(UINT64_MAX)) throw NotExact{};
  const auto [s, m] = square_free(static_cast<uint64_t>(n));
  Monomial mono;
  mono.radicand = m;
  Exact e;
  if (v != 0) e.terms[mono] = Rational(BigInt(s), boost::multiprecision::denominator(v));
  return e;
}

// The exact k-th root of x >= 0, if it is an integer.
std::optional<BigInt> exact_root(const BigInt& x, long k) {
  if (x < 2) return x;
  BigInt lo = 1, hi = BigInt(1) << (bits(x) / static_cast<size_t>(k) + 1);
  while (lo <= hi) {
    charge_mul(bits(x), bits(x));  // mid^k is about x's size
    const BigInt mid = (lo + hi) / 2;
    const BigInt p = boost::multiprecision::pow(mid, static_cast<unsigned>(k));
    if (p == x) return mid;
    if (p < x) lo = mid + 1;
    else hi = mid - 1;
  }
  return std::nullopt;
}

Exact pow(const Exact& base, const Exact& exponent) {
  const auto e = as_constant(exponent);
  if (!e) throw NotExact{};
  const BigInt& p = boost::multiprecision::numerator(*e);
  const BigInt& q = boost::multiprecision::denominator(*e);
  if (q == 1) {
    if (p > kMaxExponent || p < -kMaxExponent) throw NotExact{};
    return pow_int(base, static_cast<long>(p));
  }
  // A fractional power of a positive constant: c^(p/q), or for c sqrt(m) = R^(1/2) with
  // R = c^2 m, R^(p/(2q)). Exact when R has an exact root of that order, or the order is 2.
  if (base.infinity != 0 || base.terms.size() != 1) throw NotExact{};
  const auto& [m, c] = *base.terms.begin();
  if (!m.vars.empty() || m.pi != 0 || c < 0) throw NotExact{};
  const Rational R = m.radicand == 1 ? c : Rational(c * c * m.radicand);
  const Rational a_b = m.radicand == 1 ? *e : Rational(*e / 2);
  const BigInt& a = boost::multiprecision::numerator(a_b);
  const BigInt& b = boost::multiprecision::denominator(a_b);
  if (a > kMaxExponent || a < -kMaxExponent || b > 64) throw NotExact{};
  const long bl = static_cast<long>(b), al = static_cast<long>(a);
  const auto rn = exact_root(boost::multiprecision::numerator(R), bl);
  const auto rd = exact_root(boost::multiprecision::denominator(R), bl);
  if (rn && rd) return pow_int(constant(Rational(*rn, *rd)), al);
  if (bl == 2) return pow_int(sqrt_rational(R), al);
  throw NotExact{};
}

Exact eval(const NodePtr& n, bool percent) {
  charge(1);
  switch (n->kind) {
    case Node::kNumber: return constant(n->number);
    case Node::kVar: {
      Exact e;
      Monomial m;
      m.vars.emplace_back(n->name, 1);
      e.terms[m] = 1;
      return e;
    }
    case Node::kPi: {
      Exact e;
      Monomial m;
      m.pi = 1;
      e.terms[m] = 1;
      return e;
    }
    case Node::kInf: {
      Exact e;
      e.infinity = 1;
      return e;
    }
    case Node::kAdd: return add(eval(n->kids[0], percent), eval(n->kids[1], percent), false);
    case Node::kSub: return add(eval(n->kids[0], percent), eval(n->kids[1], percent), true);
    case Node::kMul: return mul(eval(n->kids[0], percent), eval(n->kids[1], percent));
    case Node::kDiv: return mul(eval(n->kids[0], percent), inverse(eval(n->kids[1], percent)));
    case Node::kNeg: return negate(eval(n->kids[0], percent));
    case Node::kPow: return pow(eval(n->kids[0], percent), eval(n->kids[1], percent));
    case Node::kRoot: {
      const auto idx = as_constant(eval(n->kids[0], percent));
      if (!idx || boost::multiprecision::denominator(*idx) != 1 || *idx < 1 || *idx > 64) throw NotExact{};
      const Exact radicand = eval(n->kids[1], percent);
      return pow(radicand, constant(Rational(1) / *idx));
    }
    case Node::kPercent: {
      Exact v = eval(n->kids[0], percent);
      return percent ? mul(v, constant(Rational(1, 100))) : v;
    }
    case Node::kFunc: break;
  }
  throw NotExact{};
}

std::string rational_text(const Rational& r) {
  const BigInt& d = boost::multiprecision::denominator(r);
  return d == 1 ? boost::multiprecision::numerator(r).str() : boost::multiprecision::numerator(r).str() + "/" + d.str();
}

}  // namespace

bool Monomial::operator<(const Monomial& o) const {
  return std::tie(vars, pi, radicand) < std::tie(o.vars, o.pi, o.radicand);
}
bool Monomial::operator==(const Monomial& o) const {
  return vars == o.vars && pi == o.pi && radicand == o.radicand;
}

std::string Exact::to_string() const {
  if (infinity != 0) return infinity > 0 ? "oo" : "-oo";
  if (terms.empty()) return "0";
  std::string out;
  for (const auto& [m, c] : terms) {
    if (!out.empty()) out += " + ";
    out += rational_text(c);
    if (m.radicand != 1) out += "*sqrt(" + std::to_string(m.radicand) + ")";
    if (m.pi != 0) out += m.pi == 1 ? "*pi" : "*pi^" + std::to_string(m.pi);
    for (const auto& [v, e] : m.vars) out += "*" + v + (e == 1 ? "" : "^" + std::to_string(e));
  }
  return out;
}

std::optional<Exact> eval_exact(const NodePtr& n, bool percent) {
  try {
    return eval(n, percent);
  } catch (const NotExact&) {
    return std::nullopt;
  }
}

}  // namespace rlh::environments::math
