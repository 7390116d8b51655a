// The fixed list of (candidate, ground truth) pairs whose verdicts sympy decides in
// test_math_answer.cpp (sympy_verdicts.py). The expected verdict is not written here: it is
// computed by sympy when the test runs.
#pragma once

#include <utility>

namespace rlh::test {

inline constexpr std::pair<const char*, const char*> kMathCases[] = {
    // integers, decimals, fractions
    {"19", "19"},
    {"-3", "3"},
    {"0.5", "\\frac{1}{2}"},
    {"\\dfrac{3}{4}", "0.75"},
    {"\\tfrac34", "3/4"},
    {"\\frac12", "0.5"},
    {"\\frac{2}{4}", "\\frac{1}{2}"},
    {"\\frac{3}{4}", "\\frac{4}{3}"},
    {"\\frac{-6}{4}", "-1.5"},
    {"3.0", "3"},
    {"0.333", "\\frac{1}{3}"},
    {"1/3+1/6", "1/2"},
    {"-(-4)", "4"},
    {"-0", "0"},
    {"5.0001", "5"},
    {"0.1", "0.10000001"},
    // negative numbers and LaTeX wrappers
    {"\xE2\x88\x92" "3", "-3"},
    {"$-\\frac{2}{3}$", "-2/3"},
    {"\\(\\frac{7}{2}\\)", "3.5"},
    {"\\$5.00", "5"},
    // percentages
    {"50\\%", "0.5"},
    {"50%", "50"},
    {"12.5\\%", "\\frac{1}{8}"},
    {"4\\%", "\\frac{1}{25}"},
    {"25\\%", "0.025"},
    {"25\\%", "2.5\\%"},
    {"10\\%", "1"},
    // thousands separators
    {"1,000,000", "1000000"},
    {"1{,}234", "1234"},
    {"1,234", "1.234"},
    {"1000", "1,000,000"},
    // scientific notation
    {"1.5 \\times 10^{3}", "1500"},
    {"1.5e3", "1500"},
    {"2.5E-2", "0.025"},
    {"10^{-3}", "0.001"},
    {"1.5e3", "150"},
    {"1e-3", "0.01"},
    // units, degrees, assignments
    {"30^\\circ", "30"},
    {"30^{\\circ}", "60"},
    {"5\\text{ cm}", "5"},
    {"x = 7", "7"},
    {"\\text{B}", "B"},
    // surds and pi, exact
    {"2\\sqrt{3}", "\\sqrt{12}"},
    {"\\sqrt{8}", "2\\sqrt2"},
    {"\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"},
    {"\\dfrac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"},
    {"\\sqrt{2}\\cdot\\sqrt{3}", "\\sqrt{6}"},
    {"(2+\\sqrt{3})^2", "7+4\\sqrt{3}"},
    {"2\\sqrt{3}", "3\\sqrt{2}"},
    {"1.414", "\\sqrt{2}"},
    {"1.4142135623730951", "\\sqrt{2}"},  // within any float tolerance, yet not equal
    {"0.7071067811865476", "\\frac{1}{\\sqrt{2}}"},
    {"\\sqrt{\\frac{9}{4}}", "1.5"},
    {"\\sqrt{0.08}", "\\frac{\\sqrt{2}}{5}"},
    {"\\sqrt{3}", "3^{1/3}"},
    {"3\\pi", "\\pi \\cdot 3"},
    {"\\frac{\\pi}{2}", "0.5\\pi"},
    {"\\pi^2/6", "\\frac{\\pi^{2}}{6}"},
    {"2\\pi/3", "\\frac{2\\pi}{3}"},
    {"3.14", "\\pi"},
    {"3.14159265358979", "\\pi"},
    {"\\pi", "\\pi^2"},
    {"\\frac{\\pi}{3}", "\\frac{\\pi}{6}"},
    {"\\pi r^2", "r^2\\pi"},
    // powers and roots
    {"2^{10}", "1024"},
    {"2^{10}", "1000"},
    {"\\sqrt[3]{27}", "3"},
    {"8^{2/3}", "4"},
    {"4^{-1/2}", "\\frac{1}{2}"},
    // beyond the exact class: float tolerance
    {"\\frac{1}{\\sqrt{2}+1}", "\\sqrt{2}-1"},
    {"\\frac{1}{\\sqrt{2}+1}", "\\sqrt{2}+1"},
    {"\\sin(\\pi/6)", "\\frac{1}{2}"},
    {"\\sin(\\pi/6)", "\\frac{\\sqrt{3}}{2}"},
    {"\\cos(0)", "1"},
    // polynomials and rational functions in variables
    {"2x+1", "1+2x"},
    {"x+1", "x-1"},
    {"(x-1)(x+1)", "x^2-1"},
    {"(x+1)^2", "x^2+1"},
    {"x^2", "2x"},
    {"\\frac{x^2-1}{x-1}", "x+1"},
    {"e", "2.718"},
    // tuples and intervals, in order, brackets kept
    {"\\left( 1, 2 \\right)", "(1,2)"},
    {"(1,2)", "(2,1)"},
    {"(1,2)", "1, 2"},
    {"(1,2,3)", "(1,2)"},
    {"[1, 3)", "\\left[1,3\\right)"},
    {"[1,3]", "[1,3)"},
    {"(1,3)", "[1,3]"},
    {"(1, 2]", "(1, 2)"},
    {"(-\\infty, 2]", "(-\\infty,2]"},
    {"-\\infty", "\\infty"},
    {"(\\frac{1}{2}, \\sqrt{2})", "(0.5, 2^{1/2})"},
    // sets, any order
    {"\\{1, 2, 3\\}", "\\{3, 1, 2\\}"},
    {"\\{1,2\\}", "\\{1,2,3\\}"},
    // words
    {"\\text{Monday}", "monday"},
    {"\\text{Monday}", "Tuesday"},
    {"7", "\\text{seven}"},
};

}  // namespace rlh::test
