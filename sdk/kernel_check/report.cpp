// The conformance report as text: the op x variant table, the failures, the refusals.
#include <cstdio>
#include <string>

#include "rlhost/sdk/kernel_check.hpp"

namespace rlh::sdk {
namespace {

std::string sci(double x) {
  char b[32];
  if (x == 0) return "0";
  std::snprintf(b, sizeof(b), "%.1e", x);
  return b;
}

std::string cell_text(const KernelCheckCell& c) {
  switch (c.state) {
    case KernelCheckCell::not_offered: return "not offered";
    case KernelCheckCell::same: return "= bf16";
    case KernelCheckCell::no_case: return "no case";
    case KernelCheckCell::no_reference: return "no reference";
    case KernelCheckCell::refused: return "refused";
    case KernelCheckCell::pass: return "pass " + sci(c.worst);
    case KernelCheckCell::fail: return "FAIL " + sci(c.worst);
  }
  return "?";
}

std::string pad(std::string s, size_t w) {
  if (s.size() < w) s.append(w - s.size(), ' ');
  return s;
}

}  // namespace

bool KernelCheckRow::failed() const {
  for (const KernelCheckCell& c : cells)
    if (c.state == KernelCheckCell::fail) return true;
  return false;
}

bool KernelCheckReport::failed() const {
  for (const KernelCheckRow& r : rows)
    if (r.failed()) return true;
  return false;
}

const KernelCheckRow* KernelCheckReport::row(const std::string& op) const {
  for (const KernelCheckRow& r : rows)
    if (r.op == op) return &r;
  return nullptr;
}

std::vector<std::string> KernelCheckReport::failures() const {
  std::vector<std::string> out;
  const auto& vars = kernel_variants();
  for (const KernelCheckRow& r : rows)
    for (size_t i = 0; i < r.cells.size() && i < vars.size(); ++i) {
      const KernelCheckCell& c = r.cells[i];
      if (c.state != KernelCheckCell::fail) continue;
      if (c.tolerance == 0)  // a call that failed, or an integer output that differs
        out.push_back(r.op + " " + vars[i].name + ": " + c.where);
      else
        out.push_back(r.op + " " + vars[i].name + ": worst error " + sci(c.worst) + " > " + sci(c.tolerance) +
                      " in " + c.where);
    }
  return out;
}

std::string KernelCheckReport::table() const {
  const auto& vars = kernel_variants();
  size_t w0 = 20;
  for (const KernelCheckRow& r : rows) w0 = std::max(w0, r.op.size() + 2);
  constexpr size_t w = 14;
  std::string s = provider + " on " + device + ", against " + reference +
                  " (float64 where it offers it, else float32); max|err| / max|ref| per op and dtype\n";
  s += pad("op", w0);
  for (const KernelVariant& v : vars) s += pad(v.name, w);
  s += "\n";
  int pass = 0, fail = 0, uncovered = 0;
  std::vector<std::string> notes;
  for (const KernelCheckRow& r : rows) {
    s += pad(r.op, w0);
    for (size_t i = 0; i < r.cells.size() && i < vars.size(); ++i) {
      const KernelCheckCell& c = r.cells[i];
      s += pad(cell_text(c), w);
      if (c.state == KernelCheckCell::pass) ++pass;
      if (c.state == KernelCheckCell::fail) ++fail;
      if (c.state == KernelCheckCell::no_case || c.state == KernelCheckCell::no_reference ||
          c.state == KernelCheckCell::refused)
        ++uncovered;
      const std::string head = "  " + r.op + " " + vars[i].name + ": ";
      if (c.state == KernelCheckCell::no_case)
        notes.push_back(head + "listed, but the conformance runner has no case for it");
      else if (c.state == KernelCheckCell::no_reference)
        notes.push_back(head + "the reference cannot run it: " + c.note);
      else if (c.state == KernelCheckCell::refused)
        notes.push_back(head + "listed, but every case was refused: " + c.note);
      else if (c.refused_cases > 0 && c.state != KernelCheckCell::not_offered)
        notes.push_back(head + std::to_string(c.refused_cases) + " case(s) refused: " + c.note);
    }
    s += "\n";
  }
  s += "tolerances:";
  for (const KernelVariant& v : vars) s += std::string(" ") + v.name + " " + sci(v.tolerance);
  s += "\n";
  const std::vector<std::string> f = failures();
  for (const std::string& line : f) s += "FAIL " + line + "\n";
  if (!notes.empty()) {
    s += "not checked or partly refused:\n";
    for (const std::string& n : notes) s += n + "\n";
  }
  s += provider + " on " + device + ": " + std::to_string(pass) + " (op, dtype) pass, " + std::to_string(fail) +
       " fail" + (uncovered ? ", " + std::to_string(uncovered) + " not checked" : "") + "\n";
  return s;
}

}  // namespace rlh::sdk
