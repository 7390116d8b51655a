/* rlhost C ABI: training backends (RLH_KIND_BACKEND).
 *
 * The seam between an algorithm (GRPO, SFT, DPO, RM, ...) and a backend (dtensor, megatron):
 * the algorithm hands over a *batch* (token ids, named per-token and per-sequence fields,
 * sequence offsets, constraints) and names the per-token *outputs* it needs; the backend owns
 * everything from ids to outputs (forward, backward, recompute, optimizer, parallelism, packing,
 * MoE auxiliary losses) and the algorithm everything after (advantages, clipping, KL,
 * normalisation), through a loss callback that receives the outputs of one micro-batch and
 * returns the loss and one gradient per output.
 *
 * A backend instance holds several models (policy, reference, critic, teacher), each its own
 * weights. Global token and sequence counts are passed in, so results do not depend on micro-
 * batch size, packing or data-parallel size.
 */
#ifndef RLHOST_BACKEND_H_
#define RLHOST_BACKEND_H_

#include "rlhost/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RLH_BACKEND_API_VERSION_MAJOR 0
#define RLH_BACKEND_API_VERSION_MINOR 5

typedef struct rlh_backend rlh_backend; /* a backend instance */
typedef struct rlh_model rlh_model;     /* a model held by a backend instance */

/* Batch constraints (flags). */
#define RLH_BATCH_NEVER_SPLIT_SEQUENCE (1ull << 0) /* never split one sequence across shards */
#define RLH_BATCH_KEEP_PAIRS (1ull << 1)          /* sequences 2i and 2i+1 stay together (DPO) */

/* A batch of packed sequences. Sequence i is tokens [seq_offsets[i], seq_offsets[i+1]).
 * Fields are named tensors whose leading dimension is num_tokens (per-token: advantages,
 * logprobs, masks) or num_seqs (per-sequence: rewards, sample masks); the backend slices,
 * packs, reorders and shards them together with the tokens, so they always line up. All
 * pointers are borrowed for the duration of the call that receives the batch. */
typedef struct rlh_batch {
  size_t struct_size;
  int64_t num_tokens;
  int64_t num_seqs;
  const int32_t* token_ids;    /* [num_tokens], host memory */
  const int64_t* seq_offsets;  /* [num_seqs + 1], host memory, seq_offsets[0] == 0 */
  const rlh_named_tensor* fields; /* [num_fields] */
  size_t num_fields;
  uint64_t constraints;        /* RLH_BATCH_* */
} rlh_batch;

/* Per-token output kinds. Outputs are aligned with the tokens, as NeMo-RL's are (its logprobs
 * carry a 0 prepended at position 0): output t of a sequence is about token t, predicted from
 * tokens 0..t-1 of the same sequence; position 0 of every sequence has no prediction and holds 0.
 * So per-token fields (token_mask, generation_logprobs, ...) and outputs index the same way. */
#define RLH_OUTPUT_LOGPROB 1        /* log p(next token) after temperature, top-k, top-p: the */
                                    /* "processed" logprob generators report (NeMo-RL) */
#define RLH_OUTPUT_LOGPROB_RAW 2    /* log p(next token) of the unfiltered softmax(logits / T) */
#define RLH_OUTPUT_ENTROPY 3        /* entropy of softmax(logits / T) */
#define RLH_OUTPUT_LOGPROB_AT_IDS 4 /* log p at ids given by a batch field [num_tokens, k] */
#define RLH_OUTPUT_VALUE 5          /* a scalar head (critic, reward model): HF's score.weight */
                                    /* [1, hidden] on the final-normed hidden state; NOT shifted: */
                                    /* output t scores tokens 0..t, so a sequence's last output */
                                    /* scores the whole sequence (HF *ForSequenceClassification). */
                                    /* Only on a model loaded as a value model. */

typedef struct rlh_output_spec {
  size_t struct_size;
  int32_t kind;          /* RLH_OUTPUT_* */
  uint32_t reserved0;
  const char* name;      /* name the loss callback sees, e.g. "logprobs" */
  double temperature;    /* divides logits; 1.0 = none */
  int32_t top_k;         /* 0 = off */
  uint32_t reserved1;
  double top_p;          /* 1.0 = off */
  const char* ids_field; /* RLH_OUTPUT_LOGPROB_AT_IDS: the batch field holding ids */
} rlh_output_spec;

/* Forward-only request: outputs are written into caller-provided float32 host tensors of shape
 * [num_tokens] (or [num_tokens, k] for LOGPROB_AT_IDS), in batch order. */
typedef struct rlh_forward_args {
  size_t struct_size;
  const rlh_batch* batch;
  const rlh_output_spec* specs;  /* [num_outputs] */
  size_t num_outputs;
  const rlh_tensor* outputs;     /* [num_outputs], written */
  int64_t micro_batch_tokens;    /* upper bound on tokens per forward pass; 0 = backend's choice */
} rlh_forward_args;

/* What a loss callback receives for one micro-batch. Tensors live on the backend's device and
 * are valid during the call only. The callback writes loss (a 0-d float32 tensor) and one
 * gradient per output (d loss / d output, same shape), stream-ordered on `stream`; it must not
 * synchronise the device. It runs on the ranks that hold the outputs. */
typedef struct rlh_microbatch {
  size_t struct_size;
  const rlh_batch* batch;           /* this micro-batch's tokens and sliced fields */
  const rlh_named_tensor* outputs;  /* [num_outputs], as requested */
  size_t num_outputs;
  const rlh_tensor* grads;          /* [num_outputs], zeroed, to be written */
  const rlh_tensor* loss;           /* 0-d float32, to be written */
  int64_t global_num_tokens;        /* as passed in rlh_train_args */
  int64_t global_num_seqs;
  int64_t index;                    /* micro-batch index within the step */
  void* stream;                     /* NULL on CPU */
  /* Reports a metric of this micro-batch; the backend sums `value` over micro-batches and
   * ranks, so callers pass already-normalised contributions. */
  void (*metric)(void* metric_ctx, const char* name, double value);
  void* metric_ctx;
  /* (BACKEND 0.4; check RLH_HAS_FIELD and NULL) Reports a metric of this micro-batch as a 0-d
   * float32 tensor on the backend's device, written stream-ordered on `stream` before the
   * callback returns (the backend reads it after the callback, stream-ordered, never before).
   * The backend combines the values over micro-batches and ranks on the device by `reduce`
   * (RLH_METRIC_SUM: already-normalised contributions; RLH_METRIC_MIN / _MAX: extrema) and
   * reads them once, at the end of the step, with the loss and the gradient norm. Given to a
   * callback that asked for device tensors (rlh_train_args.loss_on_device); the same name must
   * come with the same `reduce` in every micro-batch. */
  void (*metric_tensor)(void* metric_ctx, const char* name, const rlh_tensor* value,
                        int32_t reduce);
} rlh_microbatch;

/* How rlh_microbatch.metric_tensor combines a metric over micro-batches and ranks. */
#define RLH_METRIC_SUM 0
#define RLH_METRIC_MIN 1
#define RLH_METRIC_MAX 2

typedef rlh_status* (*rlh_loss_fn)(void* user, const rlh_microbatch* mb);

/* One optimizer step over a global batch. */
typedef struct rlh_train_args {
  size_t struct_size;
  const rlh_batch* batch;
  const rlh_output_spec* specs;
  size_t num_outputs;
  rlh_loss_fn loss_fn;
  void* loss_user;
  int64_t global_num_tokens;  /* loss-normalisation counts for the whole global batch, */
  int64_t global_num_seqs;    /*   over all data-parallel ranks */
  int64_t micro_batch_seqs;   /* sequences per micro-batch; 0 = use micro_batch_tokens */
  int64_t micro_batch_tokens; /* token budget per packed micro-batch; 0 = backend's choice */
  double learning_rate;       /* for this step (the algorithm owns the schedule); <0 = config */
  uint8_t eval_only;          /* 1: run loss and metrics, no gradient step */
  uint8_t reserved0[7];
  /* (BACKEND 0.4) 1: loss_fn reads the outputs and the batch's float fields as tensors on the
   * backend's device and writes loss and grads there, stream-ordered on rlh_microbatch.stream
   * without synchronising, and reports its metrics through metric_tensor; the backend then
   * needs no host wait per micro-batch (batch->token_ids and seq_offsets stay host memory, and
   * the micro-batch's seq_offsets are also given as the int32 device field "cu_seqlens"
   * [num_seqs + 1], the form kernel ops take sequence offsets in).
   * A backend that cannot keep the loss on its device (a CPU backend) passes host tensors as
   * with 0. 0 (the default, and every caller of BACKEND 0.3 or older): host tensors. */
  uint8_t loss_on_device;
} rlh_train_args;

/* Result of a train step. Metrics (loss, grad_norm, MoE aux losses, ...) are written as a JSON
 * object through rlh_train_result.write. */
typedef struct rlh_train_result {
  size_t struct_size;
  double loss;        /* sum over micro-batches of the callback's loss */
  double grad_norm;   /* global norm before clipping */
  int64_t num_micro_batches;
  rlh_write_fn write; /* (optional, set by caller) receives the metrics JSON */
  void* user;
} rlh_train_result;

/* Loading a model into the backend. */
#define RLH_MODEL_TRAINABLE (1ull << 0) /* keep gradients and optimizer state */

typedef struct rlh_model_args {
  size_t struct_size;
  const char* role;              /* "policy", "reference", "critic", "teacher" */
  const char* path;              /* HF checkpoint folder (config.json + safetensors) */
  const char* description_json;  /* from a model component; NULL = the backend asks the host */
  size_t description_len;
  uint64_t flags;                /* RLH_MODEL_* */
  const char* config_json;       /* per-model overrides (optimizer, precision), may be NULL */
  size_t config_len;
} rlh_model_args;

/* A weight visited during refit or export: engine name, HF name and a view of the data in the
 * backend's layout. The view is valid during the callback only. */
typedef rlh_status* (*rlh_weight_fn)(void* user, const char* hf_name, const rlh_tensor* weight);

/* What a visit_weights_on caller can read (BACKEND 0.2). */
typedef struct rlh_visit_args {
  size_t struct_size;
  rlh_device device; /* besides host memory; {RLH_DEVICE_CPU, 0}: host memory only */
} rlh_visit_args;

/* One piece of a weight as this rank holds it (BACKEND 0.5, visit_weight_pieces): the box of the
 * whole HF tensor `hf_name` (of shape `global_shape`) that starts at `offset` and spans
 * data->shape, per dimension: element (i_0, .., i_n-1) of `data` is element (offset[0] + i_0, ..,
 * offset[n-1] + i_n-1) of the whole tensor. `data` has the whole tensor's ndim and the backend's
 * dtype (the dtype visit_weights gives); its strides need not be row-major. All pointers are valid
 * during the callback only. RLH_PIECE_SENDER marks the one copy of a piece that several ranks hold
 * alike (data-, context- or tensor-parallel replicas) that a caller should send: over all ranks,
 * the pieces so marked cover every element of every weight exactly once. */
#define RLH_PIECE_SENDER (1u << 0)

typedef struct rlh_weight_piece {
  size_t struct_size;
  const char* hf_name;
  const rlh_tensor* data;      /* this rank's piece, host memory */
  const int64_t* global_shape; /* [data->ndim]: the whole tensor's shape */
  const int64_t* offset;       /* [data->ndim]: where the piece starts in it */
  uint32_t flags;              /* RLH_PIECE_* */
  uint32_t reserved0;
} rlh_weight_piece;

typedef rlh_status* (*rlh_weight_piece_fn)(void* user, const rlh_weight_piece* piece);

typedef struct rlh_backend_api {
  size_t struct_size;

  /* Creates an instance with the backend's config section (JSON). */
  rlh_status* (*create)(const rlh_host_api* host, const char* config_json, size_t config_len,
                        rlh_backend** out);
  void (*destroy)(rlh_backend* self); /* NULL is a no-op; destroys its models */

  /* Loads a model; *out lives until unload_model or destroy. Externally synchronised. */
  rlh_status* (*load_model)(rlh_backend* self, const rlh_model_args* args, rlh_model** out);
  void (*unload_model)(rlh_backend* self, rlh_model* model);

  /* Forward pass producing the requested per-token outputs. */
  rlh_status* (*forward)(rlh_backend* self, rlh_model* model, const rlh_forward_args* args);

  /* One optimizer step (or an evaluation when args->eval_only). */
  rlh_status* (*train_step)(rlh_backend* self, rlh_model* model, const rlh_train_args* args,
                            rlh_train_result* result);

  /* Visits every weight in HF naming (consolidated, in the backend's dtype) — the source of
   * refit buckets and HF export. `version` receives the weights' version (train steps taken). */
  rlh_status* (*visit_weights)(rlh_backend* self, rlh_model* model, rlh_weight_fn fn,
                               void* user, int64_t* version);

  /* Saves the full training state of a model (weights as HF safetensors, optimizer state, step)
   * into folder `dir`, which the caller created and will rename atomically. */
  rlh_status* (*save_state)(rlh_backend* self, rlh_model* model, const char* dir);
  /* Restores what save_state wrote. */
  rlh_status* (*load_state)(rlh_backend* self, rlh_model* model, const char* dir);

  /* (BACKEND 0.2; optional: check RLH_HAS_FIELD(api, rlh_backend_api, visit_weights_on) and
   * NULL) visit_weights for a caller that can also read the memory of `args->device`: a model
   * whose weights live on that device is visited through views of its device buffers (the same
   * names, shapes and dtype as visit_weights gives; strides may not be row-major), so a colocated
   * generator refits without a host round trip. The backend's writes to them are complete when
   * the callback runs; the views are valid during the callback only, and the callback finishes
   * its reads of one before it returns. Weights that are not on that device come as host views.
   * `*version` is written before the first callback (a callback may pass it on). */
  rlh_status* (*visit_weights_on)(rlh_backend* self, rlh_model* model, const rlh_visit_args* args,
                                  rlh_weight_fn fn, void* user, int64_t* version);

  /* (BACKEND 0.3; optional: check RLH_HAS_FIELD(api, rlh_backend_api, data_parallel) and NULL)
   * The data-parallel layout of `model` over the launched ranks: this rank's data-parallel
   * `*rank` in [0, *size). The ranks of one model-parallel group (the tensor-, context- and
   * pipeline-parallel ranks of one model replica) share a data-parallel rank, and each must be
   * given that rank's batch shard in forward and train_step; expert-parallel ranks are
   * data-parallel ranks. Without the slot every launched rank is a data-parallel rank. */
  rlh_status* (*data_parallel)(rlh_backend* self, rlh_model* model, int32_t* rank, int32_t* size);

  /* (BACKEND 0.5; optional: check RLH_HAS_FIELD(api, rlh_backend_api, visit_weight_pieces) and
   * NULL) This rank's own pieces of the weights with their placement (rlh_weight_piece), in HF
   * naming, without gathering them: under tensor, pipeline, expert and context parallelism a rank
   * visits what it holds, so callers can send each piece straight to the ranks that need it
   * (NeMo-RL's nccl_reshard). A rank may hold no piece of a weight. Every rank of the model calls
   * it (a backend that shards weights flat, as FSDP does, may gather inside, as visit_weights
   * does; docs/backends.md says what the CPU engine does). The pieces' names, shapes, offsets and
   * flags stay the same from call to call for a loaded model, so a caller can exchange them once.
   * `*version` is written before the first callback. */
  rlh_status* (*visit_weight_pieces)(rlh_backend* self, rlh_model* model, rlh_weight_piece_fn fn,
                                     void* user, int64_t* version);
} rlh_backend_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_BACKEND_H_ */
