/* Runs the CPU demo's GRPO stage (examples/configs/grpo_demo_cpu.yaml, scripts/demo.sh stage 2)
 * from C99 through librlhost's embedding API (rlhost/host.h), as any C program would: create a
 * host, load the plugins, load the configuration, override a few keys, check it, run it, read the
 * metrics, destroy the host.
 *
 *   embed_grpo CONFIG MODEL_DIR OUT_DIR [STEPS]
 *
 * CONFIG is examples/configs/grpo_demo_cpu.yaml, MODEL_DIR an HF model folder (the demo's SFT
 * checkpoint, or rlh_tiny_model's output), OUT_DIR where checkpoints and logs go. Prints the
 * metrics of the last step and exits 0, or prints one line naming what went wrong and exits 1.
 * Build: see CMakeLists.txt here (find_package(rlsdk), target rlsdk::host).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rlhost/host.h"

/* Text arriving through rlh_write_fn callbacks, kept in one growing buffer. */
struct text {
  char* data;
  size_t len, cap;
  int failed;
};

static void append(void* user, const void* data, size_t len) {
  struct text* t = (struct text*)user;
  if (t->failed) return;
  if (t->len + len + 1 > t->cap) {
    size_t cap = t->cap ? t->cap : 4096;
    char* grown;
    while (cap < t->len + len + 1) cap *= 2;
    grown = (char*)realloc(t->data, cap);
    if (grown == NULL) {
      t->failed = 1;
      return;
    }
    t->data = grown;
    t->cap = cap;
  }
  memcpy(t->data + t->len, data, len);
  t->len += len;
  t->data[t->len] = '\0';
}

/* Prints a failed call's status as one line and frees it; returns 1 when there was one. */
static int failed(rlh_status* s, const char* what) {
  if (s == NULL) return 0;
  fprintf(stderr, "embed_grpo: error: %s: %.*s\n", what, (int)s->message_len, s->message);
  rlh_status_destroy(s);
  return 1;
}

/* The value of "name" in the last metrics line of that name with the highest step, or 0. */
static int last_metric(const char* jsonl, const char* name, double* value, long long* step) {
  char needle[128];
  const char* p = jsonl;
  int found = 0;
  snprintf(needle, sizeof needle, "{\"name\":\"%s\",", name);
  while ((p = strstr(p, needle)) != NULL) {
    const char* v = strstr(p, "\"value\":");
    const char* s = strstr(p, "\"step\":");
    if (v != NULL && s != NULL) {
      long long st = strtoll(s + 7, NULL, 10);
      if (!found || st >= *step) {
        *value = strtod(v + 8, NULL);
        *step = st;
        found = 1;
      }
    }
    p += strlen(needle);
  }
  return found;
}

int main(int argc, char** argv) {
  static const char* const plugins[] = {"dtensor", "generator", "grpo", "environments",
                                        "tokenizer_hf", "model_llama", "kernels_cpu"};
  static const char* const metrics[] = {"train/loss", "train/reward", "validation/accuracy"};
  char override_text[4096];
  struct text report = {NULL, 0, 0, 0}, lines = {NULL, 0, 0, 0};
  rlhost_t* host = NULL;
  const char* steps = argc > 4 ? argv[4] : "3";
  size_t i;
  int rc = 1;
  if (argc < 4 || argc > 5) {
    fprintf(stderr, "usage: embed_grpo CONFIG MODEL_DIR OUT_DIR [STEPS]\n");
    return 2;
  }
  if (failed(rlhost_create(&host), "rlhost_create")) return 1;
  rlhost_set_log_level(host, RLH_LOG_WARN);
  for (i = 0; i < sizeof plugins / sizeof plugins[0]; ++i)
    if (failed(rlhost_load_plugin(host, plugins[i]), plugins[i])) goto done;
  if (failed(rlhost_load_config(host, argv[1]), argv[1])) goto done;
  {
    /* The demo's stage 2 on MODEL_DIR, shortened to STEPS steps and small batches. */
    const char* const fmt[] = {"policy.model_name=%s", "checkpointing.checkpoint_dir=%s/checkpoints",
                               "logger.log_dir=%s/logs", "grpo.max_num_steps=%s"};
    const char* const arg[] = {argv[2], argv[3], argv[3], steps};
    static const char* const fixed[] = {"grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
                                        "grpo.val_period=2", "grpo.max_val_samples=16", "grpo.val_batch_size=16"};
    for (i = 0; i < 4; ++i) {
      snprintf(override_text, sizeof override_text, fmt[i], arg[i]);
      if (failed(rlhost_apply_override(host, override_text), override_text)) goto done;
    }
    for (i = 0; i < sizeof fixed / sizeof fixed[0]; ++i)
      if (failed(rlhost_apply_override(host, fixed[i]), fixed[i])) goto done;
  }
  /* What a run checks at start, with the NeMo-RL settings accepted without effect. */
  if (failed(rlhost_check_config(host, append, &report), "configuration")) goto done;
  if (report.failed) {
    fprintf(stderr, "embed_grpo: error: out of memory\n");
    goto done;
  }
  printf("checked: %s\n", report.data ? report.data : "{}");
  if (failed(rlhost_run(host), "run")) goto done;
  if (failed(rlhost_read_metrics(host, append, &lines), "read metrics")) goto done;
  if (lines.failed || lines.data == NULL) {
    fprintf(stderr, "embed_grpo: error: the run recorded no metrics\n");
    goto done;
  }
  for (i = 0; i < sizeof metrics / sizeof metrics[0]; ++i) {
    double v = 0;
    long long step = 0;
    if (last_metric(lines.data, metrics[i], &v, &step)) printf("%s = %g (step %lld)\n", metrics[i], v, step);
  }
  {
    double v = 0;
    long long step = 0;
    if (!last_metric(lines.data, "train/loss", &v, &step)) {
      fprintf(stderr, "embed_grpo: error: the run recorded no train/loss\n");
      goto done;
    }
    if (step != strtoll(steps, NULL, 10)) {
      fprintf(stderr, "embed_grpo: error: the last train/loss is of step %lld, expected %s\n", step, steps);
      goto done;
    }
  }
  rc = 0;
done:
  free(report.data);
  free(lines.data);
  rlhost_destroy(host);
  return rc;
}
