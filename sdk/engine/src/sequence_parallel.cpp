// Megatron's sequence parallelism (EngineOptions::sequence_parallel) on top of tensor
// parallelism. The regions tensor parallelism leaves whole on every rank (the residual stream,
// its norms and adds, the final norm) are cut along the tokens: rank r keeps rows
// [r N/T, (r+1) N/T). Where plain tensor parallelism all-reduces (a row-parallel linear's
// output, the embedding's partial lookup), this reduce-scatters the rows; before a
// column-parallel linear (q|k|v, gate|up) and the vocabulary-parallel head it all-gathers them.
// The backward mirrors it (the gradient of an all-gather is a reduce-scatter and back). The
// bytes moved are those of the all-reduces (a ring all-reduce is a reduce-scatter then an
// all-gather); the norms' and adds' work and their inputs' memory are 1/T per rank. Norm weights
// then have a partial gradient per rank, summed over the group after the micro-batches.
//
// Storage: the values keep N rows (the interpreter carves every value for the micro-batch);
// rows outside this rank's block are scratch in the residual regions, never read before the
// next gather overwrites them.
#include <cstring>
#include <stdexcept>

#include "model.hpp"

namespace rlh::engine {

void Engine::Impl::sp_plan(int64_t N) {
  const int64_t T = opt.tp->size;
  if (N % T != 0)
    throw std::logic_error("engine: sequence parallelism needs a multiple of " + std::to_string(T) + " rows, got " +
                           std::to_string(N));
  sp_rows = N / T;
  sp_begin = opt.tp->rank * sp_rows;
}

void Engine::Impl::sp_gather(float* p, int64_t width) {
  const int64_t n = sp_rows * width;
  Buffer<float> mine(*alloc, size_t(n));
  std::memcpy(mine.data(), p + sp_begin * width, size_t(n) * sizeof(float));
  opt.tp_comm->all_gather(mine.data(), n, p);
}

void Engine::Impl::sp_scatter(float* p, int64_t width) {
  const int64_t n = sp_rows * width;
  Buffer<float> mine(*alloc, size_t(n));
  opt.tp_comm->reduce_scatter_sum(p, n, mine.data());
  std::memcpy(p + sp_begin * width, mine.data(), size_t(n) * sizeof(float));
}

}  // namespace rlh::engine
