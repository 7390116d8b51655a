// bench_tokenize: single-thread encode throughput of the native tokenizer on a large mixed text.
//
// The text is generated deterministically (~24 MB): English prose-like sentences, source code,
// numbers, and Unicode including accented Latin, Cyrillic, CJK and emoji. It is encoded as a
// stream of documents of a few KiB each, the way a data loader calls the tokenizer.
//
//   bench_tokenize <tokenizer.json or model dir> [megabytes]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "rlhost/tokenizer/tokenizer.hpp"

namespace {

std::vector<std::string> make_docs(size_t target_bytes) {
  static const char* words[] = {
      "the", "of", "and", "to", "in", "is", "was", "for", "that", "with", "as", "on", "by", "at", "from",
      "model", "training", "reward", "policy", "gradient", "sequence", "learning", "optimizer", "tokenizer",
      "reinforcement", "distributed", "throughput", "evaluation", "generation", "however", "therefore",
      "The", "A", "In", "We", "It's", "don't", "you'll", "they're", "I'm", "naïve", "café", "résumé",
      "Straße", "über", "façade", "Привет", "мир", "данные", "中文", "数据", "模型", "训练", "日本語", "テキスト",
      "한국어", "데이터", "Ελληνικά", "🤖", "🚀", "😀", "👩‍💻", "✅"};
  static const char* code[] = {
      "def forward(self, x):\n    h = self.norm(x)\n    return x + self.mlp(h)\n\n",
      "for (size_t i = 0; i < n; ++i) {\n    acc += a[i] * b[i];\n}\n",
      "if (err != nullptr) {\n\treturn RLH_STATUS_INVALID_ARGUMENT;\n}\n",
      "SELECT user_id, COUNT(*) AS n FROM events WHERE ts >= '2024-01-01' GROUP BY user_id;\n",
      "{\"role\": \"assistant\", \"content\": \"The answer is 42.\", \"tool_calls\": []}\n",
      "    let total: u64 = items.iter().map(|x| x.len() as u64).sum();\n"};
  std::mt19937_64 rng(42);
  std::vector<std::string> docs;
  size_t total = 0;
  const size_t nwords = sizeof(words) / sizeof(words[0]);
  while (total < target_bytes) {
    std::string d;
    const size_t len = 1024 + rng() % 7168;
    while (d.size() < len) {
      const unsigned r = rng() % 100;
      if (r < 70) {
        const size_t n = 5 + rng() % 20;
        for (size_t k = 0; k < n; ++k) {
          if (k) d += ' ';
          d += words[rng() % nwords];
          if (rng() % 12 == 0) d += ',';
        }
        d += rng() % 5 == 0 ? "?\n" : ". ";
      } else if (r < 85) {
        d += code[rng() % (sizeof(code) / sizeof(code[0]))];
      } else {
        d += std::to_string(rng() % 1000000) + '.' + std::to_string(rng() % 1000) + " ";
        d += "(" + std::to_string(rng() % 100) + "%) ";
      }
    }
    total += d.size();
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <tokenizer.json|model dir> [megabytes]\n", argv[0]);
    return 2;
  }
  const size_t mb = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 24;
  try {
    auto tok = rlh::tok::Tokenizer::from_pretrained(argv[1]);
    const auto docs = make_docs(mb << 20);
    size_t bytes = 0;
    for (const auto& d : docs) bytes += d.size();
    size_t tokens = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& d : docs) tokens += tok.encode(d, false).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("text: %.1f MB in %zu documents (prose, code, numbers, CJK, emoji)\n", bytes / 1e6, docs.size());
    std::printf("encode: %.2f s, %.1f MB/s, %.2f M tokens/s, %.2f bytes/token (1 thread)\n", s, bytes / 1e6 / s,
                tokens / 1e6 / s, static_cast<double>(bytes) / static_cast<double>(tokens));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_tokenize: %s\n", e.what());
    return 1;
  }
  return 0;
}
