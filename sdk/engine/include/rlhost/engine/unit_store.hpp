// Sharded parameters for the engine (FSDP / ZeRO-3): with EngineOptions::units set, the engine
// keeps no parameter or gradient storage of its own. Its flat storage is cut into units, each a
// contiguous range of it (Engine::unit_range): unit l < L holds layer l's tensors, unit L the
// global ones (embedding, final norm, head). The engine asks for a unit's full parameters before
// it reads them and gives them back after; it asks for a zeroed gradient buffer of a unit before
// that unit's backward and hands it back after, when the store reduces it away (in rlhost:
// backend_common's FSDP store, all_gather and reduce_scatter over the data-parallel group).
//
// The order of the calls is fixed, the same for every micro-batch, so a store may make collective
// calls in them and a rank without a micro-batch can make the same calls (the store's own
// "idle" pass) to keep its peers company:
//
//   forward (Engine::forward, and each micro-batch of Engine::train_step):
//     acquire_params(L) unless held; for l = 0 .. L-1: acquire_params(l), release_params(l)
//   Engine::forward then: release_params(L)
//   backward (train_step, after the micro-batch's loss callback):
//     acquire_grads(L); for l = L-1 .. 0: acquire_params(l), acquire_grads(l), release_grads(l),
//     release_params(l); then release_grads(L), release_params(L)
//
// Pointers stay valid until the matching release. After an exception inside an engine call the
// owner resets its store (the engine forgets what it held and asks again at its next call).
#pragma once

#include <cstdint>

namespace rlh::engine {

class UnitStore {
 public:
  virtual ~UnitStore() = default;
  // The unit's parameters, unit_range(u) elements, in the engine's storage layout.
  virtual float* acquire_params(int64_t unit) = 0;
  virtual void release_params(int64_t unit) = 0;
  // A zeroed gradient buffer of the unit (the engine accumulates into it).
  virtual float* acquire_grads(int64_t unit) = 0;
  // The unit's gradients of this micro-batch are complete.
  virtual void release_grads(int64_t unit) = 0;
};

}  // namespace rlh::engine
