// Pipeline parallelism (Megatron-style) as data and a pass over the layer program (static
// library rlh_model_desc). docs/model_parallelism.md, "Pipeline parallelism", says how the backend
// schedules it.
//
// Why a layout and not a branch in the engine: which layers a stage holds, and which global
// tensors, is a property of the split, not of the model. `make_pp_layout` applies the split to
// a description and gives the stage's own description: its decoder layers (renumbered from 0),
// the embedding on the first stage, the final norm and the head on the last (and the embedding
// there too when the head is tied to it: Megatron's shared embedding, whose two copies get the
// embedding group's summed gradient). `build_stage_program` derives that stage's layer program:
// the program says where the stage's input comes from (the embedding, or the previous stage's
// activations) and where its output goes (the head and the loss, or the next stage). Executors
// that run stage programs say so (ExecutorCaps::pipeline_stage); the others refuse them.
//
// Layers per stage (Megatron's rules): without first/last counts, L layers split evenly over
// P stages (P must divide L). With num_layers_in_first_pipeline_stage = a and/or
// num_layers_in_last_pipeline_stage = b, those stages take a (b) layers and the other stages
// split the rest evenly. A split that does not come out even is refused, naming the keys.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

struct PpSplit {
  int64_t first = 0, last = 0;  // num_layers_in_{first,last}_pipeline_stage (0: not set)
  // virtual_pipeline_model_parallel_size: model chunks per rank (Megatron's interleaved
  // schedule). With V > 1 the layers split evenly into P x V chunks; virtual stage v = c P + s
  // (chunk c of rank s) holds the v-th run of layers. First/last counts are not combined with it.
  int64_t virtual_size = 1;
};

// Layers of each stage, stage 0 first. Throws std::invalid_argument naming `key` (the
// pipeline size's setting) and the counts when the layers do not split.
std::vector<int64_t> pp_stage_layers(int64_t num_layers, int64_t stages, const PpSplit& split,
                                     const std::string& key = "pipeline_model_parallel_size");

struct PpLayout {
  int64_t size = 1, rank = 0;
  bool first = true, last = true;
  int64_t layer_begin = 0, layer_count = 0;  // this stage's decoder layers [begin, begin + count) (V = 1)
  // Interleaved virtual stages: this rank's model chunks, chunk c being virtual stage c x size +
  // rank. Each is a run of the local description's layers; the first chunk of stage 0 starts
  // from the embedding, the last chunk of the last stage ends at the head. One chunk when V = 1.
  struct Chunk {
    int64_t local_begin = 0, count = 0;  // layers [local_begin, local_begin + count) of `local`
    int64_t global_begin = 0;            // the first one's index in the whole model
    bool embed = false, head = false;
    // Its MoE layers' run of columns in the whole model's routing record [N, R]: the first
    // column and their count (the sum of their top_k). Each chunk is one run; a rank's chunks
    // are not (interleaved stages leave the other ranks' chunks between them).
    int64_t route_begin = 0, route_count = 0;
  };
  int64_t virtual_size = 1;
  std::vector<Chunk> chunks;
  std::vector<int64_t> stage_layers;         // layers of every stage
  TransformerDesc local;                     // this stage's description
  std::vector<int64_t> full_index;   // per local parameter: its index in the whole description
  std::vector<int64_t> local_index;  // per whole-model parameter: its local index, -1 if not here
  std::vector<int64_t> owner;        // per whole-model parameter: the stage that owns it (saves it)
  // Tied embedding on a pipeline of several stages: this stage holds a copy (the first stage's
  // embedding, the last stage's head); the embedding group sums the two gradients. The last
  // stage's copy is not the owner: it counts 0 in the gradient norm.
  bool shares_embedding = false;
  int64_t embed_local = -1;  // local index of the embedding (or tied head), -1 if not here
  // MoE routing record and replay ([N, R], R = the sum of top_k over the MoE layers in layer
  // order): the whole model's R, and the first column of this stage's first chunk. A chunk
  // records and replays its own columns [Chunk::route_begin, + Chunk::route_count); without
  // virtual stages the one chunk is the stage, so its columns are [route_begin, + its R).
  int64_t route_total = 0, route_begin = 0;
};

// Empty when a pipeline of `size` stages can run `desc`, else one line naming the first thing
// that stops it (layers that do not split). MoE and MLA layers are layer-local (the routing
// record's columns and the auxiliary losses' values are the stages' to combine); a value head
// is the last stage's, next to the final norm.
std::string pp_unsupported(const TransformerDesc& desc, int64_t size, const PpSplit& split,
                           const std::string& key = "pipeline_model_parallel_size");
// Throws std::invalid_argument with pp_unsupported's line when it is not empty.
PpLayout make_pp_layout(const TransformerDesc& desc, int64_t size, int64_t rank, const PpSplit& split,
                        const std::string& key = "pipeline_model_parallel_size");

// The layer program of a stage's description (layout.local): as build_program, except that a
// stage that is not the first takes its input from the previous stage (no embedding), and one
// that is not the last hands its output on (no final norm, no head). ModelProgram::pp_first and
// pp_last say which.
ModelProgram build_stage_program(const TransformerDesc& local, bool first, bool last);

}  // namespace rlh::sdk
