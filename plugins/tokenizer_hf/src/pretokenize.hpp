// Pre-tokenizers: the `pre_tokenizer` section of tokenizer.json (HF tokenizers/src/pre_tokenizers).
//
// HF materialises every split of the whole input before the model runs. Here the steps are
// chained as callbacks: each step splits one piece and hands every sub-piece to the next step,
// and the last step hands words to the model. Order and results are the same (each HF step works
// piece by piece), but no intermediate lists are built, so the hot path allocates nothing.
//
// A ByteLevel step at the very end only remaps bytes to printable characters; that remap is left
// to the BPE model (`model_maps_bytes()`), which caches words by their raw bytes.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>
#include <vector>

#include "json_util.hpp"

namespace rlh::tok {

class Regex;

// A non-owning callable reference (the pipeline calls it per piece, so no std::function).
template <class Sig>
class FnRef;
template <class R, class... A>
class FnRef<R(A...)> {
 public:
  template <class F>
  FnRef(F& f) : obj_(&f), call_([](void* o, A... a) -> R { return (*static_cast<F*>(o))(a...); }) {}
  R operator()(A... a) const { return call_(obj_, a...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

// (piece text, whether the piece starts at original offset 0)
using PieceSink = FnRef<void(std::string_view, bool)>;

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Bytes the steps of one run may write (ByteLevel's remap, Metaspace's replacement): a chain of
// such steps multiplies the text, so the total is bounded by 16x the input.
class PieceBudget {
 public:
  explicit PieceBudget(size_t input_bytes) : cap_(16 * input_bytes + 4096), left_(cap_) {}
  void spend(size_t n);

 private:
  size_t cap_, left_;
};

class PreTokenizeStep {
 public:
  virtual ~PreTokenizeStep() = default;
  virtual void run(std::string_view s, bool at_origin, const PieceSink& next, PieceBudget& budget) const = 0;
};

class PreTokenizer {
 public:
  // Flattens nested Sequences. JSON null gives an empty pipeline (the whole segment is one word).
  PreTokenizer(const json& j, const JPath& p);
  ~PreTokenizer();
  void run(std::string_view s, bool at_origin, const PieceSink& sink) const {
    PieceBudget budget(s.size());
    run_from(0, s, at_origin, sink, budget);
  }
  // Steps after flattening; more is refused at load (each step is a level of recursion per
  // piece, and real tokenizers have a handful).
  static constexpr size_t kMaxSteps = 256;
  // True when the final step is ByteLevel and the model must apply the byte remap itself.
  bool model_maps_bytes() const { return model_maps_bytes_; }

 private:
  void add(const json& j, const JPath& p, int depth);
  void run_from(size_t i, std::string_view s, bool at_origin, const PieceSink& sink, PieceBudget& budget) const;
  std::vector<std::unique_ptr<PreTokenizeStep>> steps_;
  bool model_maps_bytes_ = false;
};

SplitBehavior parse_behavior(const json& o, std::string_view key, const JPath& p, SplitBehavior dflt);
std::unique_ptr<Regex> make_split_pattern(const json& o, const JPath& p);  // normalize.cpp

}  // namespace rlh::tok
